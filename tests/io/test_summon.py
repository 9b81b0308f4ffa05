"""summon_full_params on real gloo ranks (2 and 4): writeback, errors, rank0_only, grads.

One 2-rank and one 4-rank world serve the module. The model has uneven parameter sizes and
parameters with fewer rows than ranks (empty shards); every case compares the sharded model with
a plain copy of the same initial weights that receives the same edits.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _dist import World
from _full import full_parameters
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functional_fsdp import MixedPrecisionPolicy, fully_shard, summon_full_params
from functional_fsdp.core.errors import PolicyError, StateError
from functional_fsdp.shell.engine.group import TrainingState

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

VOCAB, DIM, HID, OUT = 7, 6, 5, 3


@pytest.fixture(params=[2, 4], ids=["ws2", "ws4"])
def world(request):
    return request.getfixturevalue(f"world{request.param}")


# ----------------------------------------------------------------------------- model (ranks)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, HID)  # weight (5, 6): 3+2 rows on 2 ranks, 2+2+1+0 on 4
        self.out = nn.Linear(HID, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(x)))


class Toy(nn.Module):
    """Uneven sizes everywhere; ``tiny`` (1 row) and ``head`` (3 rows) leave shards empty."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.tiny = nn.Parameter(torch.randn(1, DIM))
        self.frozen = nn.Parameter(torch.randn(2, DIM), requires_grad=False)
        self.head = nn.Linear(DIM, OUT)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.tiny + self.frozen.sum(0)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


NAMES = [n for n, _ in Toy().named_parameters()]


def _models(mp: bool = False) -> tuple[nn.Module, nn.Module]:
    """(plain reference, sharded model) from the same initial weights."""
    torch.manual_seed(0)
    ref = Toy()
    model = copy.deepcopy(ref)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if mp else {}
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return ref, model


def _batch(seed: int, per_rank: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of a global batch (the same on every world size)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (ws * per_rank, 4), generator=g)
    return x, x[rank * per_rank : (rank + 1) * per_rank]


def _groups(model: nn.Module) -> list:
    return [
        m._ffsdp_state.group
        for m in model.modules()
        if getattr(m, "_ffsdp_state", None) is not None
    ]


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [g.state.flat.clone() for g in _groups(model)]


def _assert_sharded_and_consistent(
    model: nn.Module, snapshot: list[torch.Tensor] | None = None
) -> None:
    """Sharded DTensor params registered, views into each group's flat buffer, state idle."""
    from torch.distributed.tensor import DTensor

    for i, g in enumerate(_groups(model)):
        assert g.training_state is TrainingState.IDLE
        base = g.state.flat.untyped_storage().data_ptr()
        for p, holders in zip(g.params, g.holders):
            for m, n in holders:
                assert m._parameters[n] is p
            assert isinstance(p, DTensor)
            if p._local_tensor.numel():
                assert p._local_tensor.untyped_storage().data_ptr() == base
        if snapshot is not None:
            assert torch.equal(g.state.flat, snapshot[i])


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return full_parameters(model)


def _edit(model: nn.Module) -> None:
    """A fixed set of edits: in place, via .data, a row write, and a replaced Parameter."""
    with torch.no_grad():
        model.emb.weight.mul_(2.0)
        model.blocks[0].fc.weight.data[1:] = 0.25
        model.tiny.add_(1.0)
        model.head.weight[-1].fill_(-1.0)
    model.blocks[1].out.bias = nn.Parameter(torch.arange(float(DIM)))


# ----------------------------------------------------------------------------- cases (ranks)


def case_edit_writeback(mp: bool) -> None:
    ref, model = _models(mp)
    _, x = _batch(1)
    params_before = list(model.parameters())  # the sharded DTensor parameters
    with torch.no_grad():
        model(x)  # the root keeps its unsharded buffer after forward: it must not go stale
    with summon_full_params(model):
        for n, p in model.named_parameters():
            assert type(p) is nn.Parameter and p.dtype == torch.float32, n
            assert torch.equal(p, dict(ref.named_parameters())[n]), n
        _edit(model)
    _edit(ref)
    _assert_sharded_and_consistent(model)
    assert list(model.parameters()) == params_before  # the same Parameter objects
    full, want = _full(model), dict(ref.named_parameters())
    for n in NAMES:
        assert torch.equal(full[n], want[n]), n
    with torch.no_grad():
        got = model(x)
        expect = ref(x)
        # With param_dtype=bfloat16 the sharded model computes in bfloat16: the same
        # operations on the same bfloat16 parameters as a bfloat16 copy of the plain model.
        expect_mp = copy.deepcopy(ref).to(torch.bfloat16)(x)
    assert torch.equal(got, expect_mp if mp else expect)


def case_edit_then_train() -> None:
    """Optimizer state keeps working on the same Parameter objects after a writeback."""
    ref, model = _models()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x_all, x = _batch(10 + step)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x_all).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with summon_full_params(model), torch.no_grad():
            model.head.weight.mul_(0.5)
        with torch.no_grad():
            ref.head.weight.mul_(0.5)
    full = _full(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=1e-5, atol=1e-6)


def case_writeback_false() -> None:
    ref, model = _models()
    _, x = _batch(2)
    snap = _snapshot(model)
    with summon_full_params(model, writeback=False):
        _edit(model)
    _assert_sharded_and_consistent(model, snap)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def case_recurse_false() -> None:
    _, model = _models()
    from torch.distributed.tensor import DTensor

    with summon_full_params(model.blocks[0], recurse=False):
        assert not isinstance(model.blocks[0].fc.weight, DTensor)
        assert isinstance(model.blocks[1].fc.weight, DTensor)
        assert isinstance(model.emb.weight, DTensor)
    with summon_full_params(model, recurse=False):
        assert not isinstance(model.emb.weight, DTensor)
        assert isinstance(model.blocks[0].fc.weight, DTensor)
        # Disjoint groups may nest (FSDP1 allows it too).
        with summon_full_params(model.blocks[1]):
            assert not isinstance(model.blocks[1].fc.weight, DTensor)
    _assert_sharded_and_consistent(model)


def case_errors() -> list[str]:
    """Every misuse raises before any collective and leaves the state untouched."""
    _, model = _models()
    _, x = _batch(3)
    snap = _snapshot(model)
    messages = []

    def expect(exc: type[Exception], fn) -> None:
        with pytest.raises(exc) as info:
            fn()
        messages.append(str(info.value))
        _assert_sharded_and_consistent(model, snap)

    def enter(**kw):
        with summon_full_params(model, **kw):
            pass

    expect(PolicyError, lambda: enter(writeback=True, rank0_only=True))
    expect(PolicyError, lambda: enter(with_grads=True, offload_to_cpu=True))

    def nested():
        with summon_full_params(model), summon_full_params(model.blocks[0]):
            pass

    expect(StateError, nested)

    def during_forward():
        handle = model.blocks[1].register_forward_pre_hook(lambda m, a: enter())
        try:
            with torch.no_grad():
                model(x)
        finally:
            handle.remove()
            model.reset_iter_state()

    expect(StateError, during_forward)

    def during_backward():
        out = model(x).sum()
        out.register_hook(lambda g: enter())
        try:
            out.backward()
        finally:
            model.reset_iter_state()

    expect(StateError, during_backward)

    def forward_inside():
        with summon_full_params(model, writeback=False):
            model(x)

    expect(StateError, forward_inside)

    def wrong_shape():
        with summon_full_params(model):
            model.head.bias = nn.Parameter(torch.zeros(OUT + 1))

    expect(StateError, wrong_shape)
    with torch.device("meta"):
        meta = Toy()
    fully_shard(meta)
    with pytest.raises(StateError, match="meta device"), summon_full_params(meta):
        pass
    # Still usable afterwards.
    with summon_full_params(model, writeback=False):
        pass
    with torch.no_grad():
        model(x)
    return messages


def case_exception_inside() -> None:
    """An exception inside writes back (FSDP1's semantics) and restores the sharded state."""
    ref, model = _models()
    _, x = _batch(4)
    with pytest.raises(ValueError, match="boom"), summon_full_params(model):
        _edit(model)
        raise ValueError("boom")
    _edit(ref)
    _assert_sharded_and_consistent(model)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    snap = _snapshot(model)
    with pytest.raises(KeyError), summon_full_params(model, writeback=False):
        _edit(model)
        raise KeyError("x")
    _assert_sharded_and_consistent(model, snap)


def case_rank0_only_offload() -> dict:
    from torch.distributed.tensor import DTensor

    ref, model = _models()
    rank = dist.get_rank()
    snap = _snapshot(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=True):
            full = dict(model.named_parameters())
            if rank == 0:
                for n, p in ref.named_parameters():
                    assert not isinstance(full[n], DTensor) and full[n].device.type == "cpu"
                    assert torch.equal(full[n], p)
            else:
                assert all(isinstance(p, DTensor) for p in full.values())
        quiet = [str(w.message) for w in caught if "summon_full_params" in str(w.message)]
        with summon_full_params(model, writeback=False, offload_to_cpu=True):
            for n, p in ref.named_parameters():
                assert torch.equal(dict(model.named_parameters())[n], p)
                assert dict(model.named_parameters())[n].device.type == "cpu"
        loud = [str(w.message) for w in caught if "summon_full_params" in str(w.message)][
            len(quiet) :
        ]
    _assert_sharded_and_consistent(model, snap)
    return {"quiet": quiet, "loud": loud}


def case_with_grads() -> None:
    ref, model = _models()
    x_all, x = _batch(5)
    model(x).square().mean().backward()
    ref(x_all).square().mean().backward()
    with summon_full_params(model, with_grads=True):
        for n, p in ref.named_parameters():
            full = dict(model.named_parameters())[n]
            if p.grad is None:
                assert full.grad is None, n
            else:
                torch.testing.assert_close(full.grad, p.grad, rtol=1e-5, atol=1e-7)
                full.grad.mul_(2.0)
        model.head.bias.grad = None  # clearing a gradient inside is written back too
    for n, p in model.named_parameters():
        want = dict(ref.named_parameters())[n].grad
        if n == "head.bias" or want is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad.full_tensor(), 2.0 * want, rtol=1e-5, atol=1e-7)
    # Without gradients anywhere, none are materialised.
    model.zero_grad(set_to_none=True)
    with summon_full_params(model, with_grads=True):
        assert all(p.grad is None for p in model.parameters())
    _assert_sharded_and_consistent(model)


def case_random_edits(edits: list[tuple[int, str, float, int]]) -> None:
    """Property body: the same edits through summon (writeback) and on the plain model agree."""
    ref, model = _models()
    _, x = _batch(6)

    def apply(m: nn.Module) -> None:
        params = dict(m.named_parameters())
        with torch.no_grad():
            for idx, op, value, row in edits:
                p = params[NAMES[idx % len(NAMES)]]
                r = row % p.shape[0]
                if op == "scale":
                    p.mul_(value)
                elif op == "add":
                    p.add_(value)
                elif op == "fill_row":
                    p[r].fill_(value)
                else:
                    p.data = torch.full_like(p, value)

    with summon_full_params(model):
        apply(model)
    apply(ref)
    _assert_sharded_and_consistent(model)
    full = _full(model)
    for n, p in ref.named_parameters():
        assert torch.equal(full[n], p.detach()), n
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16_params"])
def test_edits_survive_writeback(world: World, mp: bool) -> None:
    world.run(case_edit_writeback, mp)


def test_edits_then_training_match_plain_model(world: World) -> None:
    world.run(case_edit_then_train)


def test_writeback_false_discards_edits(world: World) -> None:
    world.run(case_writeback_false)


def test_recurse_false_summons_one_group(world2: World) -> None:
    world2.run(case_recurse_false)


def test_errors_are_clear_and_leave_state_untouched(world: World) -> None:
    messages = world.run(case_errors)[0]
    assert "rank0_only=True" in messages[0] and "writeback=False" in messages[0]
    assert "offload_to_cpu=False" in messages[1]
    assert "already summoned" in messages[2]
    assert "forward" in messages[3]
    assert "backward" in messages[4]
    assert "inside summon_full_params" in messages[5]
    assert "full shape" in messages[6]


def test_exception_inside_restores_and_writes_back(world: World) -> None:
    world.run(case_exception_inside)


def test_rank0_only_and_offload_to_cpu(world: World) -> None:
    for r in world.run(case_rank0_only_offload):
        assert r["quiet"] == []
        assert len(r["loud"]) == 1 and "rank0_only=True" in r["loud"][0]


def test_with_grads_shows_and_writes_back_full_grads(world: World) -> None:
    world.run(case_with_grads)


_EDIT = st.tuples(
    st.integers(0, len(NAMES) - 1),
    st.sampled_from(["scale", "add", "fill_row", "assign_data"]),
    st.sampled_from([-2.0, -0.5, 0.0, 0.125, 3.0]),
    st.integers(0, 16),
)


@pytest.mark.parametrize("ws", [2, 4])
def test_property_summon_edit_equals_plain_edit(request: pytest.FixtureRequest, ws: int) -> None:
    world = request.getfixturevalue(f"world{ws}")

    @settings(
        max_examples=8,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(edits=st.lists(_EDIT, min_size=1, max_size=5))
    def prop(edits: list) -> None:
        world.run(case_random_edits, edits)

    prop()
