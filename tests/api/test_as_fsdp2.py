"""``use_as_fsdp2()``: code that imports FSDP2 at call time gets ours while swapped, torch's
after; and Hugging Face Accelerate's FSDP v2 preparation on a tiny random transformers model,
when those packages are installed (an optional extra), against torch's FSDP2."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import World

import functional_fsdp

NAMES = ("fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy")
MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed.fsdp._fully_shard._fsdp_api",
)


def _snapshot() -> dict[tuple[str, str], object]:
    out = {}
    for m in MODULES:
        mod = importlib.import_module(m)
        for n in NAMES:
            if n in vars(mod):
                out[(m, n)] = vars(mod)[n]
    return out


def _framework_prepare(model: nn.Module) -> nn.Module:
    """What a framework does: import FSDP2 when it is called, and apply it."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.float32)
    for child in model.children():
        fully_shard(child, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    assert isinstance(model, FSDPModule)
    return model


def test_swap_and_undo(one_rank: None) -> None:
    """Inside the block every swapped name is ours (call-time imports get ours); after it
    every one is torch's again, also after an exception and for a plain call with undo()."""
    before = _snapshot()
    assert before[("torch.distributed.fsdp", "fully_shard")] is not functional_fsdp.fully_shard
    with functional_fsdp.use_as_fsdp2() as swap:
        assert swap.active
        for (m, n), _ in before.items():
            assert vars(importlib.import_module(m))[n] is getattr(functional_fsdp, n), (m, n)
        model = _framework_prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
        assert isinstance(model, functional_fsdp.FSDPModule)
        assert isinstance(model[0], functional_fsdp.FSDPModule)
        model(torch.randn(3, 4)).sum().backward()
    assert not swap.active
    assert _snapshot() == before

    with pytest.raises(ValueError), functional_fsdp.use_as_fsdp2():
        raise ValueError("inside")
    assert _snapshot() == before

    outer = functional_fsdp.use_as_fsdp2()
    with functional_fsdp.use_as_fsdp2():  # nested: the inner undo leaves the outer swap
        pass
    assert _snapshot()[("torch.distributed.fsdp", "fully_shard")] is functional_fsdp.fully_shard
    outer.undo()
    outer.undo()  # a second undo does nothing
    assert _snapshot() == before
    plain = _framework_prepare(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    assert not isinstance(plain, functional_fsdp.FSDPModule)  # torch's FSDP2 again


def test_fully_shard_state_is_ours(one_rank: None) -> None:
    """``fully_shard.state(module)``, FSDP2's lookup, answers for our modules under both
    names (ours and torch's), and ``None`` for a module never sharded."""
    model = functional_fsdp.fully_shard(nn.Linear(4, 4))
    view = functional_fsdp.fully_shard.state(model)
    assert view is not None
    assert torch.distributed.fsdp.fully_shard.state(model) is view
    assert functional_fsdp.fully_shard.state(nn.Linear(2, 2)) is None


# ----------------------------------------------------------------------------- Accelerate

HAS_ACCELERATE = all(importlib.util.find_spec(p) for p in ("accelerate", "transformers"))


def _tiny_llama(tie: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _accelerate_fsdp2(model: nn.Module) -> nn.Module:
    """Accelerate's FSDP v2 preparation (``fsdp2_prepare_model``), driven directly: its
    ``Accelerator`` refuses FSDP on the CPU."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
    )

    class _Acc:  # the attributes fsdp2_prepare_model reads from an Accelerator
        state = type("S", (), {"fsdp_plugin": plugin})()
        mixed_precision = "no"
        device = torch.device("cpu")
        is_main_process = dist.get_rank() == 0

    return fsdp2_prepare_model(_Acc(), model)


def case_accelerate(tie: bool) -> dict[str, object]:
    """The same model prepared by Accelerate with torch's FSDP2 and with ours; 3 AdamW steps."""
    out: dict[str, object] = {}
    for which in ("torch", "ours"):
        swap = functional_fsdp.use_as_fsdp2() if which == "ours" else None
        try:
            model = _accelerate_fsdp2(_tiny_llama(tie))
        finally:
            if swap is not None:
                swap.undo()
        is_ours = isinstance(model, functional_fsdp.FSDPModule)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + dist.get_rank())
            ids = torch.randint(0, 64, (2, 12), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        out[which] = (is_ours, losses, full)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_ACCELERATE, reason="accelerate and transformers not installed")
@pytest.mark.parametrize("tie", [False, True])
def test_accelerate_fsdp2_path_matches_fsdp2(world2: World, tie: bool) -> None:
    """Accelerate's FSDP v2 preparation under use_as_fsdp2(): our modules, FSDP2's losses and
    parameters bit for bit (tied and untied embeddings)."""
    for res in world2.run(case_accelerate, tie):
        t_ours, t_losses, t_full = res["torch"]
        o_ours, o_losses, o_full = res["ours"]
        assert not t_ours and o_ours
        assert o_losses == t_losses
        assert all(torch.equal(o_full[k], t_full[k]) for k in t_full)
