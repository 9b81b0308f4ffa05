"""The device seam: streams, events and buffer lifetimes (``runtime.py``: the protocol and the
CPU runtime; ``cuda.py``: CUDA streams and events; ``simulator.py``: the stream-ordering
simulator the tests run the engine on).

:func:`runtime_for` is how ``fully_shard`` picks a group's runtime from its device
(``FFSDP_RUNTIME=simulator`` picks the simulator, for running any program or the test suite
under it); the root's lazy init then gives every group of the model the root's runtime.
"""

from __future__ import annotations

import os

import torch

from .runtime import ROLES, CPURuntime, DeviceRuntime, Event, Stream

__all__ = ["ROLES", "CPURuntime", "DeviceRuntime", "Event", "Stream", "runtime_for"]

_CHOICES = ("auto", "simulator")


def runtime_for(device: torch.device) -> DeviceRuntime:
    """The runtime for a group on ``device``: ``CudaRuntime`` on a CUDA device, else
    ``CPURuntime``; the ``StreamSimulator`` when ``FFSDP_RUNTIME=simulator``.

    Raises:
        ValueError: ``FFSDP_RUNTIME`` is set to something else than ``auto`` or ``simulator``.
    """
    choice = os.environ.get("FFSDP_RUNTIME", "auto") or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"FFSDP_RUNTIME must be one of {_CHOICES}, got {choice!r}")
    if choice == "simulator":
        from .simulator import StreamSimulator

        return StreamSimulator()
    if device.type == "cuda":
        from .cuda import CudaRuntime

        return CudaRuntime(device)
    return CPURuntime()
