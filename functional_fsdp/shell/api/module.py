"""``FSDPModule``: the class of every module passed to ``fully_shard``, and its methods.

It subclasses torch's own ``torch.distributed.fsdp.FSDPModule``, so code written for FSDP2
(``isinstance(m, torch.distributed.fsdp.FSDPModule)``, pipelining schedules, trainers that look
for sharded submodules) recognises our modules. Every public method of torch's class is
overridden here: none of torch's FSDP2 internals is ever reached through one of ours. Methods
of FSDP2 that we do not implement yet raise ``NotImplementedError`` naming the method.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor

from ...core.coalesce import CommunicationSchedule
from ...core.comm import capabilities
from ...core.compression import GradCompression
from ...core.errors import PolicyError, StateError, UnsupportedError
from ..comm.custom import check_custom_comm
from ..engine.group import ParamGroup
from .deepcopy import deepcopy_fsdp_module
from .finalization import (
    GradientReductionHandle,
    finalization_of,
    finalize,
    register_torch_state,
)
from .state import FSDPState, register_fsdp_forward_method

__all__ = [
    "FSDPModule",
    "GradientReductionHandle",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "swap_class",
]


# One FSDP<Class> per class, as FSDP2 makes them: torch.compile guards a module's forward on
# its type, so a class per instance made every sharded block compile again (two identical
# blocks, two graphs), and past dynamo's recompile limit (8) the rest ran uncompiled.
_FSDP_CLASSES: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def swap_class(module: nn.Module) -> None:
    """Make ``module``'s class ``FSDP<Class>``, a subclass of :class:`FSDPModule` and its class
    (one per class), and give it the state torch's own ``fully_shard.state(module)`` looks up
    (:func:`~.finalization.register_torch_state`)."""
    cls = module.__class__
    if isinstance(module, FSDPModule):
        return
    new_cls = _FSDP_CLASSES.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
        _FSDP_CLASSES[cls] = new_cls
    module.__class__ = new_cls
    register_torch_state(module)  # torch's pipelining reads fully_shard.state(module)


class UnshardHandle:
    """Handle of :meth:`FSDPModule.unshard` with ``async_op=True``; ``wait()`` finishes it."""

    def __init__(self, groups: list[ParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        """Block until the all-gathers are done and the full parameters are on the modules."""
        for g in self._groups:
            g.unshard_onto_modules()
        self._groups = []


def _states(module: nn.Module, recurse: bool) -> list[FSDPState]:
    if not recurse:
        return [module._ffsdp_state]  # type: ignore[list-item]
    return [s for m in module.modules() if (s := getattr(m, "_ffsdp_state", None)) is not None]


def _groups(module: nn.Module, recurse: bool) -> list[ParamGroup]:
    return [s.group for s in _states(module, recurse) if s.group is not None]


def _not_yet(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"FSDPModule.{name} is not supported by functional_fsdp yet (see docs/fsdp2_mapping.md); "
        "use torch.distributed.fsdp.fully_shard for this feature"
    )


class FSDPModule(TorchFSDPModule):
    """Mixin of every module passed to :func:`fully_shard`; FSDP2's ``FSDPModule`` methods.

    A subclass of ``torch.distributed.fsdp.FSDPModule``: ``isinstance`` checks written for
    FSDP2 hold for our modules too.
    """

    # FSDP<Orig> -> [FSDP<Orig>, FSDPModule (ours), FSDPModule (torch's), Orig, ...]
    _orig_cls_mro_index = 3
    _ffsdp_state: FSDPState

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Indexing a container (nn.Sequential[1:]) builds a new instance: give the original class.
        orig: Any = next(c for c in cls.__mro__ if not issubclass(c, TorchFSDPModule))
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:  # type: ignore[override]
        """All-gather this module's parameters (they stay unsharded until resharded)."""
        groups = _groups(self, recurse=False)  # type: ignore[arg-type]
        for gr in groups:
            gr.start_unshard()
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones."""
        for g in _groups(self, recurse=False):  # type: ignore[arg-type]
            g.reshard()

    def __deepcopy__(self, memo: dict[Any, Any]) -> Any:
        """An independent sharded copy: own sharded buffers, parameters, groups and hooks."""
        return deepcopy_fsdp_module(self, memo)  # type: ignore[arg-type]

    def reset_iter_state(self) -> None:
        """Reset training state after an exception mid-iteration (nothing is corrupted).

        A pending :meth:`finalize_backward` handle is invalidated (its ``wait()`` raises)."""
        self._ffsdp_state.reset()
        fin = finalization_of(self)  # type: ignore[arg-type]
        fin.epoch += 1
        fin.pending = None

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the iteration (root only; FSDP2's meaning).

        As in FSDP2 on the host, every reduction has landed in ``.grad`` when a backward ends,
        whatever the flag: a ``zero_grad()`` or an optimizer step after a backward with
        ``False`` sees (or drops) that micro-batch's gradients. (Leaving the last reduction
        in flight past the backward, to overlap the next micro-batch, once made it land later
        into whatever ``.grad`` had become.) Manual finalization
        (:meth:`set_manual_backward_finalization`) leaves the reductions in flight until
        :meth:`finalize_backward`, and supersedes this flag while on.
        """
        # Accepted for FSDP2's callers; nothing depends on it: the end of backward lands every
        # reduction either way (only manual finalization, through the state's
        # is_last_backward, leaves them in flight).
        del is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """FSDP2 2.15's: whether the caller finishes backward with :meth:`finalize_backward`.

        While on, the end of a backward leaves the gradient reductions in flight and keeps
        what ``set_reshard_after_backward(False)`` keeps, whatever
        :meth:`set_is_last_backward` says; :meth:`finalize_backward`, after the last backward
        of the step, reduces what was accumulated without sync, reshards and lands every
        reduction in ``.grad``. Pipeline schedules use it (torch 2.15's stage turns it on
        before each forward and off after the gradient reduction). Call it on the root.

        Raises:
            StateError: not the root (after the first forward showed which module is), or a
                change of mode during a backward (a ``RuntimeError``, as FSDP2's).
        """
        state = self._ffsdp_state
        if state.root is not None and state.root is not state:
            raise StateError(
                f"set_manual_backward_finalization must be called on the root FSDP module "
                f"({state.root.name!r}), not on {state.name!r}"
            )
        fin = finalization_of(self)  # type: ignore[arg-type]
        enabled = bool(enabled)
        if enabled == fin.manual:
            return
        if torch._C._current_graph_task_id() != -1:
            raise StateError("set_manual_backward_finalization cannot change mode during backward")
        # While on, a backward's end finishes nothing; off, it lands every reduction.
        state.is_last_backward = not enabled
        fin.manual = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """FSDP2 2.15's: finish the backward iteration on the calling thread (manual mode).

        Reduces the gradients the backwards accumulated without sync (call
        ``set_requires_gradient_sync(True)`` first), reshards the groups with
        ``reshard_after_backward``, and lands every reduction in ``.grad``. A no-op before the
        root's first forward.

        Args:
            async_op: ``True`` returns a :class:`GradientReductionHandle` with the reductions
                in flight; call its ``wait()`` before reading gradients or the next forward.

        Raises:
            StateError: a previous handle was not waited for, not the root, manual
                finalization is off, or a backward is still running (``RuntimeError`` s, as
                FSDP2's).
        """
        return finalize(self, async_op=async_op)  # type: ignore[arg-type]

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """FSDP2 2.15's: keep the unsharded parameters' storage across reshard and unshard
        (stable data pointers, for CUDA graph capture). Accepted; no effect here: the engine
        gathers into buffers from its runtime's free list and does not capture CUDA graphs, so
        the unsharded storage is released at reshard as by default."""
        for g in _groups(self, recurse):  # type: ignore[arg-type]
            g.configure(keep_unsharded_storage=bool(keep))

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Reduce gradients in backward (``True``) or accumulate them unsharded (``False``)."""
        for g in _groups(self, recurse):  # type: ignore[arg-type]
            g.configure(requires_gradient_sync=requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: all-reduce across replicas now (``True``) or keep a partial sum (``False``)."""
        for g in _groups(self, recurse):  # type: ignore[arg-type]
            g.configure(requires_all_reduce=requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (bool only, as in FSDP2)."""
        if not isinstance(reshard_after_forward, bool):
            raise PolicyError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward).__name__}"
            )
        for s in _states(self, recurse):  # type: ignore[arg-type]
            s.user_reshard_after_forward = reshard_after_forward
            if s.group is not None:
                s.group.configure(reshard_after_forward=reshard_after_forward)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Free the unsharded parameters after backward (default ``True``)."""
        for g in _groups(self, recurse):  # type: ignore[arg-type]
            g.configure(reshard_after_backward=reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[Any]) -> None:
        """Explicit forward prefetch: all-gather these modules when this one's forward starts."""
        _check_fsdp_modules(modules)
        self._ffsdp_state.explicit_forward_prefetch = [m._ffsdp_state for m in modules]
        if (root := self._ffsdp_state.root) is not None:
            root.forget_plan()  # explicit prefetch wins over coalesced gathers

    def set_modules_to_backward_prefetch(self, modules: list[Any]) -> None:
        """Explicit backward prefetch: all-gather these modules when this one's backward starts."""
        _check_fsdp_modules(modules)
        self._ffsdp_state.explicit_backward_prefetch = [m._ffsdp_state for m in modules]
        if (root := self._ffsdp_state.root) is not None:
            root.forget_plan()  # explicit prefetch wins over coalesced gathers

    def set_bucket_bytes(self, bucket_bytes: int) -> None:
        """Coalesce the collectives of adjacent small groups up to ``bucket_bytes`` of
        unsharded data per collective (``0``: one collective per group, as FSDP2). Governs the
        root's schedule (call it on the root, or on any module before the first forward to
        set the value its root will use); the schedule is derived again from the recorded
        order. Bit-identical either way: see :meth:`communication_schedule`.

        Raises:
            TypeError: not an int (``bool`` included).
            PolicyError: negative.
        """
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
            raise TypeError(f"bucket_bytes must be an int, got {type(bucket_bytes).__name__}")
        if bucket_bytes < 0:
            raise PolicyError(
                f"bucket_bytes must be >= 0 (0 turns coalescing off), got {bucket_bytes}"
            )
        state = self._ffsdp_state
        root = state.root if state.root is not None else state
        root.set_bucket_bytes(bucket_bytes)
        if root is not state:
            state.bucket_bytes = bucket_bytes

    def communication_schedule(self) -> CommunicationSchedule:
        """Which groups' collectives travel together (a frozen record): the forward's
        all-gathers and the backward's all-gathers and reduce-scatters, as buckets of group
        names in the order they run, and the bucket size. Derived by the root from the order
        its first forward recorded; the same on every rank.

        Raises:
            StateError: before the root's first forward (nothing is recorded yet).
        """
        state = self._ffsdp_state
        root = state.root
        if root is None or not root.order_recorded:
            raise StateError(
                "communication_schedule(): the schedule is derived from the order of the root's "
                "first forward; run one forward (and backward) through the root first"
            )
        return root.schedule_record()

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide gradients by ``factor`` instead of the data-parallel size.

        Raises:
            PolicyError: ``factor`` is not a positive, finite number (checked before any change).
        """
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise PolicyError(
                f"set_gradient_divide_factor expects a positive number, got {type(factor).__name__}"
            )
        if not (math.isfinite(factor) and factor > 0):
            raise PolicyError(
                f"set_gradient_divide_factor({factor!r}): the factor must be a positive, finite "
                "number (gradients are divided by it); use the data-parallel size for averaging"
            )
        for g in _groups(self, True):
            g.configure(divide_factor=factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Use sum reductions with explicit pre/post division (no ``avg`` reductions)."""
        for g in _groups(self, True):  # type: ignore[arg-type]
            g.configure(force_sum=enable)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Also reduce-scatter (zero) gradients of parameters that got none."""
        for g in _groups(self, recurse):  # type: ignore[arg-type]
            g.configure(reduce_unused=reduce_scatter_unused_params)

    def set_gradient_compression(
        self, compression: GradCompression | None, *, recurse: bool = True
    ) -> None:
        """Beyond FSDP2: reduce-scatter gradients in a narrow format with error feedback.

        ``compression`` is a :class:`~functional_fsdp.core.compression.GradCompression` (e.g. int8
        with one fp32 scale per 256 elements: 3.94x fewer bytes than fp32) or ``None`` for
        FSDP2's exact reduction (which also drops the residual). Call it with the same policy
        on every rank. The residual of the error feedback lives in each group's
        :class:`~functional_fsdp.core.reduction.ReduceState` (one fp32 buffer of the group's
        unsharded gradient size); it is not part of ``state_dict``.

        Raises:
            PolicyError: ``compression`` is not a ``GradCompression``, or a group has a custom
                reduce-scatter (``set_custom_reduce_scatter``), which it would replace (checked
                on every group before any change).
        """
        if compression is not None and not isinstance(compression, GradCompression):
            raise PolicyError(
                "set_gradient_compression expects a functional_fsdp.GradCompression or None, "
                f"got {type(compression).__name__}"
            )
        groups = list(_groups(self, recurse))  # type: ignore[arg-type]
        for g in groups:
            if compression is not None and capabilities(g.comm).custom_reduce_scatter:
                raise PolicyError(
                    f"set_gradient_compression: group {g.name!r} has a custom reduce-scatter "
                    "(set_custom_reduce_scatter); remove it first (set_custom_reduce_scatter"
                    "(None)) or leave compression off for that module (recurse=False)"
                )
        for g in groups:
            g.set_grad_compression(compression)

    def set_post_optim_event(self, event: Any) -> None:
        """FSDP2's: ``event`` (a ``torch.cuda.Event`` recorded after an optimizer step, e.g. on
        another stream) is waited for by the next forward's all-gather streams, once.

        On CUDA the copy-in and all-gather streams wait for it at the root's next pre-forward
        (FSDP2 waits for it *instead of* the current stream; here every gather still waits for
        the current stream too, which orders more but never less). On the CPU there are no
        streams: nothing to wait for.
        """
        state = self._ffsdp_state
        (state.root or state).post_optim_event = event

    # FSDP2's communication extension points (shell/custom_comm.py; docs/api.md).

    def set_custom_all_gather(self, comm: Any) -> None:
        """Run this module's all-gathers through ``comm``, an FSDP2 ``AllGather`` object.

        As in FSDP2, per module (not recursive): the group's output buffer comes from
        ``comm.allocate((ws * n,), dtype=..., device=...)``, this rank's packed shards are
        copied into its slice, and ``comm(output_tensor=..., input_tensor=<that slice>,
        group=<the shard process group>, async_op=True)`` gathers; the result is copied into
        the group's unsharded buffer. The group takes the packed path (not the per-parameter
        pieces). ``None`` restores the built-in all-gather.

        Raises:
            PolicyError: ``comm`` has no ``allocate`` method or is not callable.
        """
        check_custom_comm(comm, "set_custom_all_gather")
        self._set_custom(all_gather=comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Run this module's gradient reduce-scatters through ``comm``, an FSDP2
        ``ReduceScatter`` object (``None`` restores the built-in one).

        Input and output buffers come from ``comm.allocate`` (in the reduce dtype), then
        ``comm(output_tensor=..., input_tensor=..., group=..., op=ReduceOp.AVG | SUM,
        async_op=True)``. See :mod:`functional_fsdp.shell.comm.custom` for the details.

        Raises:
            PolicyError: ``comm`` has no ``allocate`` method or is not callable.
        """
        check_custom_comm(comm, "set_custom_reduce_scatter")
        g = self._ffsdp_state.group
        if comm is not None and g is not None and g.config.grad_compression is not None:
            raise PolicyError(
                f"set_custom_reduce_scatter: group {g.name!r} compresses its gradient reduction "
                "(set_gradient_compression), which the custom reduce-scatter would replace; call "
                "set_gradient_compression(None) first"
            )
        self._set_custom(reduce_scatter=comm)

    def _set_custom(self, **kw: Any) -> None:
        g = self._ffsdp_state.group
        if g is not None:
            g.use_custom_collectives(**kw)

    def set_all_reduce_hook(self, hook: Any, *, stream: Any = None) -> None:
        """Call ``hook(reduce_output)`` on this module's reduced gradients (FSDP2's semantics).

        ``reduce_output`` is the group's flat, padded sharded gradient in the reduce dtype,
        before any post-divide and the cast to the parameters' dtype; the hook may change it in
        place. Without HSDP it runs after the reduce-scatter (e.g. for a custom replicate
        all-reduce); with HSDP after the replicate all-reduce, and not on a step that skips it
        (``set_requires_all_reduce(False)``). Per module, not recursive; ``None`` removes it.

        ``stream``: accepted and not used: on CUDA the hook runs on the reduce-scatter stream,
        after the reduce-scatter and before the post-reduce work that reads its output (FSDP2
        runs it on ``stream`` after waiting for the reduce-scatter: the same order). With HSDP,
        as in FSDP2, it is an error.

        Raises:
            PolicyError: ``hook`` is not callable, or ``stream`` is given with HSDP.
        """
        if hook is not None and not callable(hook):
            raise PolicyError(f"set_all_reduce_hook expects a callable, got {type(hook).__name__}")
        g = self._ffsdp_state.group
        if g is None:
            return
        if stream is not None and g.replicate_comm is not None:
            raise PolicyError(
                "set_all_reduce_hook: stream cannot be set when using native HSDP (the hook runs "
                "after the replicate all-reduce); leave stream=None"
            )
        g.configure(all_reduce_hook=hook)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward all-gathers this module's parameters (default ``True``).

        ``False`` is for groups whose parameters the backward does not read (e.g. an embedding):
        backward then skips their all-gather and its prefetch; gradients are reduced as usual.
        Per module, not recursive (as in FSDP2).
        """
        g = self._ffsdp_state.group
        if g is not None:
            g.configure(unshard_in_backward=bool(unshard_in_backward))

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted; has no effect here (FSDP2's hint to allocate staging buffers with the
        process group's own allocator, e.g. NCCL's for zero-copy SHARP transfers).

        On CPU/gloo FSDP2 itself falls back to ``torch.empty``: gloo's backend reports no tensor
        allocator (``supports_tensor_alloc`` is ``False``), so the hint changes nothing there
        either. On NCCL our engine gathers straight into its own buffers and does not apply it
        yet. As in FSDP2 it cannot be combined with a custom all-gather or reduce-scatter.

        Raises:
            PolicyError: a custom all-gather or reduce-scatter is set on this module.
        """
        g = self._ffsdp_state.group
        if g is None:
            return
        if capabilities(g.comm).custom:
            raise PolicyError(
                "cannot call set_allocate_memory_from_process_group_for_comm() when a custom "
                "all-gather or reduce-scatter is set (set_custom_all_gather / "
                "set_custom_reduce_scatter decide the allocation through their allocate())"
            )
        g.configure(allocate_from_process_group=bool(enable))

    # FSDP2's CUDA performance knobs: validated as FSDP2 does; the engine needs none of them.

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Accepted (validated as in FSDP2); no effect here.

        FSDP2 recycles one reduce-scatter input buffer, so the next copy-in waits for the
        previous reduce-scatter; this raises the number kept. Our engine packs each reduction
        into a fresh buffer (or sends straight from the gradients) and keeps one reduction in
        flight per root, so there is no recycle wait to remove.

        Raises:
            TypeError: ``max_input_buffers`` is not an int (``bool`` included).
            PolicyError: it is below 1.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise PolicyError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for g in _groups(self, recurse):  # type: ignore[arg-type]
            g.configure(reduce_scatter_max_input_buffers=max_input_buffers)

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Accepted; no effect here. FSDP2 gives the reduce-scatter its own NCCL communicator
        so it can progress beside the all-gathers; on gloo our collectives are tagged
        point-to-point messages that already progress concurrently on one group."""
        for g in _groups(self, recurse):  # type: ignore[arg-type]
            g.configure(separate_reduce_scatter_group=bool(enable))

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported: NCCL symmetric memory needs CUDA and NCCL, and our engine does not
        allocate its staging buffers from it (FSDP2 without CUDA cannot use it either)."""
        del backend
        raise UnsupportedError(
            "FSDPModule.set_symm_mem_for_comm is not supported by functional_fsdp: NCCL "
            "symmetric memory needs CUDA and NCCL, and this engine does not allocate its "
            "staging buffers from it (see docs/fsdp2_mapping.md); leave it unset"
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:
        raise _not_yet("_set_unshard_async_op")

    def _get_fsdp_state(self) -> Any:
        raise _not_yet("_get_fsdp_state (torch's private FSDP2 state)")

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        self.reshard()
        ret = super(TorchFSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]
        g = self._ffsdp_state.group
        if g is not None and _members_agree(g):
            g.refresh_from_modules()
        for use in self._ffsdp_state.tied:  # a weight tied across groups: the owner's again
            use.to_sharded()
        return ret


def _members_agree(group: ParamGroup) -> bool:
    """Whether the parameters of every module of ``group`` are on one device now.

    ``_apply`` (``to_empty``, ``to``, ``cuda``) reaches the modules of a list-form group
    (``fully_shard([model.norm, model.output])``) one by one: after the first, the others'
    parameters are still where they were, on the meta device after a meta init, where they
    have no data to pack. FSDP2 re-adopts each parameter alone and skips those on meta; ours
    packs the group into one buffer, so it waits until the last member has moved (the call
    that sees them all on one device) and packs once.
    """
    devices = set()
    for sp in group.sharded_params:
        p = sp.registered()
        if p is not None:
            devices.add((p._local_tensor if isinstance(p, DTensor) else p).device)
    return len(devices) <= 1


def _check_fsdp_modules(modules: Iterable[Any]) -> None:
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise StateError(
                f"Expects FSDPModule (a module passed to fully_shard), got {type(m).__name__}; "
                "fully_shard it first"
            )


def share_comm_ctx(modules: list[Any]) -> None:
    """FSDP2's ``torch.distributed.fsdp.share_comm_ctx``: the roots of ``modules`` (e.g.
    pipeline-parallel model chunks) use one device runtime.

    FSDP2 shares its communication context (its CUDA all-gather, reduce-scatter and all-reduce
    streams and what is kept on them) so that several roots do not fragment memory across
    streams. Here every group under ``modules`` gets the first group's runtime: one set of side
    streams and one free list on CUDA, one host buffer pool on the CPU. Call it before the
    first forward, as FSDP2's docs say; each root's lazy init then keeps it (a root's groups
    use their root group's runtime).

    Raises:
        StateError: an entry is not an :class:`FSDPModule` (a ``ValueError``, as FSDP2's).
    """
    _check_fsdp_modules(modules)
    groups = [s.group for m in modules for s in _states(m, True) if s.group is not None]
    if groups:
        for g in groups[1:]:
            g.use_runtime(groups[0].runtime)
