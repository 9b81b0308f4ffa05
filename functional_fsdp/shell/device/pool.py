"""Host memory the engine keeps between uses: its small, short-lived CPU buffers.

Every step, each group's unsharded buffer is freed at reshard and allocated again at the next
unshard, and every all-gather output and reduce-scatter input is made fresh. With glibc's
defaults freed memory mostly stays in the heap and is reused; where large blocks go back to the
kernel (``mallopt(M_MMAP_THRESHOLD)`` low, or blocks past the threshold), every fresh 4 KiB page
costs a page fault and zeroing on first touch: about 1.6 us a page on this machine, 40% of a
deep model's overhead. Buffers of 4 MiB and more get transparent huge pages instead
(:mod:`~functional_fsdp.shell.engine.memory`); this pool serves the smaller ones.

:class:`HostBufferPool` keeps freed memory, by size, one buffer of a size at most, up to
``max_bytes``, and hands it to the next buffer of that size (its temporary buffers are
allocated by size class, :func:`size_class`, so neighbouring sizes share one). Memory moves
between storages with ``UntypedStorage._swap_data_ptr_``: a freed storage is left with no
memory, exactly as ``resize_(0)`` leaves it, so a stale view of a freed buffer can never see a
later owner's bytes; and a buffer that autograd saved views of is given memory in place (the
same storage, as ``resize_`` does). Retained memory counts in the process's resident size: ``max_bytes``
is the trade (``set_host_buffer_pool_bytes``; 0 turns the pool off).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch

from ..._compat import HAS_SWAP_DATA_PTR

__all__ = [
    "HostBufferPool",
    "host_buffer_pool",
    "set_host_buffer_pool_bytes",
    "size_class",
    "spanned_bytes",
]

#: Buffers below this are left to malloc (it keeps small blocks in its heap).
MIN_BYTES = 64 << 10
#: Buffers from this size on are advised huge pages instead (``engine/memory.py``).
MAX_BYTES = 4 << 20
#: Default retained bytes (``FFSDP_HOST_POOL_BYTES`` overrides): two default buckets (a
#: bucket's freed buffers wait here for the next bucket's). On the deep benchmark model 8 MiB
#: saves as many page faults as 16 (35-38 thousand a step against 59-60 thousand with none).
DEFAULT_BYTES = 8 << 20
#: Buffers kept per size at most: the engine's buffers of one size are used one or two at a
#: time (a member's buffer is freed before the next member's is made); more would only sit
#: in resident memory (the backward frees the buffers the forward kept for it all at once).
PER_SIZE = 1
#: Whether this torch can move memory between storages (a private method, absent from torch
#: 2.11); without it the pool keeps nothing and every buffer is new, as before.
CAN_MOVE = HAS_SWAP_DATA_PTR


class HostBufferPool:
    """Freed CPU buffer memory kept by byte size (:data:`PER_SIZE` of a size), up to
    ``max_bytes`` (least recently freed dropped first). Thread-safe (backward hooks may run on
    autograd's threads)."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        self._free: OrderedDict[int, list[torch.UntypedStorage]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_bytes = 0
        self.retained = 0
        self.hits = 0
        self.misses = 0
        self.set_max_bytes(max_bytes)

    def set_max_bytes(self, n: int) -> None:
        """Retain at most ``n`` bytes (0: none; what is retained beyond is freed now)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"the host buffer pool size must be an int >= 0 bytes, got {n!r}")
        with self._lock:
            self.max_bytes = n
            dropped = self._evict()
        _release(dropped)

    def _poolable(self, nbytes: int, device: torch.device) -> bool:
        return (
            MIN_BYTES <= nbytes < MAX_BYTES
            and self.max_bytes > 0
            and device.type == "cpu"
            and CAN_MOVE
        )

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory (kept memory of that size if any)."""
        held = None
        if self._poolable(nbytes, storage.device):
            with self._lock:
                kept = self._free.get(nbytes)
                if kept:
                    held = kept.pop()
                    self.retained -= nbytes
                    if not kept:
                        del self._free[nbytes]
        if held is None:
            self.misses += 1
            storage.resize_(nbytes)
            return
        self.hits += 1
        if storage.nbytes() != 0:
            storage.resize_(0)
        _move(held, storage)

    def drain(self, storage: torch.UntypedStorage) -> None:
        """Free ``storage``'s memory (it is left with none, as ``resize_(0)`` leaves it),
        keeping the memory for a later buffer of the same size when there is room."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if nbytes > self.max_bytes or not self._poolable(nbytes, storage.device):
            storage.resize_(0)
            return
        held = torch.UntypedStorage(0, device=storage.device)
        with self._lock:
            kept = self._free.setdefault(nbytes, [])
            if len(kept) >= PER_SIZE:
                storage.resize_(0)
                return
            _move(storage, held)
            kept.append(held)
            self._free.move_to_end(nbytes)
            self.retained += nbytes
            dropped = self._evict()
        _release(dropped)

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new 1-D buffer of ``numel`` ``dtype`` elements (``torch.empty``'s contents).

        Its storage is of the size class of its bytes (:func:`size_class`), so the temporary
        buffers of neighbouring sizes (the rows of buckets of 4 and 5 groups) reuse one
        another's memory; pages past the end it uses are never touched, so never resident."""
        nbytes = numel * dtype.itemsize
        if nbytes >= MIN_BYTES and size_class(nbytes) < MAX_BYTES:
            nbytes = size_class(nbytes)
        if not self._poolable(nbytes, device):
            return torch.empty(numel, dtype=dtype, device=device)
        t = torch.empty(0, dtype=dtype, device=device)
        storage = t.untyped_storage()
        self.fill(storage, nbytes)
        return t.set_(storage, 0, (numel,), (1,))

    def clear(self) -> None:
        """Free everything retained."""
        with self._lock:
            dropped = [s for kept in self._free.values() for s in kept]
            self._free.clear()
            self.retained = 0
        _release(dropped)

    def _evict(self) -> list[torch.UntypedStorage]:
        dropped = []
        while self.retained > self.max_bytes and self._free:
            nbytes, kept = next(iter(self._free.items()))
            dropped.append(kept.pop(0))
            self.retained -= nbytes
            if not kept:
                del self._free[nbytes]
        return dropped


def size_class(nbytes: int) -> int:
    """The size :meth:`HostBufferPool.empty` allocates for ``nbytes``: the next of ``2**k``
    and ``3 * 2**(k - 2)`` (at most half as much again as asked for)."""
    if nbytes <= 1:
        return nbytes
    p = 1 << (nbytes - 1).bit_length()
    return p * 3 // 4 if nbytes <= p * 3 // 4 else p


def spanned_bytes(tensor: torch.Tensor) -> int:
    """The bytes of its storage ``tensor`` reaches (from the storage's start): what a freed
    buffer's storage is given again."""
    return (int(tensor.storage_offset()) + tensor.numel()) * tensor.element_size()


def _move(src: torch.UntypedStorage, dst: torch.UntypedStorage) -> None:
    """Move ``src``'s memory to the empty ``dst``, leaving ``src`` with none."""
    dst._swap_data_ptr_(src)  # type: ignore[attr-defined]


def _release(storages: list[torch.UntypedStorage]) -> None:
    for s in storages:
        s.resize_(0)


def _default_bytes() -> int:
    raw = os.environ.get("FFSDP_HOST_POOL_BYTES")
    if raw is None or raw == "":
        return DEFAULT_BYTES
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"FFSDP_HOST_POOL_BYTES must be a number of bytes, got {raw!r}") from None


_POOL: HostBufferPool | None = None
_POOL_LOCK = threading.Lock()


def host_buffer_pool() -> HostBufferPool:
    """The process's pool (made on first use; ``FFSDP_HOST_POOL_BYTES`` sets its size)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = HostBufferPool(_default_bytes())
        return _POOL


def set_host_buffer_pool_bytes(n: int) -> None:
    """Keep at most ``n`` bytes of freed CPU buffer memory for reuse (default 8 MiB; 0 turns
    the pool off and frees what it holds).

    FSDP frees each group's unsharded parameters after use and allocates them again for the
    next use; this pool hands the freed memory to the next buffer of the same size (buffers
    from 64 KiB to 4 MiB on CPU) instead of returning it to the kernel. It trades up to ``n``
    bytes of resident memory for page faults (about 15% of a step on a 33-group model whose
    allocator returns freed blocks to the kernel).

    Raises:
        ValueError: ``n`` is not an int >= 0.
    """
    host_buffer_pool().set_max_bytes(n)
