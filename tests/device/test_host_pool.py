"""The host buffer pool (``shell/device/pool.py``): memory moves, contents never leak.

A freed buffer's storage is left with no memory (as ``resize_(0)`` leaves it), a buffer given
memory again keeps its storage (views autograd saved see the new contents), the pool retains at
most its size, and live buffers never share memory.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_fsdp._compat import HAS_SWAP_DATA_PTR
from functional_fsdp.shell.device.pool import (
    MAX_BYTES,
    MIN_BYTES,
    PER_SIZE,
    HostBufferPool,
    size_class,
)
from functional_fsdp.shell.device.runtime import CPURuntime

N = MIN_BYTES // 4  # float32 elements of the smallest pooled buffer

#: The tests that count what the pool kept; on torch 2.11 it keeps nothing (and every buffer is
#: new), which ``test_without_storage_moves_nothing_is_kept`` checks on every torch.
keeps_memory = pytest.mark.skipif(
    not HAS_SWAP_DATA_PTR,
    reason="no UntypedStorage._swap_data_ptr_ in this torch (2.11): the pool keeps nothing",
)


@keeps_memory
def test_freed_memory_goes_to_the_next_buffer_of_its_size() -> None:
    pool = HostBufferPool(1 << 20)
    a = pool.empty(N, torch.float32, torch.device("cpu"))
    ptr = a.data_ptr()
    stale = a[3:7]
    pool.drain(a.untyped_storage())
    # Freed exactly as resize_(0) frees: the old storage (and every view of it) has no memory.
    assert a.untyped_storage().nbytes() == 0 and stale.untyped_storage().nbytes() == 0
    assert pool.retained == MIN_BYTES
    b = pool.empty(N, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == ptr and pool.hits == 1 and pool.retained == 0
    assert b.untyped_storage()._cdata != a.untyped_storage()._cdata
    # A different size is not served from it.
    pool.drain(b.untyped_storage())
    c = pool.empty(N + 1, torch.float32, torch.device("cpu"))
    assert c.data_ptr() != ptr and pool.misses == 2


def test_regrow_keeps_the_storage_so_saved_views_see_new_contents() -> None:
    rt = CPURuntime()
    buf = torch.zeros(N)
    view = buf[10:20]  # what autograd saves of a parameter that is a view of the buffer
    rt.free_after(buf, [])
    assert buf.untyped_storage().nbytes() == 0
    rt.regrow(buf)
    assert buf.untyped_storage().nbytes() == N * 4
    buf.copy_(torch.arange(N, dtype=torch.float32))
    assert torch.equal(view, torch.arange(10, 20, dtype=torch.float32))


def test_sizes_outside_the_range_and_other_devices_are_not_kept() -> None:
    pool = HostBufferPool(64 << 20)
    for nbytes in (MIN_BYTES - 4, MAX_BYTES):
        t = pool.empty(nbytes // 4, torch.float32, torch.device("cpu"))
        pool.drain(t.untyped_storage())
        assert t.untyped_storage().nbytes() == 0
    assert pool.retained == 0 and pool.hits == 0
    meta = pool.empty(N, torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and pool.retained == 0


@keeps_memory
def test_size_bounds_what_is_kept_and_zero_turns_it_off() -> None:
    sizes = [64 << 10, 96 << 10, 128 << 10, 192 << 10]  # four size classes
    pool = HostBufferPool((128 << 10) + (192 << 10))
    bufs = [pool.empty(n // 4, torch.float32, torch.device("cpu")) for n in sizes]
    ptrs = [b.data_ptr() for b in bufs]
    for b in bufs:
        pool.drain(b.untyped_storage())
    assert pool.retained == (128 << 10) + (192 << 10)
    # The least recently freed went first: the last two are the ones kept.
    got = {pool.empty(n // 4, torch.float32, torch.device("cpu")).data_ptr() for n in sizes[2:]}
    assert got == set(ptrs[2:])
    pool.drain(pool.empty(N, torch.float32, torch.device("cpu")).untyped_storage())
    pool.set_max_bytes(0)
    assert pool.retained == 0
    t = pool.empty(N, torch.float32, torch.device("cpu"))
    pool.drain(t.untyped_storage())
    assert pool.retained == 0 and t.untyped_storage().nbytes() == 0


@keeps_memory
def test_one_buffer_of_a_size_is_kept() -> None:
    """The engine uses a size's buffers one or two at a time: more of one size would only be
    resident memory nobody asks for (the backward frees the forward's kept buffers together)."""
    pool = HostBufferPool(64 << 20)
    bufs = [pool.empty(N, torch.float32, torch.device("cpu")) for _ in range(3)]
    first = bufs[0].data_ptr()
    for b in bufs:
        pool.drain(b.untyped_storage())
    assert PER_SIZE == 1 and pool.retained == N * 4
    assert all(b.untyped_storage().nbytes() == 0 for b in bufs)
    assert pool.empty(N, torch.float32, torch.device("cpu")).data_ptr() == first


@keeps_memory
def test_neighbouring_sizes_share_a_class() -> None:
    """Temporary buffers of neighbouring sizes (the rows of buckets of 4 and 5 blocks) reuse
    one another's memory; each sees only its own elements."""
    pool = HostBufferPool(64 << 20)
    a = pool.empty(395_776, torch.float32, torch.device("cpu"))  # 1.51 MiB
    ptr = a.data_ptr()
    assert a.untyped_storage().nbytes() == 2 << 20
    pool.drain(a.untyped_storage())
    b = pool.empty(494_720, torch.float32, torch.device("cpu"))  # 1.89 MiB
    assert b.data_ptr() == ptr and b.numel() == 494_720 and pool.hits == 1


@given(st.integers(1, 1 << 40))
def test_size_classes_round_up_by_at_most_a_half(n: int) -> None:
    c = size_class(n)
    assert n <= c and 2 * c <= 3 * n and size_class(c) == c
    assert size_class(n + 1) >= c  # monotonic


def test_without_storage_moves_nothing_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch without ``_swap_data_ptr_`` the pool is plain allocation and ``resize_(0)``."""
    monkeypatch.setattr("functional_fsdp.shell.device.pool.CAN_MOVE", False)
    pool = HostBufferPool(1 << 20)
    t = pool.empty(N, torch.float32, torch.device("cpu"))
    pool.drain(t.untyped_storage())
    assert t.untyped_storage().nbytes() == 0 and pool.retained == 0
    pool.fill(t.untyped_storage(), MIN_BYTES)
    assert t.untyped_storage().nbytes() == MIN_BYTES and pool.hits == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "16M", True])
def test_a_bad_size_is_a_named_error(bad: object) -> None:
    pool = HostBufferPool()
    with pytest.raises(ValueError, match="host buffer pool size"):
        pool.set_max_bytes(bad)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 7)), max_size=40),
    cap=st.integers(0, 6),
)
def test_live_buffers_never_share_memory_and_keep_their_contents(
    ops: list[tuple[bool, int, int]], cap: int
) -> None:
    """Any sequence of allocations and frees (4 sizes, up to 6 buffers kept): every live buffer
    still holds what was written into it, no two overlap, and the pool stays within its size."""
    pool = HostBufferPool(cap * MIN_BYTES)
    live: list[tuple[torch.Tensor, float]] = []
    for n, (alloc, size, pick) in enumerate(ops):
        if alloc or not live:
            t = pool.empty(N * (size + 1), torch.float32, torch.device("cpu"))
            t.fill_(float(n))
            live.append((t, float(n)))
        else:
            t, _ = live.pop(pick % len(live))
            pool.drain(t.untyped_storage())
            assert t.untyped_storage().nbytes() == 0
        assert pool.retained <= pool.max_bytes
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t, _ in live)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert all(bool((t == v).all()) for t, v in live)
