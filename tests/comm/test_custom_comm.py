"""FSDP2's communication extension points against torch FSDP2 doing the same on 2 gloo ranks:
custom all-gather / reduce-scatter objects, the all-reduce hook (1-D and HSDP), unshard in
backward, the process-group allocation hint, ``share_comm_ctx``, and misbehaving objects
(named errors on both ranks, then ``reset_iter_state`` recovers)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import World, shared_mesh
from _fully_shard_helpers import CFG, _all_equal, _full_params, _max_abs, _optimizer
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from functional_fsdp._compat import HAS_REDUCE_SCATTER_MAX_INPUT_BUFFERS
from functional_fsdp.testing.models import GPT, synthetic_batch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 2


class AllReduceAllGather(AllGather):
    """An all-gather done as an all-reduce of a zero-padded buffer; counts its calls."""

    def __init__(self, fail: str = "") -> None:
        self.calls = 0
        self.allocs = 0
        self.fail = fail  # misbehave once: "size" (allocate), "raise" or "resize" (the call)

    def _failing(self, kinds: tuple[str, ...]) -> bool:
        if self.fail in kinds:
            self.fail = ""
            return True
        return False

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocs += 1
        if self._failing(("size",)):
            return torch.empty(int(size[0]) - 1, dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        self.calls += 1
        fail = self.fail
        if self._failing(("raise", "resize")):
            if fail == "raise":
                raise RuntimeError("injected all-gather failure")
            output_tensor.resize_(1)
            return None
        n, r = input_tensor.numel(), dist.get_rank(group)
        mine = input_tensor.clone()  # the input is a slice of the output
        output_tensor.zero_()
        output_tensor.narrow(0, r * n, n).copy_(mine)
        return dist.all_reduce(output_tensor, group=group, async_op=async_op)


class AllReduceReduceScatter(ReduceScatter):
    """A reduce-scatter done as an all-reduce of the whole input and a slice (synchronous)."""

    def __init__(self) -> None:
        self.calls = 0
        self.allocs = 0
        self.ops: list[str] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocs += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self.calls += 1
        self.ops.append(str(op))
        dist.all_reduce(input_tensor, op=op, group=group)
        ws, r = dist.get_world_size(group), dist.get_rank(group)
        output_tensor.copy_(input_tensor.view(ws, -1)[r])
        return None


def _impl(which: str):
    if which == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from functional_fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def _build(which: str, *, mesh_shape: tuple[int, ...] = (), mp: bool = False, tok: bool = False):
    """The test GPT under ``which``; ``mesh_shape`` (replicate, shard) for HSDP; ``tok``: the
    token embedding is its own FSDP module."""
    fully_shard, MP = _impl(which)
    kw: dict = {}
    if mp:
        kw["mp_policy"] = MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if mesh_shape:
        kw["mesh"] = shared_mesh(mesh_shape, ("replicate", "shard"))
    torch.manual_seed(0)
    model = GPT(CFG)
    if tok:
        fully_shard(model.tok, **kw)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def _fsdp_modules(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _train(model: nn.Module, steps: int = STEPS, micro: int = 1, hsdp: bool = False) -> list:
    opt = _optimizer(model.parameters(), "adamw")
    losses = []
    for s in range(steps):
        total = 0.0
        for mb in range(micro):
            if hsdp and micro > 1:
                model.set_requires_all_reduce(mb == micro - 1)
            x, y = synthetic_batch(CFG, 2, seed=1000 * s + 10 * mb + dist.get_rank())
            loss = model.loss(x, y) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _compare(res: dict[str, dict]) -> dict:
    t, o = res["torch"], res["ours"]
    return {
        "torch": t,
        "ours": o,
        "losses_equal": t["losses"] == o["losses"],
        "params_equal": _all_equal(t["params"], o["params"]),
        "param_abs": _max_abs(t["params"], o["params"]),
    }


# ----------------------------------------------------------------------------- cases


def case_custom_collectives(mp: bool) -> dict:
    """Custom all-gather and reduce-scatter on every module, FSDP2 vs ours: same numbers and
    the same calls (collectives, allocations, reduce ops)."""
    out = {}
    for which in ("torch", "ours"):
        model = _build(which, mp=mp)
        ags, rss = [], []
        for m in _fsdp_modules(model):
            ag, rs = AllReduceAllGather(), AllReduceReduceScatter()
            m.set_custom_all_gather(ag)
            m.set_custom_reduce_scatter(rs)
            ags.append(ag)
            rss.append(rs)
        losses = _train(model)
        out[which] = {
            "losses": losses,
            "params": _full_params(model),
            "ag_calls": [a.calls for a in ags],
            "ag_allocs": [a.allocs for a in ags],
            "rs_calls": [r.calls for r in rss],
            "rs_allocs": [r.allocs for r in rss],
            "rs_ops": sorted({op for r in rss for op in r.ops}),
        }
    return _compare(out)


def case_all_reduce_hook(mesh_shape: tuple[int, ...], mp: bool, micro: int) -> dict:
    """A hook that records what it sees and halves the gradients in place, FSDP2 vs ours."""
    out = {}
    for which in ("torch", "ours"):
        model = _build(which, mesh_shape=mesh_shape, mp=mp)
        seen: list[tuple[int, str]] = []

        def hook(t: torch.Tensor, seen: list = seen) -> None:
            seen.append((t.numel(), str(t.dtype)))
            t.mul_(0.5)

        for m in _fsdp_modules(model):
            m.set_all_reduce_hook(hook)
        losses = _train(model, micro=micro, hsdp=bool(mesh_shape))
        out[which] = {"losses": losses, "params": _full_params(model), "seen": sorted(seen)}
    # Control: the hook changes training (halved gradients), so equal numbers mean it ran.
    plain = _build("ours", mesh_shape=mesh_shape, mp=mp)
    control = _train(plain, micro=micro, hsdp=bool(mesh_shape))
    res = _compare(out)
    res["hook_changes_losses"] = control != out["ours"]["losses"]
    return res


def case_unshard_in_backward(unshard: bool) -> dict:
    """The token embedding as its own module with ``set_unshard_in_backward``: its all-gathers
    counted by a custom all-gather (the same object type under FSDP2 and ours)."""
    out = {}
    for which in ("torch", "ours"):
        model = _build(which, tok=True)
        counter = AllReduceAllGather()
        model.tok.set_custom_all_gather(counter)
        model.tok.set_unshard_in_backward(unshard)
        losses = _train(model)
        out[which] = {"losses": losses, "params": _full_params(model), "gathers": counter.calls}
    return _compare(out)


def case_allocate_from_process_group() -> dict:
    """The NCCL allocation hint on gloo: FSDP2 and ours train exactly as without it."""
    from functional_fsdp import errors

    out = {}
    for which in ("torch", "ours"):
        model = _build(which)
        for m in _fsdp_modules(model):
            m.set_allocate_memory_from_process_group_for_comm(True)
        out[which] = {"losses": _train(model), "params": _full_params(model)}
    plain = _build("ours")
    res = _compare(out)
    res["plain_losses"] = _train(plain)
    res["plain_params_equal"] = _all_equal(_full_params(plain), out["ours"]["params"])
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    res["gloo_tensor_alloc"] = backend.supports_tensor_alloc(torch.device("cpu"))
    # As in FSDP2, not together with a custom collective.
    m = _build("ours")
    m.set_custom_all_gather(AllReduceAllGather())
    try:
        m.set_allocate_memory_from_process_group_for_comm(True)
        res["combined_error"] = None
    except errors.PolicyError as e:
        res["combined_error"] = str(e)
    return res


def case_share_comm_ctx() -> dict:
    """Two roots (pipeline-style model chunks) sharing a communication context train as without."""
    from torch.distributed.fsdp import share_comm_ctx as torch_share

    from functional_fsdp import errors
    from functional_fsdp.shell.api.module import share_comm_ctx
    from functional_fsdp.testing.streams import runtime_of

    out = {}
    shared = []
    for which, share in (("torch", torch_share), ("ours", share_comm_ctx)):
        model, other = _build(which), _build(which)
        share([model, other])
        out[which] = {"losses": _train(model), "params": _full_params(model)}
        if which == "ours":
            _train(other)
            shared = [runtime_of(model) is runtime_of(other)]
    res = _compare(out)
    res["one runtime"] = shared == [True]
    try:
        share_comm_ctx([nn.Linear(2, 2)])
        res["error"] = None
    except errors.StateError as e:
        res["error"] = type(e).__name__
    return res


def case_cuda_knobs() -> dict:
    """FSDP2's reduce-scatter knobs (max input buffers, separate group): the same numbers as
    FSDP2 with them set, and the same exception types for bad values."""
    out: dict[str, Any] = {}
    errs: dict[str, list[str]] = {}
    for which in ("torch", "ours"):
        model = _build(which)
        model.set_reduce_scatter_max_input_buffers(2)
        model.set_separate_reduce_scatter_group(True)
        out[which] = {"losses": _train(model), "params": _full_params(model)}
        errs[which] = []
        for bad in (True, 1.5, 0):
            try:
                model.set_reduce_scatter_max_input_buffers(bad)  # type: ignore[arg-type]
                errs[which].append("none")
            except (TypeError, ValueError) as e:
                errs[which].append("TypeError" if isinstance(e, TypeError) else "ValueError")
    res = _compare(out)
    res["errors"] = errs
    return res


def _expect(exc: type[BaseException], fn: Any) -> str:
    try:
        fn()
    except exc as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"expected {exc.__name__}")


def case_bad_objects() -> dict:
    """Misbehaving custom objects: named errors on both ranks, then reset_iter_state and
    training equals a run that never failed."""
    from functional_fsdp import errors

    ref = _build("ours")
    for m in _fsdp_modules(ref):
        m.set_custom_all_gather(AllReduceAllGather())
    ref_losses = _train(ref)
    res: dict[str, Any] = {"messages": []}
    msgs = res["messages"]
    m0 = _build("ours")
    msgs.append(_expect(errors.PolicyError, lambda: m0.set_custom_all_gather(object())))
    msgs.append(_expect(errors.PolicyError, lambda: m0.set_custom_reduce_scatter(42)))
    msgs.append(_expect(errors.PolicyError, lambda: m0.set_all_reduce_hook("not callable")))
    msgs.append(_expect(errors.StateError, lambda: m0.set_modules_to_forward_prefetch([1])))
    x, y = synthetic_batch(CFG, 2, seed=dist.get_rank())
    recovered = []
    for fail, exc in (
        ("size", errors.LayoutMismatchError),
        ("raise", errors.CollectiveError),
        ("resize", errors.LayoutMismatchError),
    ):
        model = _build("ours")
        bad = AllReduceAllGather(fail=fail)  # one object: only the first gather misbehaves
        for m in _fsdp_modules(model):
            m.set_custom_all_gather(bad)
        msgs.append(_expect(exc, lambda model=model: model.loss(x, y).backward()))
        model.reset_iter_state()
        recovered.append(_train(model) == ref_losses)
    # A hook that raises (on both ranks): the backward fails, reset, then train afresh.
    model = _build("ours")
    for m in _fsdp_modules(model):
        m.set_custom_all_gather(AllReduceAllGather())

    def bad_hook(t: torch.Tensor) -> None:
        raise ValueError("injected hook failure")

    model.blocks[1].set_all_reduce_hook(bad_hook)
    msgs.append(_expect(errors.CollectiveError, lambda: model.loss(x, y).backward()))
    model.reset_iter_state()
    model.zero_grad(set_to_none=True)
    model.blocks[1].set_all_reduce_hook(None)
    recovered.append(_train(model) == ref_losses)
    res["recovered"] = recovered
    return res


def case_hook_fails_on_one_rank() -> dict:
    """A hook that raises on rank 0 only: rank 0 raises CollectiveError, rank 1 a named
    collective error at its next wait (never a hang); reset on both and training continues."""
    from functional_fsdp import errors

    model = _build("ours")

    def hook(t: torch.Tensor) -> None:
        if dist.get_rank() == 0:
            raise ValueError("injected on rank 0")

    model.blocks[2].set_all_reduce_hook(hook)
    errs = []
    for s in range(3):
        x, y = synthetic_batch(CFG, 2, seed=s + dist.get_rank())
        try:
            model.loss(x, y).backward()
        except errors.CollectiveError as e:
            errs.append(type(e).__name__)
            break
    model.reset_iter_state()
    model.zero_grad(set_to_none=True)
    model.blocks[2].set_all_reduce_hook(None)
    losses = _train(model, steps=1)
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"errors": errs, "after": losses, "all_reduce": t.item()}


# ----------------------------------------------------------------------------- tests


def _bit_identical(res: dict) -> None:
    assert res["losses_equal"], (res["torch"]["losses"], res["ours"]["losses"])
    assert res["params_equal"], ("max abs difference", res["param_abs"])


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16"])
def test_custom_collectives_match_fsdp2(world2: World, mp: bool) -> None:
    for res in world2.run(case_custom_collectives, mp):
        _bit_identical(res)
        t, o = res["torch"], res["ours"]
        # Every module's collectives ran through its own custom objects, as many times as in
        # FSDP2: the root gathers once per step (kept through backward), each block twice.
        assert o["ag_calls"] == t["ag_calls"] == [STEPS] + [2 * STEPS] * CFG.n_layers, res
        assert o["rs_calls"] == t["rs_calls"] == [STEPS] * (CFG.n_layers + 1), res
        assert o["ag_allocs"] == t["ag_allocs"] == o["ag_calls"]
        assert o["rs_allocs"] == t["rs_allocs"] == [2 * c for c in o["rs_calls"]]
        assert o["rs_ops"] == t["rs_ops"] == ["RedOpType.AVG"], res


@pytest.mark.parametrize(
    "mesh_shape, mp, micro",
    [((), False, 1), ((), True, 1), ((2, 1), False, 2), ((1, 2), False, 2)],
    ids=["fsdp", "fsdp-bf16", "hsdp-2x1-partial", "hsdp-1x2-partial"],
)
def test_all_reduce_hook_matches_fsdp2(world2: World, mesh_shape, mp, micro) -> None:
    for res in world2.run(case_all_reduce_hook, mesh_shape, mp, micro):
        _bit_identical(res)
        assert res["hook_changes_losses"]
        seen_t, seen_o = res["torch"]["seen"], res["ours"]["seen"]
        # Once per group and step (HSDP: only on the micro-batch that all-reduces), in the
        # reduce dtype (fp32 also under bf16 compute).
        assert seen_o == seen_t and len(seen_o) == STEPS * (CFG.n_layers + 1), seen_o
        assert {d for _, d in seen_o} == {"torch.float32"}


@pytest.mark.skipif(
    not HAS_REDUCE_SCATTER_MAX_INPUT_BUFFERS,
    reason="FSDP2 has set_reduce_scatter_max_input_buffers from torch 2.13 on",
)
def test_reduce_scatter_knobs_match_fsdp2(world2: World) -> None:
    for res in world2.run(case_cuda_knobs):
        _bit_identical(res)
        assert (
            res["errors"]["ours"]
            == res["errors"]["torch"]
            == [
                "TypeError",
                "TypeError",
                "ValueError",
            ]
        )


def test_unshard_in_backward_matches_fsdp2(world2: World) -> None:
    for res in world2.run(case_unshard_in_backward, False):
        _bit_identical(res)
        assert res["ours"]["gathers"] == res["torch"]["gathers"] == STEPS  # forward only
    for res in world2.run(case_unshard_in_backward, True):  # control: forward and backward
        _bit_identical(res)
        assert res["ours"]["gathers"] == res["torch"]["gathers"] == 2 * STEPS


def test_allocate_from_process_group_is_accepted(world2: World) -> None:
    for res in world2.run(case_allocate_from_process_group):
        _bit_identical(res)
        assert res["plain_losses"] == res["ours"]["losses"] and res["plain_params_equal"]
        assert res["gloo_tensor_alloc"] is False  # why it is a no-op on gloo (FSDP2 too)
        assert "custom" in res["combined_error"]


def test_share_comm_ctx(world2: World) -> None:
    for res in world2.run(case_share_comm_ctx):
        assert res.pop("one runtime"), "the two roots do not share one runtime"
        _bit_identical(res)
        assert res["error"] == "StateError"


def test_bad_objects_raise_named_errors_and_reset_recovers(world2: World) -> None:
    for res in world2.run(case_bad_objects):
        msgs = res["messages"]
        assert msgs[0].startswith("PolicyError") and "AllGather protocol" in msgs[0]
        assert "ReduceScatter protocol" in msgs[1]
        assert "allocate((" in msgs[4] and "returned" in msgs[4], msgs[4]
        assert "injected all-gather failure" in msgs[5], msgs[5]
        assert "changed the size" in msgs[6], msgs[6]
        assert "injected hook failure" in msgs[7] and "reset_iter_state" in msgs[7]
        assert res["recovered"] == [True] * 4, res["recovered"]


def test_hook_failing_on_one_rank_never_hangs(world2: World) -> None:
    r0, r1 = world2.run(case_hook_fails_on_one_rank, timeout=120)
    assert r0["errors"] == ["CollectiveError"], r0
    assert r1["errors"] and r1["errors"][0] in ("PeerAbortedError", "CollectiveTimeoutError"), r1
    assert r0["all_reduce"] == r1["all_reduce"] == 2.0


def case_hook_failing_in_the_final_callback() -> dict:
    """The root's all-reduce hook raises on every rank. The root's reduction is the last of
    the backward, so it lands in the final callback: the backward raises there. With no
    ``reset_iter_state()`` the next forward must reset by itself and train as a fresh
    model."""
    from functional_fsdp import errors

    ref_losses = _train(_build("ours"))
    model = _build("ours")
    armed = [True]

    def hook(t: torch.Tensor) -> None:
        if armed[0]:
            raise ValueError("injected in the final callback")

    model.set_all_reduce_hook(hook)
    x, y = synthetic_batch(CFG, 2, seed=99 + dist.get_rank())
    raised = _expect(errors.CollectiveError, lambda: model.loss(x, y).backward())
    # The root's iteration records the failure (the callback is no longer queued to say so).
    interrupted = model._ffsdp_state.root_phase.interrupted
    armed[0] = False
    model.zero_grad(set_to_none=True)
    return {"raised": raised, "interrupted": interrupted, "recovered": _train(model) == ref_losses}


def test_a_hook_failing_in_the_final_callback_resets_at_the_next_forward(world2: World) -> None:
    for r in world2.run(case_hook_failing_in_the_final_callback, timeout=120):
        assert "injected in the final callback" in r["raised"], r
        assert r["interrupted"] and r["recovered"], r
