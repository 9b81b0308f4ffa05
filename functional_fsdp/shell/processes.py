"""How local ranks start: forked from a server that imported torch once.

A spawned rank imports torch again (about 2.5 s of CPU on the 2-core machine, per rank, per
launch): a 4-rank world took 5.3 s to start, most of it importing. A fork server that imported
torch and this package once starts each rank in about 0.05 s (a 4-rank world in 0.15 s, after
the server's first 2 s). The server imports only modules; it runs no torch operation and starts
no thread, so a rank forked from it initialises gloo, OpenMP and CUDA itself, as a spawned one.

A forked rank gets the parent's working directory, ``sys.path`` and main module from
``multiprocessing`` (as a spawned one), but the environment and the standard output and error of
the server, as they were when it started: :class:`Parent` carries the parent's, at the rank's
start, and :meth:`Parent.adopt` makes them the rank's (so a rank prints where a spawned one
would: to a terminal, a log file, or the capture of the test that started it). Where the
platform has no fork server (Windows) ranks are spawned.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

__all__ = ["Parent", "rank_context"]

PRELOAD = ("__main__", "torch", "torch.distributed", "functional_fsdp")


def rank_context(extra_preload: tuple[str, ...] = ()) -> Any:
    """The ``multiprocessing`` context to start local ranks from: ``forkserver`` with torch
    and this package preloaded (plus ``extra_preload``, modules the ranks import anyway) where
    available, else ``spawn``. The preload list is set while the server is not yet running
    (the first rank's start runs it; later lists add nothing)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    if not server._forkserver_pid:  # not started yet: add ours to what the list holds
        have = list(server._preload_modules)
        ctx.set_forkserver_preload(have + [m for m in (*PRELOAD, *extra_preload) if m not in have])
    return ctx


class Parent:
    """What a rank inherits from the process that starts it, taken when it is sent with the
    rank's start: the environment, and standard output and error (descriptors 1 and 2, sent
    with the start as copies; one that is closed is left as the server's)."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self._fds: tuple[Any, ...] = ()

    def __reduce__(self) -> Any:
        from multiprocessing import reduction

        fds = tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2))
        return (_received, (self.env, fds))

    def adopt(self) -> None:
        """Make this rank's environment and standard output and error the parent's."""
        if os.environ != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        for target, dup in zip((1, 2), self._fds):
            if dup is not None:
                fd = dup.detach()
                os.dup2(fd, target)
                os.close(fd)


def _received(env: dict[str, str], fds: tuple[Any, ...]) -> Parent:
    parent = Parent.__new__(Parent)
    parent.env, parent._fds = env, fds
    return parent


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
