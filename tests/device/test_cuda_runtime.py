"""The CUDA runtime's frees in stream order, checked on the CPU with a stand-in for ``torch.cuda``.

``CudaRuntime`` frees a buffer as soon as the stream that allocated it has seen the events of
its last users (vector clocks, ``shell/device/clocks.py``): the caching allocator gives a freed
block only to later work on that stream. Here:

- the clocks against an explicit happens-before relation, on random programs of records and
  waits (hypothesis);
- the free rule on small programs: a buffer waits for the allocating stream's wait, a buffer of
  unknown stream for the host;
- the engine on a ``CudaRuntime`` whose events never complete (the stand-in's ``query()`` is
  always false): training gives the CPU runtime's bits, every free is proven by the clocks (none
  waits for the host to poll), and nothing is left waiting after a step. Before, every free
  waited for the host to see its events complete, so with the host ahead of the GPU a backward
  kept every group's buffers (on an H200, 26.5 GiB against FSDP2's 21.2: docs/cuda.md).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import World
from _fully_shard_helpers import _build, _full_params, _train
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

from functional_fsdp.shell.device.clocks import VectorClocks
from functional_fsdp.shell.device.cuda import CudaRuntime
from functional_fsdp.testing.streams import use_runtime


class _FakeStream:
    def __init__(self) -> None:
        self.waited: list[Any] = []  # the streams and events it waited for

    def wait_stream(self, other: _FakeStream) -> None:
        self.waited.append(other)

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class _FakeEvent:
    def __init__(self) -> None:
        self.done = False  # the GPU never catches up (unless a test says so): the clocks free

    def record(self, stream: _FakeStream) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        pass


class FakeCuda:
    """What ``CudaRuntime`` uses of ``torch.cuda`` (:class:`TorchCuda`'s methods), on the CPU;
    its events never complete unless a test says so."""

    def __init__(self) -> None:
        self.current = _FakeStream()
        self.switches = 0

    def raw_current(self) -> int:
        return id(self.current)

    def current_stream(self) -> _FakeStream:
        return self.current

    def new_stream(self, priority: int) -> _FakeStream:
        return _FakeStream()

    def event(self) -> _FakeEvent:
        return _FakeEvent()

    def set_stream(self, native: _FakeStream) -> None:
        self.current = native
        self.switches += 1


def fake_runtime() -> CudaRuntime:
    return CudaRuntime(torch.device("cpu"), backend=FakeCuda())


# ------------------------------------------------------------------ the clocks


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["record", "wait_event", "wait_stream"]),
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(0, 50),
    ),
    max_size=40,
)


@given(_OPS)
def test_vector_clocks_order_exactly_what_the_waits_order(
    ops: list[tuple[str, int, int, int]],
) -> None:
    """Stream ``j`` has seen event ``e`` of stream ``i`` per the clocks exactly when a chain of
    waits leads from ``e`` to ``j`` (an explicit happens-before relation: the set of events each
    stream is ordered after)."""
    clocks = VectorClocks()
    streams = [clocks.add() for _ in range(4)]
    after: list[set[int]] = [set() for _ in streams]  # events each stream is ordered after
    events: list[tuple[int, tuple[int, ...], frozenset[int]]] = []  # (stream, clock, its set)

    def record(i: int) -> None:
        clocks.tick(streams[i])
        eid = len(events)
        after[i].add(eid)  # a stream is ordered after its own earlier events
        events.append((i, clocks.snapshot(streams[i]), frozenset(after[i])))

    for op, a, b, k in ops:
        if op == "record":
            record(a)
        elif op == "wait_event" and events:
            i, snap, seen = events[k % len(events)]
            clocks.merge(streams[a], snap)
            after[a] |= seen
        elif op == "wait_stream":  # torch records an event on the producer, then waits on it
            record(b)
            i, snap, seen = events[-1]
            clocks.merge(streams[a], snap)
            after[a] |= seen
    for j in range(4):
        for eid, (i, snap, _) in enumerate(events):
            want = eid in after[j]
            assert clocks.seen(streams[j], streams[i], snap[streams[i]]) == want


# ------------------------------------------------------------------ the free rule


def test_a_buffer_is_freed_once_its_allocating_stream_has_seen_its_users() -> None:
    rt = fake_runtime()
    ag = rt.side_stream("all_gather")
    with rt.use(ag):
        out = rt.empty(8, torch.float32, torch.device("cpu"))  # allocated on all_gather
    used = rt.record(rt.compute)  # compute read it (a copy-out)
    rt.free_after(out, [used])
    assert out.untyped_storage().size() > 0 and rt.deferred == 1  # all_gather has not waited
    rt.wait_stream(rt.side_stream("copy_in"), rt.compute)
    assert rt.deferred == 1  # another stream's wait proves nothing for all_gather
    rt.wait_stream(ag, rt.side_stream("copy_in"))  # ... but through copy_in it now has
    assert out.untyped_storage().size() == 0 and rt.deferred == 0
    assert rt.frees == {"at_once": 0, "by_clock": 1, "by_query": 0}

    mine = rt.empty(8, torch.float32, torch.device("cpu"))  # on compute, used on compute
    rt.free_after(mine, [rt.record(rt.compute)])
    assert mine.untyped_storage().size() == 0 and rt.frees["at_once"] == 1

    foreign = torch.empty(8)  # not the runtime's: its stream is unknown; the host must see
    ev = rt.record(ag)
    rt.free_after(foreign, [ev])
    rt.wait_event(rt.compute, ev)
    assert foreign.untyped_storage().size() > 0
    rt.host_wait(ev)
    assert foreign.untyped_storage().size() == 0 and rt.deferred == 0


def test_use_enters_and_leaves_streams_and_another_current_stream_is_a_new_clock() -> None:
    cuda = FakeCuda()
    rt = CudaRuntime(torch.device("cpu"), backend=cuda)
    compute, ag, rs = rt.compute, rt.side_stream("all_gather"), rt.side_stream("reduce_scatter")
    with rt.use(ag):
        assert cuda.current is ag.native and rt.compute is compute
        with rt.use(rs):
            assert cuda.current is rs.native
        assert cuda.current is ag.native
        with rt.use(ag):  # already current: nothing to switch
            pass
    assert cuda.current is compute.native and cuda.switches == 4
    # The user makes another stream current: compute is that stream, with a clock that has
    # seen nothing, so a buffer allocated on it waits for its own wait on the old compute.
    old = rt.record(compute)
    cuda.current = _FakeStream()
    assert rt.compute is not compute and rt.compute.index != compute.index
    buf = rt.empty(8, torch.float32, torch.device("cpu"))
    rt.free_after(buf, [old])
    assert rt.deferred == 1
    rt.wait_event(rt.compute, old)
    assert rt.deferred == 0 and buf.untyped_storage().size() == 0
    cuda.current = compute.native  # back on the first stream: its clock, not a new one
    assert rt.compute is compute


def test_a_deferred_free_runs_when_a_later_call_finds_its_events_complete() -> None:
    """The fallback: the host polls the events (``query()``) at every later call."""
    rt = fake_runtime()
    foreign = torch.empty(8)  # of unknown stream: only the host's view can free it
    ev = rt.record(rt.side_stream("all_gather"))
    rt.free_after(foreign, [ev])
    assert foreign.untyped_storage().size() == 32
    ev.native.done = True
    rt.free_after(torch.empty(1), [])  # any later call polls
    assert foreign.untyped_storage().size() == 0 and rt.frees["by_query"] == 1


def test_a_reallocation_cancels_a_deferred_free() -> None:
    """A storage allocated again before its deferred free ran is not freed under its new
    user (the engine orders the new writer after the old readers by events)."""
    rt = fake_runtime()
    buf = rt.empty(8, torch.float32, torch.device("cpu"))
    ev = rt.record(rt.side_stream("reduce_scatter"))
    rt.free_after(buf, [ev])
    assert rt.deferred == 1
    rt.allocated(rt.compute, buf)
    ev.native.done = True
    rt.wait_event(rt.compute, ev)
    rt.free_after(torch.empty(1), [])
    assert rt.deferred == 0 and buf.untyped_storage().size() == 32


# ------------------------------------------------------------------ the engine


def _on_fake_cuda(recipe: str, bucket: int | None = None) -> tuple[CudaRuntime, dict[str, Any]]:
    model = _build("ours", recipe)
    if bucket is not None:
        model.set_bucket_bytes(bucket)
    rt = fake_runtime()
    use_runtime(model, rt)
    _train(model, recipe)
    return rt, _full_params(model)


def _check(recipe: str, bucket: int | None = None) -> dict[str, Any]:
    rt, got = _on_fake_cuda(recipe, bucket)
    want = _full_params(_trained_on_cpu(recipe, bucket))
    return {
        "same": all(torch.equal(got[k], want[k]) for k in want),
        "frees": dict(rt.frees),
        "deferred": rt.deferred,
    }


def _trained_on_cpu(recipe: str, bucket: int | None) -> Any:
    model = _build("ours", recipe)
    if bucket is not None:
        model.set_bucket_bytes(bucket)
    _train(model, recipe)
    return model


def _assert_freed_by_clocks(res: dict[str, Any]) -> None:
    assert res["same"], res
    assert res["frees"]["by_query"] == 0, res  # the never-completing events freed nothing
    assert res["frees"]["at_once"] + res["frees"]["by_clock"] > 10, res
    assert res["deferred"] == 0, res  # nothing left for the host to poll after the steps


@pytest.mark.parametrize("recipe", ["default", "raf_false", "accum", "mp", "offload", "ckpt"])
def test_one_rank_training_frees_every_buffer_by_the_clocks(one_rank: None, recipe: str) -> None:
    _assert_freed_by_clocks(_check(recipe))


def test_the_functional_path_frees_every_buffer_by_the_clocks(one_rank: None) -> None:
    """``make_train_step`` (a gather per call, the reductions handed to ``torch.autograd.grad``)
    on the stand-in: the same frees by the clocks, the CPU runtime's bits."""
    from functional_fsdp.functional import init, make_train_step, sgd

    def run(fake: bool) -> tuple[list[torch.Tensor], CudaRuntime | None]:
        model = _build("ours", "default")
        rt = fake_runtime() if fake else None
        if rt is not None:
            use_runtime(model, rt)
        opt = sgd(0.1, momentum=0.9)
        step = make_train_step(model, lambda m, b: m.loss(*b), opt, grad_accum=2)
        state = init(model, opt)
        for s in range(2):
            state, _ = step(state, synthetic_batch_for_cfg(s))
        return [p.full_tensor() for p in state.params.values()], rt

    got, rt = run(True)
    want, _ = run(False)
    assert rt is not None and all(torch.equal(a, b) for a, b in zip(got, want))
    assert rt.frees["by_query"] == 0 and rt.deferred == 0, rt.frees


def test_the_next_forward_waits_for_the_post_optimizer_event(one_rank: None) -> None:
    """``set_post_optim_event`` (FSDP2's): an optimizer step on another stream writes the
    shards the next forward gathers, so the copy-in and all-gather streams wait for the
    user's event at the root's next pre-forward, once. (It was accepted and dropped: on CUDA
    the gathers could read shards the optimizer was still writing.)"""
    model = _build("ours", "default")
    rt = fake_runtime()
    use_runtime(model, rt)
    _train(model, "default", steps=1)
    ci, ag = rt.side_stream("copy_in").native, rt.side_stream("all_gather").native
    event = _FakeEvent()
    model.blocks[1].set_post_optim_event(event)  # any module of the tree: the root keeps it
    x, y = synthetic_batch_for_cfg(1)
    model.loss(x, y).backward()
    assert ci.waited.count(event) == 1 and ag.waited.count(event) == 1
    model.loss(x, y).backward()  # dropped after one forward, as FSDP2 does
    assert ci.waited.count(event) == 1 and ag.waited.count(event) == 1


def case_two_ranks_free_by_the_clocks() -> dict[str, dict[str, Any]]:
    """Packed and coalesced gathers (all-gather outputs, copy-in buffers), reduce-scatters,
    HSDP's all-reduce, no-sync accumulation, offload, bf16 casts and the rows kept after
    forward for ``reshard_after_forward=2``, on 2 ranks."""
    return {
        "default": _check("default"),
        "one collective per group": _check("default", bucket=0),
        "hsdp": _check("hsdp"),
        "accum": _check("accum"),
        "offload": _check("offload"),
        "bf16": _check("mp"),
        "reshard_after_forward=2": _check("raf_int"),
    }


@pytest.mark.multiprocess
def test_two_ranks_training_frees_every_buffer_by_the_clocks(world2: World) -> None:
    for res in world2.run(case_two_ranks_free_by_the_clocks):
        for r in res.values():
            _assert_freed_by_clocks(r)


# ------------------------------------------------------------------ found on the H200


def test_shard_like_wraps_the_tensor_itself_with_the_parameters_layout(one_rank: None) -> None:
    """``shard_like`` (gradients, optimizer moments and new shards wrapped like a parameter)
    wraps the very tensor it is given: ``DTensor.from_local`` copies a host tensor to a CUDA
    mesh's device, which under CPU offload put the first AdamW step's moments on the GPU beside
    host shards (the H200 run of ``benchmarks/bench_cuda.py``: the second step failed on mixed
    devices). On the CPU the device cannot differ, so what is checked is that nothing is copied
    or viewed, and that the layout is the parameter's with the tensor's own dtype."""
    from functional_fsdp.shell.engine.dtensors import shard_like

    model = _build("ours", "offload")
    p = next(model.parameters())
    for dtype in (torch.float32, torch.bfloat16):
        local = torch.zeros_like(p._local_tensor, dtype=dtype)
        dt = shard_like(local, p)
        assert dt._local_tensor is local and dt.dtype == dtype
        assert dt.placements == p.placements and dt.shape == p.shape
        assert dt.stride() == p.stride() and dt.device_mesh == p.device_mesh
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, "offload", steps=1)  # (its own optimizer; then one step of this one)
    x, y = synthetic_batch_for_cfg(5)
    model.loss(x, y).backward()
    opt.step()  # on local shards: the moments it made are wrapped as they are
    for q in model.parameters():
        m = opt.state[q]["exp_avg"]
        assert isinstance(m, DTensor) and m._local_tensor._base is None
        assert m._local_tensor.device == q._local_tensor.device


def synthetic_batch_for_cfg(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from _fully_shard_helpers import CFG

    from functional_fsdp.testing.models import synthetic_batch

    return synthetic_batch(CFG, 4, seed=seed)
