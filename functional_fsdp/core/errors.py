"""Specific exception types. Every message names what is wrong and how to fix it."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AlreadyShardedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerAbortedError",
    "PeerLeftError",
    "CheckpointIntegrityError",
    "CheckpointPathError",
    "DonatedStateError",
    "ArgumentTypeError",
    "FSDPError",
    "HyperparameterError",
    "OptimizerStateError",
    "StepInputError",
    "IncompatibleMeshError",
    "IndivisibleError",
    "LayoutMismatchError",
    "LifecycleError",
    "MeshError",
    "MissingDependencyError",
    "PolicyError",
    "ReplacedParameterError",
    "ReproducibilityError",
    "ReproducibilityWarning",
    "ScalarParameterError",
    "StateError",
    "TiedParameterError",
    "TiedPlacementError",
    "UncheckedCheckpointWarning",
    "UnrecoverableLossError",
    "UnsupportedError",
    "UnsupportedPlacementError",
    "WholeMatrixError",
]


class FSDPError(Exception):
    """Base class of every error raised by functional_fsdp."""


class ScalarParameterError(FSDPError, ValueError):
    """A 0-d tensor cannot be sharded on a dimension."""


class IndivisibleError(FSDPError, ValueError, NotImplementedError, AssertionError):
    """A dimension or size that must divide evenly does not, or a shard dim out of range.

    Drop-in for FSDP2, which raises ``ValueError`` (``reshard_after_forward`` not a factor),
    ``NotImplementedError`` (uneven ``Shard(i)``, ``i > 0``) and ``AssertionError`` (shard dim
    out of range) for these mistakes: ``except`` clauses written for any of them catch it.

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

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), dict(vars(self))))


class LayoutMismatchError(FSDPError, ValueError):
    """Tensors do not match the layout they are combined with (count, shape or dtype)."""


class GatherCodecError(FSDPError, ValueError):
    """A tensor subclass's all-gather hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``)
    broke FSDP2's protocol: wrong return type, input shapes/dtypes that differ from the layout
    (or between ranks), or a hook that raised."""


class HyperparameterError(FSDPError, ValueError):
    """An optimizer, schedule or training-step setting is out of range (``lr < 0``, betas
    outside ``[0, 1)``, ``grad_accum < 1``, schedule boundaries that do not increase, ...)."""


class OptimizerStateError(FSDPError, ValueError):
    """An optimizer state (or parameters) does not fit what it is combined with: another
    tree structure, another model's parameters, a torch optimizer state a bridge cannot
    convert, or no ``InjectHyperparamsState`` where hyper-parameters are set."""


class StepInputError(FSDPError, ValueError):
    """What the training step was given does not fit: a batch that does not split into
    ``grad_accum`` micro-batches, or a ``loss_fn`` that does not return a scalar (or
    ``(loss, aux)`` with ``has_aux=True``)."""


class ArgumentTypeError(FSDPError, TypeError):
    """An argument of the wrong type (a torch optimizer where a functional one is expected,
    a plain module where the root ``FSDPModule`` is expected, ...)."""


class StateError(FSDPError, RuntimeError, ValueError):
    """A transition was called on a record, or a module, in the wrong state (or on a module
    that is not an FSDP module).

    Drop-in for FSDP2, which raises ``RuntimeError`` for wrong-state calls (a child run before
    its root) and ``ValueError`` for a plain module where an FSDP module is expected
    (``set_modules_to_forward_prefetch([nn.Linear(...)])``).
    """


class LifecycleError(StateError):
    """A group got an event its stage does not accept (``core/lifecycle.py``): the message
    names the group, its stage, the stages that accept the event and what to do."""


class AlreadyShardedError(StateError, AssertionError):
    """``fully_shard`` was called again on a module it already sharded. Raised at the second
    call, before anything changes; an ``AssertionError`` too, as FSDP2's composable-API
    check raises."""


class PolicyError(FSDPError, ValueError):
    """An invalid mixed-precision or offload policy, option value or option combination
    (e.g. an integer ``param_dtype`` or a gradient divide factor that is not a positive,
    finite number)."""


class MeshError(FSDPError, ValueError):
    """A device mesh or communicator that cannot be used as asked."""


class TiedParameterError(FSDPError, ValueError):
    """One parameter is managed by two FSDP groups."""


class IncompatibleMeshError(MeshError):
    """A tensor-parallel ``DTensor`` parameter lives on a mesh that does not compose with the
    data-parallel mesh given to ``fully_shard`` (the dims overlap, the meshes come from
    different parents, or this rank's dp and TP groups do not meet in exactly this rank)."""


class TiedPlacementError(TiedParameterError):
    """Two parameters share storage (tied weights) but carry different tensor-parallel
    placements: sharding them would silently untie them."""


class ReplacedParameterError(FSDPError, RuntimeError):
    """An optimizer steps parameters that ``fully_shard`` replaced (it was built before
    ``fully_shard``): it would update tensors the model no longer uses. Raised at its first
    step, before anything is modified; the message names the parameters."""


class DonatedStateError(StateError):
    """A state passed to a step with ``donate=True`` was used again (its buffers were consumed)."""


class UnsupportedError(FSDPError, NotImplementedError):
    """A feature that this code path does not support (the message names the alternative)."""


class UnsupportedPlacementError(UnsupportedError, ValueError):
    """A tensor-parallel placement FSDP cannot compose with (``Partial``, a strided shard, a
    shard dim out of range); the message lists the supported ones. ``NotImplementedError`` as
    FSDP2 raises for TP layouts it does not support, and ``ValueError``."""


class CheckpointPathError(FSDPError, ValueError):
    """A checkpoint names a storage file outside its directory (an absolute path, a ``..``
    component or a symlink that leads out); nothing was read from it.

    Attributes:
        path: the offending path as the checkpoint names it.
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        # DCP ships a failing rank's exception to the others by pickling it.
        return (_rebuild, (type(self), str(self), dict(vars(self))))


class CheckpointIntegrityError(FSDPError, RuntimeError):
    """A stored checkpoint item does not match the checksum recorded when it was saved (or
    is truncated, or has no recorded checksum while the others do).

    ``RuntimeError`` as torch's own unreadable-file errors, so ``except RuntimeError`` around a
    load keeps working.

    Attributes:
        item: the item's key (fqn, with its chunk offset when it is a shard).
    """

    def __init__(self, message: str, *, item: str = "") -> None:
        super().__init__(message)
        self.item = item

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), dict(vars(self))))


class MissingDependencyError(FSDPError, ImportError):
    """An optional package that this operation needs is not installed."""


class UncheckedCheckpointWarning(UserWarning):
    """A checkpoint was loaded without checksum verification (it was saved without them)."""


def _rebuild(cls: type[FSDPError], message: str, attributes: dict[str, Any]) -> FSDPError:
    """Unpickle an error whose ``__init__`` takes keyword-only attributes."""
    err = cls.__new__(cls, message)
    Exception.__init__(err, message)
    err.__dict__.update(attributes)
    return err


class CollectiveError(FSDPError, RuntimeError):
    """A collective could not complete because the ranks diverged or one of them failed.

    Every rank ends in one (never a hang): the rank that times out tells the others through the
    process group's store. Recovery: call ``reset_iter_state()`` on the root module on every
    rank; the ranks agree on a fresh collective epoch and the next step runs normally.
    """


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """This rank waited longer than the collective timeout for its peers (``FFSDP_COLLECTIVE_TIMEOUT``)."""


class PeerAbortedError(CollectiveError):
    """Another rank abandoned the current collectives (it failed, or called ``reset_iter_state``)."""


class PeerLeftError(CollectiveError):
    """A peer can never post the collective this rank waits for: its program ended, or it has
    issued no collective for the grace period (``FFSDP_PEER_IDLE_GRACE``) while blocked in a
    ``torch.distributed`` call outside functional_fsdp (it left the training loop). Raised by
    the watchdog on the waiting ranks; the message says where each rank is."""


class CollectiveMismatchError(CollectiveTimeoutError):
    """The ranks wait for different collectives (a different number of micro-batches, a
    submodule run on some ranks only, ``set_requires_gradient_sync`` or ``summon_full_params``
    on some ranks only): found by comparing the ranks' positions after a few seconds of waiting
    (``FFSDP_MISMATCH_GRACE``) instead of waiting out the timeout. Raised on every rank; the
    message names where each rank waits (collective kind and module). A
    :class:`CollectiveTimeoutError`, so handlers written for the timeout still catch it."""


class WholeMatrixError(FSDPError, ValueError):
    """A whole-matrix optimizer (``functional_fsdp.optim.Muon``, ``functional.muon``,
    ``functional.whole_matrix``) was asked to treat a tensor as a matrix it cannot gather: not
    2-D, or a placement other than ``Shard(0)`` / ``Replicate`` on its mesh (2-D FSDP + TP), or
    local rows that are not ``torch.chunk``'s; also raised when ``torch.optim.Muon`` is stepped
    on sharded ``DTensor`` parameters, which it does not orthogonalize as whole matrices."""


class ReproducibilityError(FSDPError, ValueError):
    """A :class:`~functional_fsdp.core.reproducible.ReproduciblePolicy` cannot hold as used: a
    virtual world size that is not a power of two, a data-parallel world size that does not
    divide it, a step that ran a different number of micro-batches than ``V / N``, or a
    feature whose sums the policy cannot order (e.g. compressed reduction)."""


class ReproducibilityWarning(UserWarning):
    """Something that runs, but not bit-identically across world sizes, under a
    :class:`~functional_fsdp.core.reproducible.ReproduciblePolicy`: e.g.
    ``torch.nn.utils.clip_grad_norm_`` over the policy's parameters (use
    ``functional_fsdp.clip_grad_norm_``). ``warnings.simplefilter("error",
    ReproducibilityWarning)`` turns it into an error."""


class UnrecoverableLossError(StateError):
    """Ranks were lost that the survivors cannot rebuild from memory: two neighbours together
    (each held the other's only copy), every rank, or a loss at a moment when no step is
    restorable on every survivor. Raised on every survivor, before any collective of the new
    world; the checkpoints on disk are untouched: resume from the last one."""
