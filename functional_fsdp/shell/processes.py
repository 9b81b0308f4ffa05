"""How local ranks start: forked from a server that imported torch once.

A spawned rank imports torch again (about 2.5 s of CPU on the 2-core machine, per rank, per
launch): a 4-rank world took 5.3 s to start, most of it importing. A fork server that imported
torch and this package once starts each rank in about 0.05 s (a 4-rank world in 0.15 s, after
the server's first 2 s). The server imports only modules and runs no torch operation, so a rank
forked from it initialises gloo, OpenMP and CUDA itself, as a spawned one (numpy's OpenBLAS
starts its thread pool at import; OpenBLAS handles a fork itself).

A forked rank gets the parent's working directory, ``sys.path``, ``sys.argv`` and main module
from ``multiprocessing``, as a spawned one, but everything else from the server as it was when
the server started. :class:`Parent` carries the rest of what a spawned rank would have had, as
the caller has it at the rank's start: the environment, standard output and error, umask,
resource limits, scheduling priority and CPU affinity. It is unpickled first and applies them
then, before the rank imports the module of the function it runs (whose top level then sees the
caller's environment); only a script's own top level, which ``multiprocessing`` runs again in
each rank before anything is unpickled, still sees the server's environment. A rank also draws
a fresh torch seed: torch seeds itself at import, once, in the server, so every rank (and every
launch) would start from the same random numbers, where spawned ranks differ.

The server does not preload ``__main__`` (``multiprocessing``'s default): on the Pythons that
honour it (3.13.8 and later) it runs the user's script's top level in the server, with the
server's ``sys.argv``, and a script without an ``if __name__ == "__main__"`` guard kills it.
Where the platform has no fork server (Windows) ranks are spawned, and :class:`Parent` carries
nothing they do not inherit anyway.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import sys
from typing import Any

__all__ = ["Parent", "from_bytes", "rank_context", "to_bytes"]

# torch._dynamo: every rank's first DTensor op imports it (FakeTensorMode's sharding
# propagation, about 1.1 s of CPU): once in the server instead of once in every rank.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "functional_fsdp")


def rank_context(extra_preload: tuple[str, ...] = ()) -> Any:
    """The ``multiprocessing`` context to start local ranks from: ``forkserver`` with torch
    and this package preloaded (plus ``extra_preload``, modules the ranks import anyway) where
    available, else ``spawn``. The preload list is set while the server is not yet running
    and the server started (later lists add nothing); a list the user set is kept, but for
    ``__main__`` (see the module's docstring)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver
    if not server._forkserver_pid:  # not started yet
        have = [m for m in server._preload_modules if m != "__main__"]
        ctx.set_forkserver_preload(have + [m for m in (*PRELOAD, *extra_preload) if m not in have])
        _start_server_on_this_path()
    return ctx


def _start_server_on_this_path() -> None:
    """Start the fork server now, importing its preload list on the caller's ``sys.path``.

    ``multiprocessing`` hands the server the caller's ``sys.path`` but the server of Python 3.11
    and 3.12 ignores it: it imports on the interpreter's default path, and a preloaded module
    found only on a directory the caller added at run time (a script's or a test's folder)
    fails to import there, silently (``ImportError`` is swallowed). Every rank then imported it
    again itself. The path goes to the server as ``PYTHONPATH`` for its start only; the ranks
    take the caller's environment anyway (:class:`Parent`)."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


_STREAMS = (1, 2)
_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_AS", "RLIMIT_DATA",
           "RLIMIT_FSIZE", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_MEMLOCK")  # fmt: skip


class Parent:
    """What a rank inherits from the process that starts it, taken at its start, for a rank
    forked from the server (see the module's docstring). Pass it first among the rank's
    arguments: unpickling it applies it, before the later arguments import anything. With
    ``ctx`` a ``spawn`` context it carries nothing (a spawned rank inherits all of it)."""

    def __init__(self, ctx: Any) -> None:
        self.forked = ctx.get_start_method() == "forkserver"
        self.env = dict(os.environ)
        self.state = _process_state() if self.forked else {}
        self._fds: tuple[Any, ...] = ()

    def __reduce__(self) -> Any:
        if not self.forked:
            return (_received, (False, {}, {}, ()))
        from multiprocessing import reduction

        fds = tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in _STREAMS)
        return (_received, (True, self.env, self.state, fds))

    def adopt(self) -> None:
        """Make the caller's environment, standard streams and process settings this rank's,
        and draw a fresh torch seed (done once, when unpickled; later calls do nothing)."""
        if not self.forked:
            return
        self.forked = False
        if os.environ != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        for target, dup in zip(_STREAMS, self._fds):
            if dup is None:
                continue
            fd = dup.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        self._fds = ()
        _apply_process_state(self.state)
        import torch

        torch.seed()


def _received(forked: bool, env: dict[str, str], state: dict[str, Any], fds: tuple) -> Parent:
    parent = Parent.__new__(Parent)
    parent.forked, parent.env, parent.state, parent._fds = forked, env, state, fds
    parent.adopt()
    return parent


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _process_state() -> dict[str, Any]:
    """This process's umask, resource limits, priority and CPU affinity (where the platform
    has them)."""
    state: dict[str, Any] = {"umask": _umask()}
    try:
        import resource
    except ImportError:
        return state
    state["limits"] = {
        name: resource.getrlimit(getattr(resource, name))
        for name in _LIMITS
        if hasattr(resource, name)
    }
    if hasattr(os, "getpriority"):
        state["priority"] = os.getpriority(os.PRIO_PROCESS, 0)
    if hasattr(os, "sched_getaffinity"):
        state["affinity"] = os.sched_getaffinity(0)
    return state


def _umask() -> int:
    """This process's umask: read from ``/proc`` where it can be (setting it to read it back
    would, for an instant, give another thread's new files no umask)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _apply_process_state(state: dict[str, Any]) -> None:
    """Apply what :func:`_process_state` read in the caller; a setting this process may not
    take (a limit above its hard limit, a higher priority) is left as the server's."""
    if "umask" in state:
        os.umask(state["umask"])
    if state.get("limits"):
        import resource

        for name, limits in state["limits"].items():
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(getattr(resource, name), limits)
    with contextlib.suppress(OSError):
        if "priority" in state and os.getpriority(os.PRIO_PROCESS, 0) != state["priority"]:
            os.setpriority(os.PRIO_PROCESS, 0, state["priority"])
    with contextlib.suppress(OSError):
        if "affinity" in state and sys.platform.startswith("linux"):
            os.sched_setaffinity(0, state["affinity"])


def to_bytes(value: Any) -> bytes:
    """``value`` as bytes, for a rank's result to cross to its parent through a queue without
    passing file descriptors (the queues' own pickler moves each tensor through a new
    shared-memory file and a socket connection).

    ``torch.save`` first: tensors' storages inline, a storage several tensors share once. It
    refuses tensors that view one storage as different dtypes (a flat buffer's fp32 and bf16
    views); then each plain CPU tensor is pickled as its own bytes (its dtype, shape,
    ``requires_grad`` and whether it is a ``Parameter`` kept; shared storage copied once per
    tensor)."""
    import torch

    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except RuntimeError:
        buf = io.BytesIO()
        _ByValuePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


def from_bytes(data: bytes) -> Any:
    """What :func:`to_bytes` made (our own child's bytes: trusted, so any picklable object is
    allowed back)."""
    import torch

    if data[:2] == b"PK":  # torch.save's zip archive; a pickle starts with its protocol
        return torch.load(io.BytesIO(data), weights_only=False)
    return pickle.loads(data)


class _ByValuePickler(pickle.Pickler):
    """Pickles a plain CPU tensor as its bytes."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
            t = obj.detach()
            if t.layout == torch.strided and t.device.type == "cpu" and not t.is_quantized:
                t = t.contiguous()
                data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
                param = type(obj) is torch.nn.Parameter
                return _tensor_from_bytes, (data, t.dtype, tuple(t.shape), obj.requires_grad, param)
        return NotImplemented


def _tensor_from_bytes(data: bytes, dtype: Any, shape: tuple, grad: bool, param: bool) -> Any:
    import torch

    flat = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
    t = flat.reshape(shape)
    return torch.nn.Parameter(t, requires_grad=grad) if param else t.requires_grad_(grad)
