"""The optimizer step on local shards: elementwise optimizers skip ``DTensor`` dispatch.

A ``torch.optim`` step over sharded ``DTensor`` parameters dispatches each of its ops (a dozen
per parameter for AdamW) through ``DTensor``'s sharding propagation, though for an elementwise
optimizer every op is the same op on the local shards. On small groups that dispatch is most of
a step's CPU time: 33 groups of a tiny model spent 36 ms in AdamW against 7 ms for the same
parameters as plain tensors (``benchmarks/bench_overhead.py``).

So a global optimizer step pre-hook hands an allowlisted elementwise optimizer
(:data:`ELEMENTWISE`: SGD, Adam, AdamW, Adagrad, RMSprop, NAdam, RAdam, Adamax) the local
tensors of its ``DTensor`` parameters sharded by this package (:func:`own_step`; torch's FSDP2
parameters in the same process keep their path), their gradients' local tensors as ``.grad`` and its state's
local tensors, and the post-hook puts everything back: the same ``DTensor`` objects in
``param_groups`` and in ``state`` (so ``state_dict`` and checkpoints see exactly what FSDP2's
step leaves), state the step created wrapped with its parameter's spec. The results are
bit-identical (the ops are the ones ``DTensor`` would run on the shards) and
``ParamGroup.sharded_version`` sees the writes (it counts the local tensors' versions).

The step keeps the ``DTensor`` path (nothing is swapped) when another hook could see the swap or
a swap could change what runs: a per-optimizer step hook (unless marked :func:`swap_aware`, as
``keep_neighbour_copies``' are: they read state through :func:`param_state`), a global pre-hook
registered after this one (other than this package's own checks) or a global post-hook before
it, a closure, a ``differentiable`` group, ``torch.compile`` tracing; and a param group keeps it
when it holds a parameter with a gradient that cannot be swapped (not ours, 0-dim, or a
gradient whose placements differ from its parameter's): each group is swapped whole or not at
all. :func:`set_local_optimizer_step` turns it off.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    _global_optimizer_post_hooks,
    _global_optimizer_pre_hooks,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from .dtensors import shard_like

# Optimizers whose every op is elementwise on (parameter, gradient, state) of one parameter:
# running them on local shards is running DTensor's own per-shard ops. Exact types only (a
# subclass may add any op).
ELEMENTWISE: frozenset[type] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adamax,
    }
)

_HANDLES: list[Any] = []
_ENABLED = [True]
# Global pre-hooks of this package that may run after the swap (they read no parameter).
_SAFE_AFTER: set[Any] = set()
_SWAPPED = "_ffsdp_local_swap"
# Optimizers whose swap is in place: inside their step, or after a step that raised (torch runs
# no post-hook then).
_OPEN: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class _Swap:
    """One step's swap: per swapped parameter, its ``DTensor``, local tensor, the state values
    it replaced (key -> ``DTensor``), whether it had state, and its ``DTensor`` gradient."""

    __slots__ = ("groups", "rows")

    def __init__(self) -> None:
        self.groups: list[tuple[dict, list]] = []  # (param group, its original params list)
        self.rows: list[tuple[DTensor, torch.Tensor, dict, bool, torch.Tensor]] = []


def set_local_optimizer_step(enabled: bool) -> None:
    """Run allowlisted elementwise optimizers on the local shards of ``DTensor`` parameters
    (``True``, the default: bit-identical results, less CPU per step) or through ``DTensor``
    dispatch as FSDP2 does (``False``)."""
    _ENABLED[0] = bool(enabled)


def install(*safe_after: Any) -> None:
    """Register the swap's global step hooks once per process (the first ``fully_shard``);
    ``safe_after``: this package's global pre-hooks that may run after the swap."""
    _SAFE_AFTER.update(safe_after)
    if not _HANDLES:
        _HANDLES.append(register_optimizer_step_pre_hook(_to_local))
        _HANDLES.append(register_optimizer_step_post_hook(_to_dtensor))


def swap_aware(hook: Any) -> Any:
    """Mark a per-optimizer step hook that reads the optimizer's state through
    :func:`param_state` (so the step may still run on local shards around it)."""
    hook._ffsdp_swap_aware = True
    return hook


def param_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """``opt.state`` of parameter ``p`` (``{}`` if none), also inside a step on local shards
    (where the state is keyed by ``p``'s local tensor and holds local tensors)."""
    st = opt.state
    if p in st:
        return st[p]
    if isinstance(p, DTensor) and _SWAPPED in opt.__dict__:
        return st.get(p._local_tensor, {})
    return {}


def _aware(hooks: Any) -> bool:
    return all(getattr(getattr(h, "__func__", h), "_ffsdp_swap_aware", False) for h in hooks)


def _hooks_allow(opt: torch.optim.Optimizer) -> bool:
    if not (
        _aware(opt._optimizer_step_pre_hooks.values())
        and _aware(opt._optimizer_step_post_hooks.values())
    ):
        return False
    pre = list(_global_optimizer_pre_hooks.values())
    after = pre[pre.index(_to_local) + 1 :] if _to_local in pre else [None]
    post = list(_global_optimizer_post_hooks.values())
    return all(h in _SAFE_AFTER for h in after) and bool(post) and post[0] is _to_dtensor


def _applies(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> bool:
    return (
        _ENABLED[0]
        and type(opt) in ELEMENTWISE
        and len(args) <= 1
        and (not kwargs or kwargs.get("closure") is None)
        and not torch.compiler.is_compiling()
        and not any(g.get("differentiable") for g in opt.param_groups)
        and _hooks_allow(opt)
    )


def own_step(p: Any) -> Any:
    """Mark ``p`` (a sharded parameter of this package) for the local-shard step; parameters of
    other code (torch's own FSDP2, plain tensor parallelism) keep the ``DTensor`` path."""
    p._ffsdp_local_step = True
    return p


def _local_pair(p: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(local, local gradient)`` of one of our ``DTensor`` parameters whose gradient shares
    its layout."""
    if not getattr(p, "_ffsdp_local_step", False) or not isinstance(p, DTensor) or p.dim() == 0:
        return None
    g = p.grad
    if not isinstance(g, DTensor):
        return None
    if g._spec is not p._spec and (
        g._spec.placements != p._spec.placements or g._spec.mesh != p._spec.mesh
    ):
        return None
    return p._local_tensor, g._local_tensor


def _to_local(opt: torch.optim.Optimizer, args: Any = (), kwargs: Any = None) -> None:
    """Pre-hook: swap the optimizer's ``DTensor`` parameters and state for local tensors."""
    _restore(opt)  # a step that raised left its swap behind
    if not _applies(opt, args, kwargs):
        return
    swap, state = _Swap(), opt.state
    for group in opt.param_groups:
        params = group["params"]
        pairs = [_local_pair(p) for p in params]
        if not any(pairs) or any(q is None and p.grad is not None for p, q in zip(params, pairs)):
            continue  # all or nothing per group: foreach ops refuse DTensors beside tensors
        new = list(params)
        for i, (p, pair) in enumerate(zip(params, pairs)):
            if pair is None:
                continue
            local, lgrad = pair
            local.grad = lgrad
            had = p in state
            st = state.pop(p) if had else {}
            replaced = {}
            for k, v in st.items():
                if isinstance(v, DTensor):
                    replaced[k] = v
                    st[k] = v._local_tensor
            state[local] = st
            new[i] = local
            swap.rows.append((p, local, replaced, had, p.grad))
        swap.groups.append((group, params))
        group["params"] = new
    if swap.rows:
        setattr(opt, _SWAPPED, swap)
        _OPEN.add(opt)


def _to_dtensor(opt: torch.optim.Optimizer, args: Any = (), kwargs: Any = None) -> None:
    """Post-hook: put the ``DTensor`` parameters and state back (see :func:`_restore`)."""
    del args, kwargs
    _restore(opt)


def restore_raised() -> None:
    """Undo the swap of every optimizer whose step raised (``reset_iter_state`` and the next
    forward call this): until then its ``param_groups`` and ``state`` hold local tensors, and
    a ``zero_grad()`` clears only their ``.grad``."""
    for opt in list(_OPEN):
        _restore(opt)


def _restore(opt: torch.optim.Optimizer) -> None:
    """Undo the swap: parameters, ``.grad`` and state as ``DTensor``; state the step created on
    a local shard (a first step's moments) wrapped with its parameter's spec. A gradient
    cleared while swapped (``zero_grad()`` after a step that raised) is cleared on the
    ``DTensor`` too."""
    swap: _Swap | None = opt.__dict__.pop(_SWAPPED, None)
    _OPEN.discard(opt)
    if swap is None:
        return
    for group, params in swap.groups:
        group["params"] = params
    state = opt.state
    for p, local, replaced, had, grad in swap.rows:
        if local.grad is None and p.grad is grad:
            p.grad = None
        local.grad = None
        st = state.pop(local, {})
        for k, v in st.items():
            old = replaced.get(k)
            if old is not None and v is old._local_tensor:
                st[k] = old
            elif isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and _like(v, local):
                st[k] = shard_like(v, p)  # where the step made it (the host under offload)
        if st or had:
            state[p] = st


def _like(v: torch.Tensor, local: torch.Tensor) -> bool:
    """A state tensor laid out as its parameter's shard (a moment, not a scalar ``step``)."""
    return v.dim() > 0 and v.shape == local.shape
