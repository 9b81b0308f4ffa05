"""The huge-page advisor is advice only: values, sizes and small tensors are untouched.

Where the advice is taken it is visible: the kernel splits the advised range into its own
mapping flagged ``hg`` in ``/proc/self/smaps``. The tests read that back, so they fail when
the advice is missing, covers the wrong range, or rounds a buffer up (not only on a crash).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

from functional_fsdp.shell.engine.memory import huge_page_advisor

_HUGE = 1 << 21
_PAGE = mmap.PAGESIZE
# MADV_HUGEPAGE is accepted (and shows as ``hg``) exactly where the kernel has transparent huge
# pages; elsewhere the advisor must do nothing at all.
_THP = sys.platform.startswith("linux") and os.path.exists("/sys/kernel/mm/transparent_hugepage")


def _advised(lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of ``[lo, hi)`` in mappings flagged ``hg`` (advised MADV_HUGEPAGE)."""
    if not os.path.exists("/proc/self/smaps"):
        return []
    out: list[tuple[int, int]] = []
    span: tuple[int, int] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if head == "VmFlags:":
                if span is not None and "hg" in line.split()[1:]:
                    a, b = max(span[0], lo), min(span[1], hi)
                    if a < b:
                        out.append((a, b))
            elif "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                span = (a, b)
    return out


def _mapped(nbytes: int, offset: int = 3 * _PAGE) -> tuple[mmap.mmap, torch.Tensor]:
    """A byte tensor on its own fresh mapping (a shared mapping never merges with a neighbour),
    starting at least ``offset`` bytes in, at a page where neither end of the storage is
    2 MiB-aligned (where the kernel places the mapping is not ours to choose)."""
    m = mmap.mmap(-1, nbytes + offset + 8 * _PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    while (base + offset) % _HUGE == 0 or (base + offset + nbytes) % _HUGE == 0:
        offset += _PAGE
    return m, torch.frombuffer(m, dtype=torch.uint8, offset=offset, count=nbytes)


def _span(t: torch.Tensor) -> tuple[int, int]:
    ptr = t.untyped_storage().data_ptr()
    return ptr, ptr + t.untyped_storage().nbytes()


def test_advice_covers_exactly_the_aligned_interior() -> None:
    m, t = _mapped(12 * (1 << 20) + 5 * _PAGE)
    lo, hi = _span(t)
    assert _advised(lo, hi) == []
    huge_page_advisor()(t)
    start, end = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
    assert start > lo and end < hi  # both ends unaligned: rounding up would show
    # The 2 MiB-aligned interior, and nothing of the mapping outside it.
    assert _advised(lo - 3 * _PAGE, hi) == ([(start, end)] if _THP else [])
    del t
    m.close()


def test_small_and_empty_tensors_are_skipped() -> None:
    advise = huge_page_advisor()
    # 3 MiB holds a 2 MiB-aligned page, but is below the 4 MiB threshold.
    m, t = _mapped(3 * (1 << 20))
    advise(t)
    assert _advised(*_span(t)) == []
    small = torch.ones(10)
    advise(small)
    advise(torch.empty(0))
    assert torch.equal(small, torch.ones(10))
    del t
    m.close()


def test_advice_keeps_values_and_sizes() -> None:
    advise = huge_page_advisor()
    big = torch.empty(3 * (1 << 20), dtype=torch.float32)  # 12 MiB: has 2 MiB-aligned pages
    advise(big)
    big.copy_(torch.arange(big.numel(), dtype=torch.float32))
    assert torch.equal(big[:5], torch.arange(5, dtype=torch.float32))
    assert big.untyped_storage().nbytes() == 12 * (1 << 20)
    lo, hi = _span(big)
    if _THP:
        aligned = ((lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1))
        assert sum(b - a for a, b in _advised(*aligned)) == aligned[1] - aligned[0]


def test_resized_storage_can_be_advised_again() -> None:
    advise = huge_page_advisor()
    buf = torch.empty(2 * (1 << 20))
    advise(buf)
    buf.untyped_storage().resize_(0)
    buf.untyped_storage().resize_(8 * (1 << 20))
    advise(buf)
    buf.fill_(2.0)
    assert buf.sum().item() == 2.0 * buf.numel()
    lo, hi = _span(buf)  # the new allocation's interior is advised
    if _THP:
        aligned = ((lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1))
        assert sum(b - a for a, b in _advised(*aligned)) == aligned[1] - aligned[0]


def test_building_groups_starts_no_subprocess(monkeypatch) -> None:
    """Each group makes an advisor; finding libc once per group ran ``ldconfig`` in a forked
    subprocess (``ctypes.util.find_library``): a fork of the whole process per ``fully_shard``.
    The lookup is made once, by libc's soname."""
    import subprocess

    from functional_fsdp.shell.engine import memory

    def refuse(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args[:1]}")

    memory._madvise.cache_clear()
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    advisors = [huge_page_advisor() for _ in range(3)]
    if sys.platform.startswith("linux"):
        assert memory._madvise() is not None
        t = torch.empty(3 * _HUGE, dtype=torch.uint8)
        for advise in advisors:
            advise(t)  # advice only: no error, no subprocess
