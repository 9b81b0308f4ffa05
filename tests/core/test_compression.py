"""Compressed gradient reduction (beyond FSDP2): the pure codec and reduce-scatter in the
simulated world (drawn shapes, world sizes 1-8, every wire format), the error-feedback
identity, bytes on the wire, non-finite gradients, bad input; then the module path on 2 gloo
ranks (error feedback across steps, training tracks the exact reduction, named errors)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import World, shared_mesh
from _fully_shard_helpers import CFG
from hypothesis import given
from hypothesis import strategies as st

import functional_fsdp as F
from functional_fsdp import errors
from functional_fsdp.core.compression import decode_sum, encode_rows, wire_bytes
from functional_fsdp.testing import SimulatedWorld
from functional_fsdp.testing.models import GPT, pattern_batch, synthetic_batch

FORMATS = [torch.int8, torch.float8_e4m3fn, torch.bfloat16, torch.float16]
# Largest relative error of one encoded element against its block's absmax.
REL_STEP = {
    torch.int8: 0.5 / 127,
    torch.float8_e4m3fn: 2.0**-4,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


def _compressed() -> F.ReducePolicy:
    """The reduction with the default compression (int8 blocks, error feedback)."""
    return F.ReducePolicy(compression=F.GradCompression())


def _tree(seed: int, shapes: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(*s, generator=g) for i, s in enumerate(shapes)}


shape_lists = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 9)).map(lambda t: t if t[1] > 1 else t[:1]),
    min_size=1,
    max_size=4,
)


def _reduce_both(ws: int, shapes: list, policy: F.GradCompression, steps: int = 1) -> list:
    """Per rank: (exact reductions, compressed reductions, the final reduction state)."""
    full = _tree(0, shapes)
    per_rank = [[_tree(100 * s + r + 1, shapes) for s in range(steps)] for r in range(ws)]

    def body(comm: Any, grads: list) -> tuple:
        state = F.shard(full, world_size=ws, rank=comm.rank)
        exact, comp = [], []
        cstate, carry = state, F.ReduceState()
        for g in grads:
            exact.append(F.reduce_grad(g, state, comm, accumulate=False))
            cstate, carry = F.reduce_grad_with_state(
                g,
                cstate,
                carry,
                comm,
                accumulate=False,
                policy=F.ReducePolicy(compression=policy),
            )
            comp.append(cstate)
        return exact, comp, carry

    return SimulatedWorld(ws).run(body, per_rank)


@given(
    ws=st.integers(1, 8),
    shapes=shape_lists,
    dtype=st.sampled_from(FORMATS),
    block=st.sampled_from([1, 7, 64, 256]),
)
def test_compressed_reduce_is_exact_up_to_one_encoding_step(ws, shapes, dtype, block) -> None:
    """decode(all_to_all(encode(x))) summed over ranks equals the exact reduce-scatter up to
    one encoding step per peer row (world size 1: exactly)."""
    policy = F.GradCompression(dtype=dtype, block_size=block)
    grads_max = max(t.abs().max().item() for r in range(ws) for t in _tree(r + 1, shapes).values())
    for exact, comp, _ in _reduce_both(ws, shapes, policy):
        for i in range(len(shapes)):
            e, c = exact[0].local_grad(i), comp[0].local_grad(i)
            assert e is not None and c is not None and c.dtype == e.dtype
            if e.numel() == 0:
                continue
            bound = (ws - 1) / ws * grads_max * REL_STEP[dtype] * 1.01 + 1e-6
            assert (e - c).abs().max().item() <= bound
            if ws == 1:
                assert torch.equal(e, c)


@given(ws=st.integers(2, 6), shapes=shape_lists, dtype=st.sampled_from(FORMATS))
def test_error_feedback_loses_nothing_over_steps(ws, shapes, dtype) -> None:
    """The identity of error feedback: after k steps, the sum of the compressed reductions plus
    what the peers still hold back for this rank's rows equals the sum of the exact ones."""
    policy = F.GradCompression(dtype=dtype, block_size=16)
    steps = 4
    results = _reduce_both(ws, shapes, policy, steps)
    residuals = [r[2].residual.view(ws, -1) for r in results]  # (ws, S) per rank
    lay = results[0][0][0].layout
    for rank, (exact, comp, _) in enumerate(results):
        held = sum(residuals[p][rank] for p in range(ws) if p != rank) / ws  # avg reduction
        off = 0
        for i, shape in enumerate(lay.shard_shapes):
            n = int(torch.tensor(shape).prod())
            want = sum(e.grads[i] for e in exact).reshape(-1)
            got = sum(c.grads[i] for c in comp).reshape(-1) + held[off : off + n]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            off += n
        assert torch.equal(residuals[rank][rank], torch.zeros_like(residuals[rank][rank]))


class CountingComm:
    """A communicator that counts the bytes each rank sends to its peers."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.sent = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False):
        ws = self.inner.world_size
        self.sent += input.numel() * input.element_size() * (ws - 1) // ws
        return self.inner.all_to_all(output, input, async_op=async_op)

    def reduce_scatter(self, output, input, *, op="sum", async_op=False):
        ws = self.inner.world_size
        self.sent += input.numel() * input.element_size() * (ws - 1) // ws
        return self.inner.reduce_scatter(output, input, op=op, async_op=async_op)


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("dtype", FORMATS + [None])
def test_bytes_on_the_wire(ws: int, dtype) -> None:
    """What the reduction sends equals wire_bytes(); int8 sends 3.9x fewer bytes than fp32."""
    full = {"w": torch.randn(64, 48), "b": torch.randn(48), "e": torch.randn(100, 16)}
    policy = None if dtype is None else F.GradCompression(dtype=dtype)

    def body(comm: Any) -> tuple[int, int]:
        state = F.shard(full, world_size=ws, rank=comm.rank)
        counting = CountingComm(comm)
        F.reduce_grad_with_state(
            full, state, F.ReduceState(), counting, policy=F.ReducePolicy(compression=policy)
        )
        return counting.sent, wire_bytes(state.layout, policy)

    for sent, expected in SimulatedWorld(ws).run(body):
        assert sent == expected
    state = F.shard(full, world_size=ws, rank=0)
    ratio = wire_bytes(state.layout, None) / wire_bytes(state.layout, F.GradCompression())
    assert 3.8 < ratio < 4.0


def test_non_finite_gradients_stay_non_finite() -> None:
    """An inf on one rank makes the owner's block nan (a grad scaler still skips the step); the
    residual stays finite and the next reduction is clean again."""
    full = {"w": torch.zeros(8, 4)}

    def body(comm: Any) -> tuple:
        state = F.shard(full, world_size=2, rank=comm.rank)
        bad = torch.ones(8, 4)
        if comm.rank == 0:
            bad[6, 1] = float("inf")  # row 6 belongs to rank 1
        s1, c1 = F.reduce_grad_with_state(
            {"w": bad}, state, F.ReduceState(), comm, policy=_compressed()
        )
        s2, _ = F.reduce_grad_with_state(
            {"w": torch.ones(8, 4)}, s1, c1, comm, accumulate=False, policy=_compressed()
        )
        return s1, s2, c1

    (a1, a2, ac), (b1, b2, bc) = SimulatedWorld(2).run(body)
    assert torch.isfinite(a1.local_grad(0)).all()  # rank 0's own rows never leave it
    assert torch.isnan(b1.local_grad(0)).any()
    for c in (ac, bc):
        assert torch.isfinite(c.residual).all()
    for s in (a2, b2):
        assert torch.isfinite(s.local_grad(0)).all()


def test_codec_round_trip_and_decode_order() -> None:
    """What a receiver decodes is ``x - error`` (encode_rows' error); the own row is summed
    exactly, in rank order."""
    x = torch.randn(3, 1000) * torch.logspace(-6, 3, 1000)
    for dtype in FORMATS:
        for block in (100, 128):  # padded last block or not
            policy = F.GradCompression(dtype=dtype, block_size=block)
            wire, err = encode_rows(x, policy)
            assert wire.shape == (3, policy.row_bytes(1000)) and wire.dtype == torch.uint8
            assert err.abs().max() > 0
            out = torch.empty(1000)
            decode_sum(wire, x[1], 1, policy, out)
            want = (x[0] - err[0]) + x[1] + (x[2] - err[2])
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6 * x.abs().max().item())


def test_bad_input_is_refused_before_any_collective() -> None:
    with pytest.raises(errors.PolicyError, match=r"torch\.int8"):
        F.GradCompression(dtype=torch.float32)
    with pytest.raises(errors.PolicyError, match="block_size"):
        F.GradCompression(block_size=0)
    state = F.shard({"w": torch.randn(6, 2)}, world_size=2, rank=0)

    class Silent:
        world_size, rank, supports_pieces = 2, 0, False

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"a collective ran: {name}")

    g = {"w": torch.ones(6, 2)}
    with pytest.raises(errors.LayoutMismatchError, match="residual"):
        F.reduce_grad_with_state(
            g, state, F.ReduceState(residual=torch.zeros(5)), Silent(), policy=_compressed()
        )
    # Error feedback keeps a residual for the next reduction: reduce_grad would drop it.
    with pytest.raises(errors.StateError, match="reduce_grad_with_state"):
        F.reduce_grad(g, state, Silent(), policy=_compressed())
    with pytest.raises(errors.StateError, match="ReduceState"):
        F.reduce_grad_with_state(g, state, None, Silent(), policy=_compressed())  # type: ignore[arg-type]

    with pytest.raises(errors.StateError, match="GradCompression"):
        F.ReducePolicy(compression="int8")  # type: ignore[arg-type]
    with pytest.raises(errors.StateError, match="ReducePolicy"):
        F.reduce_grad({"w": torch.ones(6, 2)}, state, Silent(), policy="int8")  # type: ignore[arg-type]


def test_hsdp_compresses_the_shard_reduction_only() -> None:
    """2x2 mesh: compressed reduce-scatter over the shard group, exact replicate all-reduce."""
    full = {"w": torch.randn(16, 8)}
    grads = [
        {"w": torch.randn(16, 8, generator=torch.Generator().manual_seed(r))} for r in range(4)
    ]
    world = SimulatedWorld(4, mesh_shape=(2, 2))

    def body(comm: Any, g: dict) -> tuple:
        r = comm.rank
        shard_c, rep_c = world.shard_comm(r), world.replicate_comm(r)
        state = F.shard(full, world_size=2, rank=shard_c.rank)
        exact = F.reduce_grad(g, state, shard_c, replicate_comm=rep_c)
        comp, carry = F.reduce_grad_with_state(
            g, state, F.ReduceState(), shard_c, replicate_comm=rep_c, policy=_compressed()
        )
        return exact.local_grad(0), comp.local_grad(0), carry.residual

    for e, c, res in world.run(body, grads):
        assert (e - c).abs().max().item() < 0.03 and not torch.equal(e, c)
        assert res is not None and res.abs().max() > 0


# ----------------------------------------------------------------- the module path, 2 ranks


def _build(compression: F.GradCompression | None, mesh: Any = None) -> Any:
    torch.manual_seed(0)
    model = GPT(CFG)
    for b in model.blocks:
        F.fully_shard(b, mesh=mesh)
    F.fully_shard(model, mesh=mesh)
    if compression is not None:
        model.set_gradient_compression(compression)
    return model


def _train(model: Any, opt: Any, steps: int, micro: int = 1) -> list[float]:
    """``steps`` optimizer steps of ``micro`` micro-batches each (gradient sync on the last)."""
    losses = []
    for s in range(steps):
        for mb in range(micro):
            model.set_requires_gradient_sync(mb == micro - 1)
            x, y = pattern_batch(CFG, 4 // micro, seed=100 * s + 10 * mb + dist.get_rank())
            loss = model.loss(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _local_grads(model: Any) -> list[torch.Tensor]:
    return [p.grad._local_tensor.clone() for p in model.parameters()]


def case_error_feedback_across_steps(k: int) -> dict:
    """The same batch k times with no optimizer step: the compressed gradients summed over the
    k backwards approach k x the exact one with error feedback (the residual carries over), and
    drift away without it (the same rounding every time)."""
    x, y = synthetic_batch(CFG, 2, seed=dist.get_rank())
    exact_model = _build(None)
    exact_model.loss(x, y).backward()
    exact = _local_grads(exact_model)
    out: dict[str, Any] = {}
    for ef in (True, False):
        model = _build(F.GradCompression(block_size=64, error_feedback=ef))
        total = [torch.zeros_like(e) for e in exact]
        first = None
        for _ in range(k):
            model.loss(x, y).backward()
            grads = _local_grads(model)
            first = first or grads
            total = [t + g for t, g in zip(total, grads)]
            model.zero_grad(set_to_none=True)
        groups = [m._ffsdp_state.group for m in model.modules() if hasattr(m, "_ffsdp_state")]
        out[ef] = {
            "first_err": max((f - e).abs().max().item() for f, e in zip(first, exact)),
            "sum_err": max((t - k * e).abs().max().item() for t, e in zip(total, exact)),
            "residuals": [g.reduce_state.residual is not None for g in groups if g is not None],
        }
    out["exact_max"] = max(e.abs().max().item() for e in exact)
    return out


def case_training_tracks_exact(steps: int) -> dict:
    """AdamW for some steps: int8 with error feedback tracks the exact reduction's losses."""
    losses = {}
    for name, policy in (("exact", None), ("int8", F.GradCompression())):
        model = _build(policy)
        losses[name] = _train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), steps)
    # Switching it off drops every residual.
    model.set_gradient_compression(None)
    groups = [m._ffsdp_state.group for m in model.modules() if hasattr(m, "_ffsdp_state")]
    losses["residuals_after_off"] = [g.reduce_state.residual for g in groups if g is not None]
    return losses


def case_hsdp_and_accumulation(mesh_shape: tuple[int, int]) -> dict:
    """HSDP (replicate, shard) and two micro-batches without gradient sync on the first: the
    compressed model trains beside the exact one; a shard group of one rank stays exact."""

    mesh = shared_mesh(mesh_shape, ("replicate", "shard"))
    out: dict[str, Any] = {}
    for name, policy in (("exact", None), ("int8", F.GradCompression())):
        model = _build(policy, mesh)
        out[name] = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 3, micro=2)
    return out


def case_errors() -> list[str]:
    """Named errors, raised before any collective, nothing changed."""
    from test_custom_comm import AllReduceReduceScatter
    from torch.func import functional_call

    msgs = []
    model = _build(None)
    with pytest.raises(errors.PolicyError, match="GradCompression") as e1:
        model.set_gradient_compression("int8")
    msgs.append(str(e1.value))
    model.blocks[0].set_custom_reduce_scatter(AllReduceReduceScatter())
    with pytest.raises(errors.PolicyError, match="custom reduce-scatter") as e2:
        model.set_gradient_compression(F.GradCompression())
    msgs.append(str(e2.value))
    groups = [m._ffsdp_state.group for m in model.modules() if hasattr(m, "_ffsdp_state")]
    assert all(g.config.grad_compression is None for g in groups if g is not None)  # unchanged
    model.blocks[0].set_custom_reduce_scatter(None)
    model.set_gradient_compression(F.GradCompression())
    with pytest.raises(errors.PolicyError, match="set_gradient_compression") as e3:
        model.blocks[1].set_custom_reduce_scatter(AllReduceReduceScatter())
    msgs.append(str(e3.value))
    x, _ = synthetic_batch(CFG, 2, seed=0)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(errors.UnsupportedError, match="residual") as e4:
        functional_call(model, params, (x,))
    msgs.append(str(e4.value))
    model.reset_iter_state()
    return msgs


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_error_feedback_carries_over_between_backwards(world2: World) -> None:
    for res in world2.run(case_error_feedback_across_steps, 8):
        ef, plain = res[True], res[False]
        assert all(ef["residuals"]) and not any(plain["residuals"])
        assert ef["first_err"] == plain["first_err"] > 0  # compression ran
        # Error feedback: the summed error stays about one step's; without it, k times one.
        assert ef["sum_err"] < 2 * ef["first_err"], res
        assert plain["sum_err"] > 4 * ef["sum_err"], res


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_compressed_training_tracks_exact_reduction(world2: World) -> None:
    res0, res1 = world2.run(case_training_tracks_exact, 12)
    for res in (res0, res1):
        exact, int8 = res["exact"], res["int8"]
        assert exact != int8  # compression changed the numbers...
        assert max(abs(a - b) for a, b in zip(exact, int8)) < 0.02 * exact[0]  # ...a little
        assert int8[-1] < int8[0] - 0.2, res  # and it trains
        assert all(r is None for r in res["residuals_after_off"])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 1)], ids=["hsdp-1x2", "hsdp-2x1"])
def test_compressed_hsdp_with_accumulation(world2: World, mesh_shape) -> None:
    for res in world2.run(case_hsdp_and_accumulation, mesh_shape):
        exact, int8 = res["exact"], res["int8"]
        if mesh_shape[1] == 1:
            assert exact == int8, res  # a one-rank shard group sends nothing: exact
        else:
            assert exact != int8 and max(abs(a - b) for a, b in zip(exact, int8)) < 0.02, res


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_compression_bad_input_named_errors(world2: World) -> None:
    for msgs in world2.run(case_errors):
        assert len(msgs) == 4, msgs


def _groups(model: Any) -> list:
    return [
        m._ffsdp_state.group
        for m in model.modules()
        if getattr(m, "_ffsdp_state", None) is not None and m._ffsdp_state.group is not None
    ]


def _load(model: Any, opt: Any, path: str) -> None:
    """The documented resume: ``load_checkpoint`` into the state dict, then ``set_state_dict``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    F.load_checkpoint(sd, path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def case_rollback_equals_fresh_resume(path: str) -> dict:
    """Train 2 steps with int8 + error feedback, save, train 2 more (the residual moves on),
    roll the same model back to the checkpoint and train 2 steps; a fresh model loading the
    same checkpoint and training the same 2 steps is the truth (it starts from zero residuals)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    policy = F.GradCompression(block_size=64)
    live = _build(policy)
    opt = torch.optim.AdamW(live.parameters(), lr=1e-2)
    _train(live, opt, 2)
    msd, osd = get_state_dict(live, opt)
    F.save_checkpoint({"model": msd, "optim": osd}, path)
    _train(live, opt, 2)
    had_residual = [g.reduce_state.residual is not None for g in _groups(live)]
    _load(live, opt, path)
    residual_after_load = [g.reduce_state.residual is not None for g in _groups(live)]
    rolled = _train(live, opt, 2)

    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them
    fresh = _build(policy)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    _load(fresh, fresh_opt, path)
    resumed = _train(fresh, fresh_opt, 2)
    pairs = list(zip(live.parameters(), fresh.parameters()))
    return {
        "had_residual": had_residual,
        "residual_after_load": residual_after_load,
        "losses": (rolled, resumed),
        "params_equal": [torch.equal(a._local_tensor, b._local_tensor) for a, b in pairs],
        "max_diff": max((a._local_tensor - b._local_tensor).abs().max().item() for a, b in pairs),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_loading_parameters_resets_the_residual(world2: World, tmp_path) -> None:
    """docs/compression.md: a resumed run starts from zero residuals, in a fresh process or in
    the same one, so rolling back and continuing equals resuming, bit for bit."""
    for res in world2.run(case_rollback_equals_fresh_resume, str(tmp_path / "ckpt")):
        assert all(res["had_residual"]), res  # compression ran and kept a residual
        assert not any(res["residual_after_load"]), res
        rolled, resumed = res["losses"]
        assert rolled == resumed, res
        assert all(res["params_equal"]), res["max_diff"]


@pytest.mark.parametrize("ws", [2, 3])
def test_a_group_of_only_empty_shards_reduces_compressed(ws: int) -> None:
    """Nothing goes on the wire for a ``(0, n)`` parameter (a zero-width byte buffer cannot be
    viewed as the scales' dtype: it raised before)."""

    def body(c: Any) -> Any:
        s = F.shard({"a": torch.randn(0, 3)}, world_size=ws, rank=c.rank)
        return F.reduce_grad_with_state(
            {"a": torch.zeros(0, 3)}, s, F.ReduceState(), c, policy=_compressed()
        )[0]

    for out in SimulatedWorld(ws).run(body):
        assert out.grads[0].shape == (0, 3)
