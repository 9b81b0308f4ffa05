"""``torch.distributed.pipelining`` over stages sharded with our ``fully_shard``, no adapter.

Four gloo ranks as a 2 x 2 mesh ``(pp, dp)``: each pipeline rank holds one stage (GPipe,
1F1B) or two (interleaved 1F1B, four stages), each stage's blocks and the stage itself sharded
over ``dp``. torch's schedules drive the stages as they drive FSDP2's: no-sync backwards per
micro-batch, then the stage's ``perform_reduce_grad`` (``fully_shard.state(m)`` and its groups'
``post_backward``, the root's final callback), and for the interleaved schedule
``unshard(async_op=True)`` / ``reshard()``. Losses and parameters must equal FSDP2's doing the
same, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import World, shared_mesh
from _llama import Llama, LlamaConfig, loss_fn, tokens

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 2
MICRO = 4
BATCH = 4


def _stage_model(cfg: LlamaConfig, stage: int, n_stages: int) -> Llama:
    """The whole model from one seed, cut to ``stage``'s blocks (torchtitan's way)."""
    torch.manual_seed(0)
    model = Llama(cfg)
    per = cfg.n_layers // n_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < n_stages - 1:
        model.norm = None
        model.output = None
    return model


def _shard(which: str, model: Llama, mesh) -> Llama:
    if which == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from functional_fsdp import fully_shard
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _run(which: str, schedule_name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    world = shared_mesh((2, 2), ("pp", "dp"))
    pp_rank, pp_size = world["pp"].get_local_rank(), 2
    dp_rank = world["dp"].get_local_rank()
    per_rank = 2 if schedule_name == "interleaved" else 1
    n_stages = pp_size * per_rank
    cfg = LlamaConfig(n_layers=n_stages)
    stage_ids = [pp_rank + pp_size * k for k in range(per_rank)]
    models = [_shard(which, _stage_model(cfg, s, n_stages), world["dp"]) for s in stage_ids]
    stages = [
        PipelineStage(m, s, n_stages, torch.device("cpu"), group=world["pp"].get_group())
        for m, s in zip(models, stage_ids)
    ]
    if schedule_name == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
        schedule = cls(stages[0], n_microbatches=MICRO, loss_fn=loss_fn)
    params = [p for m in models for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    losses: list[float] = []
    for step in range(STEPS):
        x, y = tokens(cfg, BATCH, seed=100 * step + dp_rank)
        step_losses: list[torch.Tensor] = []
        kw = {"target": y, "losses": step_losses} if last else {}
        if first:
            schedule.step(x, **kw)
        else:
            schedule.step(**kw)
        opt.step()
        opt.zero_grad()
        losses += [loss.item() for loss in step_losses]
    full = {
        f"{s}.{n}": p.full_tensor().detach().clone()
        for s, m in zip(stage_ids, models)
        for n, p in m.named_parameters()
    }
    return losses, full


def case_pipeline(schedule_name: str) -> dict[str, object]:
    """FSDP2's run, then ours, on the same data: losses and full parameters of each."""
    out = {w: _run(w, schedule_name) for w in ("torch", "ours")}
    dist.barrier()
    return out


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b", "interleaved"])
def test_pipeline_schedules_match_fsdp2(world4: World, schedule_name: str) -> None:
    """2 stages x 2 dp (interleaved: 4 stages, 2 per rank): losses and parameters equal to
    FSDP2's, bit for bit, and the last stage has one loss per micro-batch and step."""
    for rank, res in enumerate(world4.run(case_pipeline, schedule_name)):
        t_losses, t_params = res["torch"]
        o_losses, o_params = res["ours"]
        is_last_rank = rank // 2 == 1
        assert len(t_losses) == (STEPS * MICRO if is_last_rank else 0)
        assert o_losses == t_losses
        assert t_params.keys() == o_params.keys()
        for k in t_params:
            assert torch.equal(t_params[k], o_params[k]), k
