"""Specific exception types. Every message names what is wrong and how to fix it."""

from __future__ import annotations

__all__ = [
    "DonatedStateError",
    "FSDPError",
    "IndivisibleError",
    "LayoutMismatchError",
    "MeshError",
    "PolicyError",
    "ScalarParameterError",
    "StateError",
    "TiedParameterError",
    "UnsupportedError",
]


class FSDPError(Exception):
    """Base class of every error raised by functional_fsdp."""


class ScalarParameterError(FSDPError, ValueError):
    """A 0-d tensor cannot be sharded on a dimension."""


class IndivisibleError(FSDPError, ValueError):
    """A dimension or size that must divide evenly does not.

    Attributes:
        dim: the tensor dimension (or ``None`` for a non-tensor size).
        size: the size that should have divided.
        factor: the divisor.
    """

    def __init__(self, message: str, *, dim: int | None, size: int, factor: int) -> None:
        super().__init__(message)
        self.dim = dim
        self.size = size
        self.factor = factor


class LayoutMismatchError(FSDPError, ValueError):
    """Tensors do not match the layout they are combined with (count, shape or dtype)."""


class StateError(FSDPError, RuntimeError):
    """A transition was called on a record, or a module, in the wrong state."""


class PolicyError(FSDPError, ValueError):
    """An invalid mixed-precision or offload policy, or invalid option combination."""


class MeshError(FSDPError, ValueError):
    """A device mesh or communicator that cannot be used as asked."""


class TiedParameterError(FSDPError, ValueError):
    """One parameter is managed by two FSDP groups."""


class DonatedStateError(StateError):
    """A state passed to a step with ``donate=True`` was used again (its buffers were consumed)."""


class UnsupportedError(FSDPError, NotImplementedError):
    """A feature that this code path does not support (the message names the alternative)."""
