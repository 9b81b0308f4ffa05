"""torchtitan's FSDP recipe, replicated without torchtitan, against torch's FSDP2.

The recipe: build a Llama-style model on the meta device, ``fully_shard`` each block, then
``norm`` and ``output`` as one list-form group, then the root; ``model.to_empty(device=...)``
and ``model.init_weights()``; AdamW; a DCP save and a load into a freshly built model, and more
steps. Ours must give FSDP2's losses and parameters bit for bit on 2 gloo ranks, and each
implementation must load the other's checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import World
from _full import full_parameters
from _llama import Llama, LlamaConfig, loss_fn, tokens
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

CFG = LlamaConfig(vocab=64, dim=32, n_layers=2, n_heads=4, hidden=48, seq=8)
STEPS = 2


def _fully_shard(which: str):
    if which == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from functional_fsdp import fully_shard
    return fully_shard


def _build(which: str, *, multi_module_group: bool = True) -> Llama:
    """torchtitan's order: meta init, per-block groups, [norm, output], root, to_empty, init."""
    fully_shard = _fully_shard(which)
    with torch.device("meta"):
        model = Llama(CFG)
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=True)
    if multi_module_group:
        fully_shard([model.norm, model.output], reshard_after_forward=False)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(1)  # init_weights draws from the RNG: the same draws both ways
    model.init_weights()
    return model


def _train(model: Llama, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x, y = tokens(CFG, 2, seed=100 * s + dist.get_rank())
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model: Llama) -> dict[str, torch.Tensor]:
    return {n: p.clone() for n, p in full_parameters(model).items()}


def _optimizer(model: Llama) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _save(model: Llama, opt: torch.optim.Optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load(model: Llama, opt: torch.optim.Optimizer, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def case_recipe(tmp: str) -> dict[str, object]:
    """Train, save, load into a fresh model (its own and the other's checkpoint), train on."""
    out: dict[str, object] = {}
    for which in ("torch", "ours"):
        model = _build(which)
        init = _full(model)
        opt = _optimizer(model)
        losses = _train(model, opt, range(STEPS))
        saved = _full(model)
        _save(model, opt, os.path.join(tmp, which))
        out[which] = (init, losses, saved)
    for which, other in (("torch", "ours"), ("ours", "torch")):
        for source in (which, other):  # its own checkpoint, then the other implementation's
            model = _build(which)
            opt = _optimizer(model)
            _train(model, opt, range(1))  # AdamW state exists before the load, as in a resume
            _load(model, opt, os.path.join(tmp, source))
            loaded = _full(model)
            losses = _train(model, opt, range(STEPS, 2 * STEPS))
            out[f"{which}<-{source}"] = (loaded, losses, _full(model))
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return all(torch.equal(a[k], b[k]) for k in a)


def test_torchtitan_recipe_is_bit_identical_to_fsdp2(world2: World, tmp_path) -> None:
    """Meta init, per-block and list-form groups, to_empty + init_weights, AdamW, a DCP round
    trip in both directions: every loss and parameter equal to FSDP2's."""
    for res in world2.run(case_recipe, str(tmp_path)):
        t_init, t_losses, t_saved = res["torch"]
        o_init, o_losses, o_saved = res["ours"]
        assert _equal(t_init, o_init)
        assert t_losses == o_losses
        assert _equal(t_saved, o_saved)
        ref_loaded, ref_losses, ref_final = res["torch<-torch"]
        assert _equal(ref_loaded, t_saved)
        for key in ("torch<-ours", "ours<-ours", "ours<-torch"):
            loaded, losses, final = res[key]
            assert _equal(loaded, t_saved), key
            assert losses == ref_losses, key
            assert _equal(final, ref_final), key
