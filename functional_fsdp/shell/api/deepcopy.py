"""``copy.deepcopy`` of a sharded module (FSDP2 refuses; an EMA copy is the usual reason).

The generic deep copy would share the FSDP runtime with the original (hooks are closures over
the original state, functions are copied by reference) and cannot copy process groups. Instead:

1. the module tree is deep-copied with the FSDP runtime held out (the ``memo`` maps each FSDP
   state and each sharded parameter to ``None``);
2. each group is rebuilt from its record with a cloned sharded buffer: new ``DTensor``
   parameters view into it and are registered on the copied modules;
3. each copied FSDP module gets a new state and its own forward hooks (and re-wrapped
   ``register_fsdp_forward_method`` methods). Mesh and communicators are shared: they are
   process-group handles, not state.

The copy starts idle and un-rooted: its first forward makes it a root, as after ``fully_shard``.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch.nn as nn

from ...core.errors import StateError
from ..engine.group import ParamGroup, TrainingState
from .state import FSDPState, hooks_for, register_fsdp_forward_method

__all__ = ["deepcopy_fsdp_module"]

# memo key marking an FSDP deep copy in progress (nested FSDP modules then copy only their dicts)
_ACTIVE = "_functional_fsdp_deepcopy_states"


def deepcopy_fsdp_module(module: nn.Module, memo: dict[Any, Any]) -> nn.Module:
    """Deep-copy ``module`` (an ``FSDPModule``) into an independent sharded module.

    Args:
        module: the module to copy.
        memo: ``copy.deepcopy``'s memo.

    Returns:
        The copy: same structure and values, its own sharded buffers, parameters, groups, state
        and hooks. Gradients are copied too; optimizer state is not part of a module.

    Raises:
        StateError: a group is not idle (mid forward/backward, or inside summon_full_params).
    """
    top = _ACTIVE not in memo
    if top:
        states = [
            s for m in module.modules() if (s := getattr(m, "_ffsdp_state", None)) is not None
        ]
        groups = _unique_groups(states)
        for g in groups:
            if g.training_state is not TrainingState.IDLE:
                raise StateError(
                    f"cannot deepcopy {type(module).__name__}: the group of {g.name!r} is in "
                    f"{g.training_state.value}; copy it outside forward/backward and outside "
                    "summon_full_params"
                )
        memo[_ACTIVE] = states
        for s in states:
            memo[id(s)] = None
        for g in groups:
            for p in g.params:
                memo[id(p)] = None
    new = object.__new__(type(module))
    memo[id(module)] = new
    for k, v in module.__dict__.items():
        new.__dict__[k] = copy.deepcopy(v, memo)
    if top:
        try:
            _rebuild(states, groups, memo)
        finally:
            del memo[_ACTIVE]
    return new


def _unique_groups(states: list[FSDPState]) -> list[ParamGroup]:
    out: dict[int, ParamGroup] = {}
    for s in states:
        if s.group is not None:
            out.setdefault(id(s.group), s.group)
    return list(out.values())


def _copied_holders(
    hl: list[tuple[nn.Module, str]], name: str, memo: dict[Any, Any]
) -> list[tuple[nn.Module, str]]:
    row = []
    for m, n in hl:
        if id(m) not in memo:
            raise StateError(
                f"cannot deepcopy: parameter {n!r} of the group of {name!r} lives on a module "
                "outside the module being copied; copy the module passed to fully_shard"
            )
        row.append((memo[id(m)], n))
    return row


def _copy_group(g: ParamGroup, memo: dict[Any, Any]) -> ParamGroup:
    holders = [_copied_holders(hl, g.name, memo) for hl in g.holders]
    # A weight tied across groups: also on the copied modules of the groups that use it.
    lent = [_copied_holders(sp.lent, g.name, memo) for sp in g.sharded_params]
    return g.clone(holders, lent)


def _closes_over(fn: Any, obj: Any) -> bool:
    fn = getattr(fn, "__func__", fn)
    while hasattr(fn, "__wrapped__"):  # torch._dynamo.disable wraps the hooks
        fn = fn.__wrapped__
    cells = getattr(fn, "__closure__", None) or ()
    for c in cells:
        try:
            if c.cell_contents is obj:
                return True
        except ValueError:  # empty cell
            continue
    return False


def _rebuild(states: list[FSDPState], groups: list[ParamGroup], memo: dict[Any, Any]) -> None:
    new_groups = {id(g): _copy_group(g, memo) for g in groups}
    new_states: dict[int, FSDPState] = {}
    for s in states:
        mod = memo[id(s.module)]
        ns = FSDPState(
            mod, new_groups[id(s.group)] if s.group is not None else None, s.mp_policy, s.name
        )
        ns.user_reshard_after_forward = s.user_reshard_after_forward
        ns.is_last_backward = s.is_last_backward
        ns.bucket_bytes = s.bucket_bytes  # the copy derives its own schedule on first use
        for use in s.tied:  # weights tied across groups: the copied owner lends them
            owner = new_groups.get(id(use.owner))
            if owner is None:
                raise StateError(
                    f"cannot deepcopy: {use.name} is tied to {use.param.fqn!r} of "
                    f"{use.owner.name} (a weight tied across groups), whose group is outside "
                    "the module being copied; copy a module that contains both"
                )
            ns.tied.append(use.copied(owner, _copied_holders(use.holders, s.name, memo)))
        mod.__dict__["_ffsdp_state"] = ns
        new_states[id(s)] = ns
    for s in states:
        ns = new_states[id(s)]
        for attr in ("explicit_forward_prefetch", "explicit_backward_prefetch"):
            targets = getattr(s, attr)
            if targets is not None:
                setattr(ns, attr, [new_states[id(t)] for t in targets if id(t) in new_states])
        mod = ns.module
        pre, post, exit_ = hooks_for(ns)
        for key, hook in list(mod._forward_pre_hooks.items()):
            if _closes_over(hook, s):
                mod._forward_pre_hooks[key] = pre
        for key, hook in list(mod._forward_hooks.items()):
            if _closes_over(hook, s):
                always = key in mod._forward_hooks_always_called
                mod._forward_hooks[key] = exit_ if always else post
        for name, value in list(mod.__dict__.items()):
            if isinstance(value, types.MethodType) and _closes_over(value, s):
                del mod.__dict__[name]
                register_fsdp_forward_method(mod, name)
