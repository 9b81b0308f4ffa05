"""Run a function on N local CPU ranks (gloo on 127.0.0.1), as the examples' default launcher."""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .processes import Parent, from_bytes, rank_context, to_bytes

__all__ = ["launcher_store", "run_local"]

_STORE: Any = None  # this rank's client of the launcher's store (survivable runs)
# The first world's store prefix: rebuild_on_survivors' world of epoch k uses "ffsdp-epoch<k>/".
_EPOCH0 = "ffsdp-epoch0/"


def launcher_store() -> Any:
    """The store the launcher hosts (in the parent process, so it outlives every rank), as
    :func:`~functional_fsdp.rebuild_on_survivors` needs; only in a rank of
    ``run_local(..., survivable=True)``. The default process group uses it under the prefix
    ``ffsdp-epoch0/``; the world of recovery epoch ``k`` uses ``ffsdp-epoch<k>/``."""
    if _STORE is None:
        raise RuntimeError(
            "launcher_store(): this process is not a rank of run_local(..., survivable=True)"
        )
    return _STORE


def run_local(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout_s: float = 3600.0,
    survivable: bool = False,
) -> list[Any]:
    """Start ``world_size`` processes, initialise gloo in each, return ``fn(*args)`` by rank.

    The ranks fork from a server that imported torch once (:mod:`.processes`; spawned where
    the platform has no fork server), with this process's environment, standard output and
    error at the call.

    ``fn`` must be picklable (a module-level function). Each rank's process group uses
    127.0.0.1 and a free port. Unless ``OMP_NUM_THREADS`` is set, each rank gets an equal
    share of the CPU cores for torch's intra-op threads (at least one): with torch's default
    (every core per rank) the ranks' thread pools oversubscribe the cores and steps stall
    (measured on 2 cores, 2 ranks, a small GPT: 40-600 ms per step instead of 40-60 ms). If any
    rank fails (or dies without a result), or the whole run exceeds ``timeout_s``, every rank is
    terminated and :class:`RuntimeError` carries the failing ranks' tracebacks. A port taken by
    another process before rank 0 listens on it is retried with a new one (up to 3 times).

    With ``survivable=True`` the launcher hosts the ranks' store itself
    (:func:`launcher_store`), so ranks may die and the others go on
    (:func:`~functional_fsdp.rebuild_on_survivors`): a rank killed by a signal without a
    result gets ``None`` in the returned list instead of failing the run (at least one rank
    must return).

    A result may be any object ``torch.save`` can pickle, of any size: each rank serialises
    its result to bytes itself, so the queue carries one bytes object per rank. (Tensors put on
    a multiprocessing queue as they are travel as shared-memory file descriptors, and a result
    of a hundred or more tensors ran out of them: ``ConnectionResetError`` or
    ``FileNotFoundError`` in the launcher.) A result that cannot be serialised fails its rank
    with the pickling error's traceback.

    Example:
        >>> def hello():  # doctest: +SKIP
        ...     return torch.distributed.get_rank()
        >>> run_local(hello, 2)  # doctest: +SKIP
        [0, 1]
    """
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _launch(fn, world_size, args, timeout_s, survivable)
        except _PortTaken:
            # The free port was taken between choosing it and rank 0 binding it (another
            # process on the machine): choose another.
            if attempt == _PORT_ATTEMPTS - 1:
                raise RuntimeError(
                    f"run_local: {_PORT_ATTEMPTS} free ports in a row were taken before rank 0 "
                    "could listen on them; is something on this machine binding many ports?"
                ) from None
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3


class _PortTaken(Exception):
    """Rank 0 could not listen on the chosen port (EADDRINUSE)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(
    fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float, survivable: bool
) -> list[Any]:
    port = _free_port()
    host = None
    if survivable:
        try:
            host = dist.TCPStore(
                "127.0.0.1",
                port,
                None,
                True,
                timeout=datetime.timedelta(seconds=300),
                wait_for_workers=False,
            )
        except RuntimeError as e:
            if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
                raise _PortTaken() from None
            raise
    ctx = rank_context()
    results: Any = ctx.Queue()
    parent = Parent(ctx)  # first among the arguments: it applies itself when unpickled
    procs = [
        ctx.Process(
            target=_rank_main, args=(parent, fn, r, world_size, port, args, results, survivable)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    failed: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        lost: set[int] = set()
        while len(done) + len(failed) + len(lost) < world_size and not failed:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died without reporting (killed, or a crash in C++) fails the run
                # now, not after the timeout; in a survivable run a killed one is lost.
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in done:
                        if survivable and p.exitcode < 0:
                            lost.add(r)
                        else:
                            failed[r] = f"exited with code {p.exitcode} without a result"
                if time.monotonic() > deadline:
                    failed[-1] = f"timed out after {timeout_s} s"
                continue
            if ok:
                done[rank] = from_bytes(value)
            else:
                failed[rank] = value
    finally:
        for p in procs:
            p.join(timeout=0 if failed else 60)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    if failed:
        if any("EADDRINUSE" in tb for tb in failed.values()):
            raise _PortTaken()
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        raise RuntimeError(f"run_local({getattr(fn, '__name__', fn)}) failed:\n{text}")
    if not done:
        raise RuntimeError(f"run_local({getattr(fn, '__name__', fn)}): every rank was lost")
    del host  # the store outlived every rank
    return [done.get(r) for r in range(world_size)]


def _rank_main(
    parent: Parent,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    out: Any,
    survivable: bool = False,
) -> None:
    global _STORE
    del parent  # applied when it was unpickled, before fn's module was imported
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    # Set here, not read by OpenMP at load: the server loaded it with its own environment.
    threads = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    torch.set_num_threads(
        int(threads)
        if threads.isdigit() and int(threads) > 0
        else max(1, (os.cpu_count() or 1) // world_size)
    )
    timeout = datetime.timedelta(seconds=300)
    try:
        if survivable:
            _STORE = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(_EPOCH0, _STORE),
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    except BaseException:  # e.g. the port was taken: tell the parent, do not hang the others
        out.put((rank, False, traceback.format_exc()))
        return
    try:
        payload = to_bytes(fn(*args))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    else:
        out.put((rank, True, payload))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
