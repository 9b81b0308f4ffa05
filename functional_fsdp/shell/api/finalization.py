"""Finishing a backward outside autograd's end-of-backward callback (pipeline schedules).

A pipeline schedule runs each micro-batch's backward without gradient sync and keeps the
parameters unsharded (``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``),
then reduces every gradient once, as a separate action. torch asks FSDP2 for that in two ways,
and this module answers both for our modules:

* torch 2.15's public methods, :meth:`FSDPModule.set_manual_backward_finalization` and
  :meth:`FSDPModule.finalize_backward` (``async_op=True`` returns a
  :class:`GradientReductionHandle`);
* torch 2.11-2.14's ``torch.distributed.pipelining`` stage, which reaches into FSDP2's private
  state: ``fully_shard.state(m)._state_ctx.all_states[i]._fsdp_param_groups[j].post_backward()``,
  then ``fully_shard.state(m)._root_post_backward_final_callback()``.
  :func:`register_torch_state` gives every module passed to our ``fully_shard`` such a state
  (:class:`TorchStateView`), so torch's own ``fully_shard.state`` finds it.

Both come down to the same two steps: :func:`settle` each group (reduce what the no-sync
backwards accumulated, now that sync is on; reshard if ``reshard_after_backward``), then the
root's end of backward (every reduction lands in ``.grad``; every group goes idle).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

from ...core.errors import StateError

if TYPE_CHECKING:
    from ..engine.group import ParamGroup
    from .state import FSDPState

__all__ = [
    "Finalization",
    "GradientReductionHandle",
    "TorchStateView",
    "finalization_of",
    "register_torch_state",
    "settle",
    "torch_state",
]

# torch's own fully_shard, captured when this module loads (before any use_as_fsdp2 swap):
# its ``state(module)`` is what torch's pipelining stage calls.
_TORCH_FULLY_SHARD: Any = torch_fsdp.fully_shard
_HandleBase: Any = getattr(torch_fsdp, "GradientReductionHandle", object)


def settle(group: ParamGroup) -> None:
    """FSDP2's ``FSDPParamGroup.post_backward()`` called outside autograd: reduce the
    gradients the group accumulated while sync was off (if sync is on now) and reshard (if
    ``reshard_after_backward``). Safe on a group that got no gradient (nothing to reduce)."""
    if group.tree is None:
        group.post_backward([None] * len(group.sharded_params))
    else:  # the tree reduces once per step by itself
        group.settle()


def groups_under(root: FSDPState) -> list[ParamGroup]:
    """The groups of ``root``'s states, each once (a list-form group has several modules)."""
    out: list[ParamGroup] = []
    for s in root.all_states:
        g = s.group
        if g is not None and all(g is not o for o in out):
            out.append(g)
    return out


def end_backward(root: FSDPState, *, is_last_backward: bool) -> None:
    """The root's end of backward, as its autograd callback runs it, with ``is_last_backward``
    (``True``: every reduction in flight lands in ``.grad``)."""
    before = root.is_last_backward
    root.is_last_backward = is_last_backward
    try:
        root._final_callback()
    finally:
        root.is_last_backward = before


class Finalization:
    """A root module's manual-finalization settings (FSDP2 2.15's
    ``set_manual_backward_finalization``), kept on the module that was told.

    Attributes:
        manual: whether the caller finalizes backward (:meth:`FSDPModule.finalize_backward`).
        pending: the handle of an asynchronous finalization not yet waited for.
        epoch: bumped by ``reset_iter_state``, which invalidates a pending handle.
    """

    def __init__(self) -> None:
        self.manual = False
        self.pending: GradientReductionHandle | None = None
        self.epoch = 0


def finalization_of(module: nn.Module) -> Finalization:
    """``module``'s :class:`Finalization` (made on first use)."""
    fin = module.__dict__.get("_ffsdp_finalization")
    if fin is None:
        fin = module.__dict__["_ffsdp_finalization"] = Finalization()
    return fin


class GradientReductionHandle(_HandleBase):
    """Handle of :meth:`FSDPModule.finalize_backward` with ``async_op=True`` (FSDP2 2.15's).

    The gradient reductions are in flight; :meth:`wait` lands them in ``.grad`` and ends the
    backward iteration. Call it before reading gradients or running the module again. (On
    torch 2.15 this subclasses ``torch.distributed.fsdp.GradientReductionHandle``.)
    """

    def __init__(self, root: FSDPState | None, fin: Finalization | None) -> None:
        self._root = root
        self._fin = fin
        self._epoch = None if fin is None else fin.epoch

    def wait(self) -> None:
        """Wait for the gradient reductions and finish the backward iteration.

        Raises:
            StateError: ``reset_iter_state`` ran since the finalization started (the
                reductions were dropped; a ``RuntimeError``, as FSDP2's).
        """
        root, fin = self._root, self._fin
        if root is None or fin is None:
            return
        self._root = self._fin = None
        if fin.epoch != self._epoch:
            raise StateError(
                "This gradient reduction handle was invalidated by reset_iter_state(); the "
                "reductions it stood for were dropped"
            )
        fin.pending = None
        end_backward(root, is_last_backward=True)


def finalize(module: nn.Module, *, async_op: bool) -> GradientReductionHandle | None:
    """:meth:`FSDPModule.finalize_backward` (FSDP2 2.15's semantics)."""
    state: FSDPState = module._ffsdp_state  # type: ignore[assignment]
    root = state.root
    if root is None:  # before the first forward: nothing to finish
        return GradientReductionHandle(None, None) if async_op else None
    fin = finalization_of(module)
    if fin.pending is not None:
        raise StateError(
            "The previous gradient reduction must be waited on before finalizing backward "
            "again (call wait() on the handle finalize_backward(async_op=True) returned)"
        )
    if root is not state:
        raise StateError(
            f"finalize_backward must be called on the root FSDP module ({root.name!r}), "
            f"not on {state.name!r}"
        )
    if not fin.manual:
        raise StateError(
            "finalize_backward requires manual backward finalization. Call "
            "set_manual_backward_finalization(True) on the root before forward"
        )
    if root.callback_queued or torch._C._current_graph_task_id() != -1:
        raise StateError("finalize_backward must be called after backward completes")
    for g in reversed(groups_under(root)):
        settle(g)
    handle = GradientReductionHandle(root, fin)
    if not async_op:
        handle.wait()
        return None
    fin.pending = handle
    return handle


class _GroupView:
    """FSDP2's ``FSDPParamGroup`` as torch 2.11-2.14's pipelining stage uses it."""

    def __init__(self, group: ParamGroup) -> None:
        self._group = group

    def post_backward(self, *unused: Any) -> None:
        """Reduce the gradients accumulated without sync (if sync is on) and reshard."""
        del unused
        settle(self._group)


class _StateView:
    """One FSDP state's groups, as ``_state_ctx.all_states`` lists them."""

    def __init__(self, groups: list[ParamGroup]) -> None:
        self._fsdp_param_groups = [_GroupView(g) for g in groups]

    @property
    def _fsdp_param_group(self) -> _GroupView | None:
        """The state's one group, or ``None``: torch 2.11's ``FSDPState`` held a single
        optional group, and its pipelining stage reads it by this name."""
        return self._fsdp_param_groups[0] if self._fsdp_param_groups else None


class _StateContext:
    """FSDP2's ``FSDPStateContext``: the states under one root."""

    def __init__(self, root: FSDPState | None, state: FSDPState) -> None:
        self.all_states: list[_StateView] = []
        seen: list[ParamGroup] = []
        for s in root.all_states if root is not None else [state]:
            mine = [] if s.group is None or any(s.group is o for o in seen) else [s.group]
            seen += mine
            self.all_states.append(_StateView(mine))
        self.is_last_backward = (root or state).is_last_backward


class TorchStateView:
    """What ``torch.distributed.fsdp.fully_shard.state(module)`` returns for a module passed
    to our ``fully_shard``: the parts of FSDP2's ``FSDPState`` that torch's own code (the
    pipelining stage of torch 2.11-2.14) reads, answered by our groups and root."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    @property
    def _state_ctx(self) -> _StateContext:
        state: FSDPState = self._module._ffsdp_state  # type: ignore[assignment]
        return _StateContext(state.root, state)

    @property
    def _fsdp_param_groups(self) -> list[_GroupView]:
        state: FSDPState = self._module._ffsdp_state  # type: ignore[assignment]
        return [] if state.group is None else [_GroupView(state.group)]

    def _root_post_backward_final_callback(self) -> None:
        """The root's end of backward (lands the reductions when it is the last backward)."""
        state: FSDPState = self._module._ffsdp_state  # type: ignore[assignment]
        if state.root is not None:
            state.root._final_callback()


def register_torch_state(module: nn.Module) -> None:
    """Make torch's ``fully_shard.state(module)`` return a :class:`TorchStateView` of
    ``module`` (torch keeps composable states in ``module.__dict__``, keyed by the undecorated
    function). Nothing happens where torch's layout differs (no ``__wrapped__``): then nothing
    in torch reads it that way either. Applying torch's own ``fully_shard`` to the module
    afterwards raises, as applying it twice does."""
    func = getattr(_TORCH_FULLY_SHARD, "__wrapped__", None)
    get_state = getattr(_TORCH_FULLY_SHARD, "state", None)
    if func is None or get_state is None:
        return
    # (``torch.distributed._composable.contract`` is also the name of a function there.)
    contract = importlib.import_module("torch.distributed._composable.contract")
    key = getattr(contract, "STATE_KEY", None)
    if key is None:
        return
    module.__dict__.setdefault(key, {})[func] = TorchStateView(module)


def torch_state(module: nn.Module) -> TorchStateView | None:
    """FSDP2's ``fully_shard.state(module)``: the :class:`TorchStateView` of a module passed to
    our ``fully_shard`` (``None`` for any other module). Also ``functional_fsdp.fully_shard.state``,
    for code that calls it on whatever ``fully_shard`` it imported."""
    get_state = getattr(_TORCH_FULLY_SHARD, "state", None)
    view = get_state(module) if get_state is not None else None
    return view if isinstance(view, TorchStateView) else None
