"""A real multi-process gloo world for tests: started once per session, many cases inside.

Its ranks fork from the package's fork server (``functional_fsdp.shell.processes``, here also
preloading what the cases import): a world starts in about 0.15 s, not the 5 s of 4 spawned
ranks importing torch on 2 cores, so a test that needs fresh processes (a rank killed on
purpose) starts its own with :func:`rank_context` and :func:`process`.

``World(n).run(fn, *args)`` runs the module-level function ``fn(*args)`` on every rank (with the
default process group initialised on 127.0.0.1 at a free port) and returns the per-rank results.
A case that fails on any rank tears the world down (so no rank can hang in a collective) and the
next case starts a fresh one. Every wait is bounded.

The worlds live for the whole session (``world2``/``world4`` in ``conftest.py``), so a case must
leave them as it found them:

- Every case starts alike, whatever ran before it in the same processes: the torch seed is 0,
  and the environment, default dtype and grad mode it changed are restored afterwards.
- A case that returns with collectives still in flight fails, naming them, and the world is
  replaced: a wait it abandoned (a thread blocked in ``Work.wait()``) or a collective posted on
  the default group by some ranks only. Left there, gloo's own timeout would close the
  connection a minute later, in the middle of an unrelated case ("Connection reset by peer").
  A case that breaks a step on purpose ends it as a user would, with ``reset_iter_state()``.
- A case that needs a mesh of two or more dims takes it from :func:`shared_mesh`, so the
  process groups it brings are made once per process, not once per case.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

# A case and its answer cross as bytes, as run_local sends a rank's result: no file descriptors.
from functional_fsdp.shell.processes import from_bytes, to_bytes

CASE_TIMEOUT_S = float(os.environ.get("FFSDP_TEST_CASE_TIMEOUT", "180"))
CHECK_GRACE_S = 5.0  # for the works of a finished case to complete
PROBE_TIMEOUT_S = 30.0


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now on 127.0.0.1 (held together while chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_MESHES: dict[tuple[Any, ...], Any] = {}


def shared_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
    """A CPU ``DeviceMesh`` of ``shape`` (and dim ``names``), made once per rank process and
    shared by the cases that run there later.

    Each ``init_device_mesh`` of two or more dims makes new gloo process groups, and they live,
    with their threads and sockets, until the process ends: after 40 cases of 2x2 meshes a rank
    of a session's world had over 1000 threads and a case ran 10x slower. Destroying them when a
    case ends is not an option: torch's ``DTensor`` caches key on a mesh's shape and names, so a
    later case's equal mesh can be answered with the earlier one (and its destroyed groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(shape), names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return _MESHES[key]


def _case(fn: Callable[..., Any], args: tuple) -> Any:
    """``fn(*args)`` from the same starting state as in a fresh process; the state it changed
    is put back."""
    import torch

    env = dict(os.environ)
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    torch.manual_seed(0)
    try:
        return _returnable(fn(*args))
    finally:
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        if os.environ != env:
            os.environ.clear()
            os.environ.update(env)


def _returnable(result: Any) -> Any:
    """``result``, after checking it can cross to the test's process: a tensor that is not
    a leaf of autograd's graph cannot be pickled whole (torch refuses a subclass of one), so
    the case says so by name instead of failing in the pickler."""
    import torch
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(result):
        if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
            raise TypeError(
                "the case returned a tensor that autograd recorded (it has a grad_fn); return "
                "t.detach() (a result cannot cross to the test's process with its graph)"
            )
    return result


def _blocked_waits(grace_s: float) -> list[str]:
    """Threads of this process still blocked in ``Work.wait()`` on an incomplete work (after
    ``grace_s`` for them to finish): a wait a case abandoned. gloo's own timeout ends it later
    by closing the connection, which breaks whatever case runs then."""
    import sys
    import threading

    import torch.distributed as dist

    def blocked() -> dict[int, str]:
        frames = sys._current_frames()
        out = {}
        for t in threading.enumerate():
            frame = frames.get(t.ident) if t is not threading.main_thread() else None
            if frame is None:
                continue
            for v in list(frame.f_locals.values()):
                if isinstance(v, dist.Work) and not v.is_completed():
                    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
                    out[t.ident] = f"thread {t.name!r} waits in {frame.f_code.co_name} ({where})"
        return out

    deadline = time.monotonic() + grace_s
    found = blocked()
    while found and time.monotonic() < deadline:
        time.sleep(0.05)
        found = blocked()
    return sorted(found.values())


def _probe(timeout_s: float) -> list[str]:
    """One all-reduce on the default group, bounded: it completes with the right sum only when
    no rank has a collective of an earlier case still posted there."""
    import torch
    import torch.distributed as dist

    try:
        t = torch.ones(1)
        work = dist.all_reduce(t, async_op=True)
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                return [
                    f"a probe all-reduce on the default group did not complete in {timeout_s} s"
                ]
            time.sleep(0.001)
        work.wait()
    except Exception as e:  # a connection closed by a peer's timed-out collective
        return [f"a probe all-reduce on the default group failed: {e}"]
    if t.item() != dist.get_world_size():
        return [
            f"a probe all-reduce on the default group paired with another collective ({t.item()})"
        ]
    return []


def _leftovers() -> list[str]:
    """What the last case left in flight on this rank (nothing in a clean world)."""
    return _blocked_waits(CHECK_GRACE_S) + _probe(PROBE_TIMEOUT_S)


def rank_context() -> Any:
    """The ``multiprocessing`` context the tests' ranks start from: the package's fork server
    (:func:`functional_fsdp.shell.processes.rank_context`), here also preloading the modules
    the cases import in their ranks. It starts once per session; a world then starts in about
    0.15 s instead of 5 s (4 spawned ranks each importing torch on 2 cores)."""
    from functional_fsdp.shell.processes import rank_context as package_context

    return package_context(PRELOAD)


def process(ctx: Any, target: Callable[..., Any], *args: Any) -> Any:
    """``ctx.Process(target=target, args=args)`` that first takes this process's environment
    and standard output and error as they are now (a rank forked from the server has the
    server's, from when it started)."""
    from functional_fsdp.shell.processes import Parent

    return ctx.Process(target=_adopting, args=(Parent(ctx), target, *args))


def _adopting(parent: Any, target: Callable[..., Any], *args: Any) -> None:
    del parent  # applied when it was unpickled
    target(*args)


# What the cases' ranks import (each once in the server instead of in every rank it starts).
# pytest and hypothesis: every test module imports one or both at its top, and a rank imports
# the module of each case it runs; unloaded, pytest's import alone was about 1.4 % of the
# suite's samples (py-spy over the whole run), hypothesis's 0.4 %.
PRELOAD = (
    "pytest",
    "hypothesis",
    "_dist",
    "torch.distributed.checkpoint",
    "functional_fsdp.functional",
    "torch._dynamo",
    "_warm_compile",
)


def lean_gc() -> None:
    """Collect reference cycles less often in a test process: the session's ranks and workers
    live long and allocate many short-lived objects (tracing, DTensor specs); at Python's
    default thresholds the cyclic collector was 8 % of a rank's CPU in the compiled-step cases
    (2.7 of 33 s), at these 3 % (1.0 of 33 s). Memory is still freed by reference counting."""
    import gc

    gc.set_threshold(50_000, 20, 20)


def _worker(rank: int, world_size: int, port: int, inbox: Any, outbox: Any) -> None:
    import datetime
    import faulthandler

    # A rank killed by a signal (SIGABRT from glibc's heap checks, SIGSEGV) prints the Python
    # stack of the thread that crashed to its stderr, which pytest shows with the failing case.
    # Only that thread's: a CI rank's dump of every thread stopped, cut off, at the first
    # other thread's frames (a thread state it could not read) and named no crash site.
    faulthandler.enable(all_threads=False)

    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    lean_gc()
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    parent = os.getppid()
    try:
        while True:
            try:
                item = inbox.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the session died without closing the world
                    os._exit(0)
                continue
            except Exception:  # a case this process cannot unpickle: that case fails
                outbox.put((rank, False, traceback.format_exc()))
                continue
            if item is None:
                break
            if item == "check":
                outbox.put((rank, True, _leftovers()))
                continue
            try:
                fn, args = from_bytes(item)
                outbox.put((rank, True, to_bytes(_case(fn, args))))
            except BaseException:
                outbox.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankError(AssertionError):
    """A case failed on one or more ranks; the message holds their tracebacks."""


class World:
    """A lazily (re)started world of ``world_size`` gloo ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None

    def _start(self) -> None:
        ctx = rank_context()
        port = free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            process(ctx, _worker, r, self.world_size, port, self._inboxes[r], self._outbox)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.daemon = True
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = CASE_TIMEOUT_S) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return results by rank, or raise :class:`RankError`.

        The world is torn down (the next case starts a fresh one) when the case fails or times
        out on any rank, when a rank dies, when the case leaves collectives in flight, and when
        the caller is interrupted mid-case (e.g. by pytest-timeout)."""
        if not self._procs:
            self._start()
        try:
            case = to_bytes((fn, args))
            for q in self._inboxes:
                q.put(case)
            answers = self._collect(timeout, what=fn.__name__)
            failures = {r: tb for r, (ok, tb) in answers.items() if not ok}
            if failures:
                text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
                raise RankError(f"{fn.__name__} failed:\n{text}{self._deaths()}")
            for q in self._inboxes:
                q.put("check")
            left = sorted(
                (r, what)
                for r, (_, found) in self._collect(timeout, "the check").items()
                for what in found
            )
            if left:
                text = "\n".join(f"rank {r}: {what}" for r, what in left)
                raise RankError(
                    f"{fn.__name__} returned on every rank but left collectives in flight. The "
                    "world is shared by the whole session: gloo's timeout would close the "
                    "connection later, under another case. End a step the case breaks on "
                    f"purpose (reset_iter_state() on every rank):\n{text}"
                )
        except BaseException:
            self.close(force=True)
            raise
        return [answers[r][1] for r in range(self.world_size)]

    def _deaths(self, grace_s: float = 2.0) -> str:
        """The ranks that died (with their exit codes), after ``grace_s`` for a dying peer to
        exit: a case that failed on one rank often failed because another one died (its
        connection reset), and the dead rank sends no traceback."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and all(p.is_alive() for p in self._procs):
            time.sleep(0.05)
        dead = self._dead()
        return f"\nrank(s) exited (rank, exit code): {dead}" if dead else ""

    def _dead(self) -> list[tuple[int, int | None]]:
        """``(rank, exit code)`` of each rank that is no longer alive."""
        return [(r, p.exitcode) for r, p in enumerate(self._procs) if not p.is_alive()]

    def _collect(self, timeout: float, what: str) -> dict[int, tuple[bool, Any]]:
        """One answer per rank (``(ok, value)``), or :class:`RankError` as soon as one rank
        fails or dies, or after ``timeout`` seconds."""
        answers: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world_size:
            try:
                rank, ok, value = self._outbox.get(timeout=0.5)
            except queue.Empty:
                dead = self._dead()
                if dead:
                    raise RankError(f"{what}: rank(s) exited (rank, exit code): {dead}") from None
                if time.monotonic() > deadline:
                    raise RankError(
                        f"{what}: timed out after {timeout}s; ranks done: {sorted(answers)}"
                    ) from None
                continue
            answers[rank] = (ok, from_bytes(value) if ok and isinstance(value, bytes) else value)
            if not ok:
                break
        return answers

    def close(self, *, force: bool = False) -> None:
        """Stop every rank (terminate them when ``force`` or when they do not exit in time).

        A rank that returned tensors made a ``/tmp/pymp-*`` folder (the socket multiprocessing
        sends their file descriptors through); only a rank that exits by itself removes it, so
        a world that is not broken is closed without ``force``."""
        if not self._procs:
            return
        if not force:
            for q in self._inboxes:
                q.put(None)
            for p in self._procs:
                p.join(timeout=20)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
