"""fully_shard against torch FSDP2 and a single-process reference, on real gloo ranks.

One 2-rank world and one 4-rank world serve the whole module; each case builds the same small
GPT (dims not divisible by the world size) under torch's ``fully_shard`` and ours, trains it with
AdamW on the same data, and compares per-step losses and final full parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import World
from _fully_shard_helpers import (
    CFG,
    STEPS,
    _all_equal,
    _build,
    _full_params,
    _max_abs,
    _max_rel,
    _optimizer,
    _train,
)

from functional_fsdp.testing.models import GPT, synthetic_batch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


# ----------------------------------------------------------------------------- cases (ranks)


def case_parity(recipe: str) -> dict:
    torch_model = _build("torch", recipe)
    lt = _train(torch_model, recipe)
    ours = _build("ours", recipe)
    lo = _train(ours, recipe)
    pt, po = _full_params(torch_model), _full_params(ours)
    return {
        "torch": lt,
        "ours": lo,
        "param_rel": _max_rel(pt, po),
        "param_abs": _max_abs(pt, po),
        "params_equal": _all_equal(pt, po),
    }


def case_single_process_reference(recipe: str) -> dict:
    """Ours on N ranks vs one plain model on the global batch (all ranks' data)."""
    ours = _build("ours", recipe)
    lo = _train(ours, recipe, opt_kind="sgd")
    ws = dist.get_world_size()
    torch.manual_seed(0)
    ref = GPT(CFG)
    opt = _optimizer(ref.parameters(), "sgd")
    lr = []
    for s in range(STEPS):
        batches = [synthetic_batch(CFG, 2, seed=1000 * s + r) for r in range(ws)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        loss = ref.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        lr.append(loss.item())
    # Each rank's loss is the mean over its own batch: the global loss is their mean.
    lo_t = torch.tensor(lo)
    dist.all_reduce(lo_t)
    return {
        "ours": (lo_t / ws).tolist(),
        "ref": lr,
        "param_rel": _max_rel(_full_params(ref), _full_params(ours)),
    }


# ----------------------------------------------------------------------------- tests


def _check(res: dict, key: str, tol: float) -> None:
    a, b = torch.tensor(res[key]), torch.tensor(res["ours"])
    assert torch.allclose(a, b, rtol=tol, atol=tol), (res[key], res["ours"])
    assert res["param_rel"] <= tol, res["param_rel"]


def _check_bit_identical(res: dict) -> None:
    assert res["ours"] == res["torch"], (res["torch"], res["ours"])
    assert res["params_equal"], ("max abs difference", res["param_abs"])


@pytest.mark.parametrize(
    "recipe", ["default", "raf_false", "offload", "accum", "meta", "ckpt", "shard1", "list"]
)
def test_parity_with_torch_fsdp2_fp32(world2: World, recipe: str) -> None:
    """The README's claim: on 2 ranks in fp32, losses and full parameters equal FSDP2's bits."""
    for res in world2.run(case_parity, recipe):
        _check_bit_identical(res)


def test_parity_with_torch_fsdp2_bf16(world2: World) -> None:
    # bf16 compute with fp32 reduction: the same casts and the same 2-rank sums as FSDP2, so
    # also bit-identical (measured; a tolerance here would hide a changed cast).
    for res in world2.run(case_parity, "mp"):
        _check_bit_identical(res)


@pytest.mark.parametrize("recipe", ["default", "raf_false"])
def test_matches_single_process_reference(world2: World, recipe: str) -> None:
    # A different computation (one mean over the global batch vs the mean of per-rank means):
    # measured 4.8e-7 absolute on the losses (about 4.6), 2.7e-7 relative on the parameters.
    for res in world2.run(case_single_process_reference, recipe):
        _check(res, "ref", 1e-6)


def test_parity_four_ranks_hsdp_is_bit_identical(world4: World) -> None:
    # A (2 replicas x 2 shards) mesh only ever sums 2 floats, which is exact in either order.
    for res in world4.run(case_parity, "hsdp"):
        _check_bit_identical(res)


@pytest.mark.parametrize("recipe", ["raf_int", "default"])
def test_parity_four_ranks(world4: World, recipe: str) -> None:
    # Not bit-identical on 4 ranks: a sum of 2 floats is the same in either order, a sum of 4
    # depends on the association, and FSDP2's collectives and ours associate differently.
    # Measured: parameters 8.7e-7 relative (2.4e-7 absolute), losses 4.8e-7 absolute.
    for res in world4.run(case_parity, recipe):
        _check(res, "torch", 2e-6)


def test_four_ranks_single_process_reference(world4: World) -> None:
    # As on 2 ranks; measured 4.8e-7 on the losses, 3.5e-7 relative on the parameters.
    for res in world4.run(case_single_process_reference, "hsdp"):
        _check(res, "ref", 1e-6)
