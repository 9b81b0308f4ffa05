"""The stream-ordering simulator, for tests: run the engine on it and every stream-ordering bug
fails the test at the operation that breaks the order.

:class:`StreamSimulator` (implemented in :mod:`functional_fsdp.shell.device.simulator`) is a
device runtime with the CUDA runtime's streams (compute, copy-in, all-gather, reduce-scatter,
all-reduce) that runs every operation at once on the CPU and keeps a vector clock per stream. The
engine tells it, for every copy-in, collective, copy-out, reduction and free, which stream runs
it, which events it waits on, and which buffers it reads and writes; the simulator raises
:class:`StreamOrderError` on a read before its producer's event, a write while another stream
may still use the buffer, a free before the last consumer's event, or a use after free.

Three ways to run a model on it:

- ``FFSDP_RUNTIME=simulator`` in the environment: every ``fully_shard`` picks the simulator
  (``FFSDP_RUNTIME=simulator python -m pytest`` runs the test suite on it);
- :func:`simulate_streams`: the same, for the ``fully_shard`` calls inside a ``with`` block;
- :func:`use_runtime`: give every group of an already sharded model one runtime (e.g. a
  ``StreamSimulator(strict=False)`` that collects the violations instead of raising).

Example:
    >>> import torch
    >>> sim = StreamSimulator()
    >>> buf = torch.zeros(4)
    >>> sim.access(sim.side_stream("all_gather"), "all-gather", writes=[buf])
    >>> sim.wait_event(sim.compute, sim.record(sim.side_stream("all_gather")))
    >>> sim.access(sim.compute, "forward", reads=[buf])  # ordered by the event: fine
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

from ..shell.device.runtime import DeviceRuntime
from ..shell.device.simulator import StreamOrderError, StreamSimulator, Violation

__all__ = [
    "StreamOrderError",
    "StreamSimulator",
    "Violation",
    "runtime_of",
    "simulate_streams",
    "use_runtime",
]


@contextlib.contextmanager
def simulate_streams() -> Iterator[None]:
    """``fully_shard`` calls inside the block give their groups the simulator
    (``FFSDP_RUNTIME=simulator`` for the duration; the root's lazy init then shares the root
    group's simulator among all the model's groups)."""
    before = os.environ.get("FFSDP_RUNTIME")
    os.environ["FFSDP_RUNTIME"] = "simulator"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FFSDP_RUNTIME", None)
        else:
            os.environ["FFSDP_RUNTIME"] = before


def _groups(module: nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    for m in module.modules():
        state = getattr(m, "_ffsdp_state", None)
        g = getattr(state, "group", None)
        if g is not None:
            seen.setdefault(id(g), g)
    return list(seen.values())


def use_runtime(module: nn.Module, runtime: DeviceRuntime | None = None) -> DeviceRuntime:
    """Give every FSDP group of ``module`` (an idle model, before or between steps) one
    ``runtime`` (default: a new strict :class:`StreamSimulator`); return it."""
    rt: DeviceRuntime = StreamSimulator() if runtime is None else runtime
    for g in _groups(module):
        g.use_runtime(rt)
    return rt


def runtime_of(module: nn.Module) -> DeviceRuntime:
    """The runtime the groups of ``module`` use (after its first forward: the root's)."""
    groups = _groups(module)
    if not groups:
        raise ValueError(f"{type(module).__name__} has no FSDP parameter group")
    return groups[0].runtime
