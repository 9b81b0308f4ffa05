"""Advice to the kernel about the shell's large, short-lived CPU buffers.

Resharding frees a group's unsharded buffer and unsharding allocates it again, every step. On
Linux each fresh 4 KiB page then costs a page fault on first touch (25 MiB: about 11 ms on this
machine). Where transparent huge pages are available in ``madvise`` mode, advising the buffer
``MADV_HUGEPAGE`` before it is filled takes that to about 4 ms. Elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["huge_page_advisor"]

_MADV_HUGEPAGE = 14
_HUGE = 1 << 21


def huge_page_advisor() -> Callable[[torch.Tensor], None]:
    """A function that advises a CPU tensor's memory ``MADV_HUGEPAGE`` (a no-op off Linux).

    Only the 2 MiB-aligned part of tensors of at least 4 MiB is advised, so nothing is rounded
    up: resident memory still follows the buffer's size.

    One advisor serves the process: looking libc up (``ctypes.util.find_library`` runs
    ``ldconfig`` in a subprocess, forking this process) once per group cost every
    ``fully_shard`` a fork.
    """
    madvise = _madvise()
    if madvise is None:
        return _noop

    def advise(t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            return
        nbytes = t.untyped_storage().nbytes()
        if nbytes < 2 * _HUGE:
            return
        ptr = t.untyped_storage().data_ptr()
        start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
        end = (ptr + nbytes) & ~(_HUGE - 1)
        if end > start:
            madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: errors are ignored

    return advise


@functools.cache
def _madvise() -> Any:
    """libc's ``madvise`` (argument types set), or None off Linux or where it is not found.
    Cached: the lookup may start a subprocess."""
    if not sys.platform.startswith("linux"):
        return None
    for name in ("libc.so.6", None):  # glibc's soname first: no ldconfig subprocess
        try:
            libc = ctypes.CDLL(name or ctypes.util.find_library("c"), use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError, TypeError):
            continue
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        return madvise
    return None


def _noop(t: torch.Tensor) -> None:
    del t
