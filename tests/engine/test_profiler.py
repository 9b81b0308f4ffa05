"""Every collective and transition the shell issues shows in a profiler trace under FSDP2's
``record_function`` names (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import World

pytestmark = pytest.mark.multiprocess


def _trace_names() -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    from functional_fsdp import fully_shard, summon_full_params
    from functional_fsdp.testing.models import GPT, GPTConfig, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, dim=32, n_layers=2, n_heads=2, seq=16)
    model = GPT(cfg)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model, bucket_bytes=0)  # FSDP2's names, one collective per group
    x, y = synthetic_batch(cfg, 2, seed=dist.get_rank())
    model.loss(x, y).backward()  # lazy init and the recorded order happen before the trace
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.loss(x, y).backward()
        with summon_full_params(model):
            pass
        torch.func.functional_call(model, dict(model.named_parameters()), (x,))
    return sorted({e.name for e in prof.events() if e.name.startswith("FSDP::")})


def test_fsdp_steps_are_named_in_the_profiler_trace(world2: World) -> None:
    for names in world2.run(_trace_names):
        for want in (
            "FSDP::root_pre_forward (GPT)",
            "FSDP::pre_forward (Block)",
            "FSDP::post_forward (Block)",
            "FSDP::all_gather (Block)",
            "FSDP::all_gather_copy_out (Block)",
            "FSDP::pre_backward (Block)",
            "FSDP::post_backward (Block)",
            "FSDP::post_backward_reduce (Block)",
            "FSDP::post_backward_rs_wait (Block)",
            "FSDP::root_post_backward_callback",
            "FSDP::summon_full_params (GPT)",
            "FSDP::all_gather (GPT)",
        ):
            assert want in names, (want, names)
