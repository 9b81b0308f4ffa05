"""The functional training step: ``state, metrics = step(state, batch)`` over sharded parameters.

A :class:`TrainState` is an immutable record of the sharded parameters (``DTensor`` s, one shard
per rank), the optimizer state and the step count. :func:`make_train_step` builds a step from a
module sharded with ``fully_shard``, a loss function and a functional optimizer
(:mod:`functional_fsdp.functional.optim`). The step runs the module through
``torch.func.functional_call`` with the state's parameters, so the module's FSDP hooks gather
*those* parameters one group at a time (the functional path of the shell: per-group unshard,
reshard after forward, re-gather in backward, reduce-scatter of gradients), exactly the memory
schedule of the module API. It then clips, updates the shards with the optimizer and returns a
new state; the input state is never modified (unless ``donate=True``).

Example:
    >>> for block in model.blocks:  # doctest: +SKIP
    ...     fully_shard(block)
    >>> fully_shard(model)  # doctest: +SKIP
    >>> opt = adamw(1e-3)  # doctest: +SKIP
    >>> state = init(model, opt)  # doctest: +SKIP
    >>> step = make_train_step(model, lambda m, b: m.loss(*b), opt)  # doctest: +SKIP
    >>> for batch in data:  # doctest: +SKIP
    ...     state, metrics = step(state, batch)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import optree
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Shard

from .._tree import NAMESPACE, register, tree_map
from ..shell.api import FSDPModule
from ..shell.functional_path import DeferredReductions
from .optim import Optimizer

__all__ = [
    "LossFn",
    "TrainState",
    "TrainStep",
    "apply_to_module",
    "from_state_dict",
    "global_norm",
    "init",
    "make_train_step",
    "to_state_dict",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(module, batch) -> scalar loss``: called with the sharded module (running on the
state's parameters) and one (micro-)batch."""

TrainStep = Callable[["TrainState", Any], tuple["TrainState", dict[str, torch.Tensor]]]
"""``step(state, batch) -> (new_state, metrics)``."""


@register
@attrs.frozen(eq=False)
class TrainState:
    """Sharded parameters, optimizer state and step count: a pytree of ``DTensor`` s and tensors.

    Attributes:
        params: ``{fqn: DTensor}``, the module's parameters by ``named_parameters()`` name, each
            this rank's shard (same placement as the module's own parameters).
        opt_state: the optimizer's state over the trainable parameters (``DTensor`` leaves).
        step: number of steps taken (0-d int64 tensor).
    """

    params: dict[str, Any]
    opt_state: Any
    step: torch.Tensor


def _copy(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        return _wrap(t._local_tensor.detach().clone(), t)
    return t.detach().clone()


def _local(t: Any) -> Any:
    return t._local_tensor if isinstance(t, DTensor) else t


def _wrap(local: torch.Tensor, like: Any) -> Any:
    """``local`` as a tensor like ``like`` (a ``DTensor`` with ``like``'s spec, or plain)."""
    if not isinstance(like, DTensor):
        return local
    if local is like._local_tensor:
        return like
    return DTensor(local, like._spec, requires_grad=False)  # type: ignore[call-arg]


def _leaf(t: Any, requires_grad: bool) -> Any:
    """A new autograd leaf sharing ``t``'s data (a ``DTensor`` stays a ``DTensor``)."""
    if isinstance(t, DTensor):
        return DTensor(t._local_tensor, t._spec, requires_grad=requires_grad)  # type: ignore[call-arg]
    return t.detach().requires_grad_(requires_grad)


def _check_model(model: nn.Module, what: str) -> None:
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"{what} expects the root module passed to fully_shard (an FSDPModule), got "
            f"{type(model).__name__}; call fully_shard on each block and then on the model"
        )


def _trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def init(model: nn.Module, optimizer: Optimizer) -> TrainState:
    """A :class:`TrainState` holding a copy of ``model``'s sharded parameters.

    Args:
        model: the root module sharded with ``fully_shard`` (parameters are ``DTensor`` s).
        optimizer: a functional optimizer (:func:`~functional_fsdp.functional.adamw`, ...);
            its state covers the parameters with ``requires_grad``.

    Returns:
        A new state at step 0. Its tensors are copies: later changes to the module do not
        change the state (write a state back with :func:`apply_to_module`).
    """
    _check_model(model, "init")
    params = {n: _copy(p) for n, p in model.named_parameters()}
    trainable = {n: params[n] for n in _trainable(model)}
    return TrainState(params, optimizer.init(trainable), torch.zeros((), dtype=torch.int64))


def apply_to_module(state: TrainState, model: nn.Module) -> None:
    """Copy ``state``'s parameters into ``model``'s own (sharded) parameters, in place.

    The copy goes into the existing ``DTensor`` parameters' local shards, which are views into
    the shell's packed sharded buffers, so the module's next all-gather sees the new values.
    Use it to mix the module API (evaluation, ``state_dict``) with the functional API.

    Args:
        state: the state to write.
        model: the sharded root module the state was built from (``init``).
    """
    _check_model(model, "apply_to_module")
    own = dict(model.named_parameters())
    if set(own) != set(state.params):
        raise ValueError(
            f"apply_to_module: the state's parameters {sorted(set(state.params) ^ set(own))[:5]} "
            "do not match the module's; build the state with init(model, ...) from this module"
        )
    with torch.no_grad():
        dst = [_local(own[n]) for n in state.params]
        src = [_local(state.params[n]) for n in state.params]
        pairs = [(d, s) for d, s in zip(dst, src) if d.numel() > 0 and d is not s]
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


# --------------------------------------------------------------------------------- the step


class _LossCaller(nn.Module):
    """``forward(batch) = loss_fn(module, batch)``, so ``functional_call`` can run a loss."""

    def __init__(self, module: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.module, batch)


def _split(batch: Any, k: int) -> list[Any]:
    if k == 1:
        return [batch]
    leaves, spec = pytree.tree_flatten(batch)
    parts: list[Any] = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            if t.dim() == 0 or t.shape[0] % k != 0:
                raise ValueError(
                    f"grad_accum={k}: every tensor of the batch must split evenly on dim 0, got "
                    f"shape {tuple(t.shape)}"
                )
            parts.append(t.chunk(k, dim=0))
        else:
            parts.append([t] * k)
    return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(k)]


def _shard_groups(model: nn.Module, names: list[str]) -> list[tuple[Any, list[int]]]:
    """Process groups to sum squared gradient norms over: the shard dim of each mesh."""
    params = dict(model.named_parameters())
    groups: list[tuple[Any, list[int]]] = []
    keys: list[tuple[Any, int]] = []
    for i, n in enumerate(names):
        p = params[n]
        if not isinstance(p, DTensor):
            key: tuple[Any, int] = (None, -1)
        else:
            dims = [d for d, pl in enumerate(p.placements) if isinstance(pl, Shard)]
            key = (p.device_mesh, dims[0] if dims else -1)
        if key not in keys:
            keys.append(key)
            mesh, dim = key
            pg = (
                mesh.get_group(dim)
                if (mesh is not None and dim >= 0 and mesh.size(dim) > 1)
                else None
            )
            groups.append((pg, []))
        groups[keys.index(key)][1].append(i)
    return groups


def global_norm(grads: list[torch.Tensor], groups: list[tuple[Any, list[int]]]) -> torch.Tensor:
    """2-norm of sharded gradients across ranks: local sums of squares, all-reduced per group."""
    total = torch.zeros((), dtype=torch.float32)
    if not grads:
        return total
    norms = torch._foreach_norm(grads)
    for pg, idx in groups:
        sq = torch.stack([norms[i].float() for i in idx]).square().sum()
        if pg is not None:
            dist.all_reduce(sq, group=pg)
        total = total + sq
    return total.sqrt()


def make_train_step(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer,
    *,
    grad_accum: int = 1,
    max_grad_norm: float | None = None,
    donate: bool = False,
) -> TrainStep:
    """Build ``step(state, batch) -> (state, metrics)`` for a module sharded with ``fully_shard``.

    Each step, for every micro-batch: ``loss_fn(model, micro_batch)`` runs through
    ``torch.func.functional_call`` on the state's parameters (the FSDP hooks unshard one group at
    a time, reshard after forward, re-gather in backward), and ``torch.autograd.grad`` returns
    the reduce-scattered (averaged over ranks) sharded gradients. Then: gradients summed over
    micro-batches (each loss divided by ``grad_accum``), the global gradient norm computed
    across shards, optional clipping, and the optimizer update on the local shards.

    Args:
        model: the root module sharded with ``fully_shard``; it provides the computation, its
            own parameters are not read or written by the step.
        loss_fn: ``loss_fn(module, batch) -> scalar`` (mean over the batch).
        optimizer: a functional optimizer (:mod:`functional_fsdp.functional.optim`).
        grad_accum: split every tensor of ``batch`` on dim 0 into this many micro-batches
            (must divide evenly) and accumulate their gradients before one update.
        max_grad_norm: clip gradients by global norm as ``torch.nn.utils.clip_grad_norm_``
            does (``None``: no clipping).
        donate: like JAX's ``donate_argnums``: the step may reuse the input state's buffers
            (the optimizer updates parameters and moments in place), saving one copy of the
            parameters and optimizer state per step. The input state must not be used after
            the call (its tensors hold the new values or garbage). Default ``False``: the input
            state is left unchanged.

    Returns:
        The step function. ``metrics`` holds ``"loss"`` (this rank's mean loss over the
        micro-batches) and ``"grad_norm"`` (the global gradient norm before clipping), both
        0-d tensors.
    """
    _check_model(model, "make_train_step")
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a positive int, got {grad_accum!r}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
    names = [n for n, _ in model.named_parameters()]
    trainable = _trainable(model)
    trainable_set = set(trainable)
    groups = _shard_groups(model, trainable)
    caller = _LossCaller(model, loss_fn)
    prefix = "module."

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, torch.Tensor]]:
        if list(state.params) != names:
            raise ValueError(
                "step: the state's parameters do not match the model's; build the state with "
                "init(model, optimizer) from the model this step was made for"
            )
        subs = {n: _leaf(state.params[n], n in trainable_set) for n in names}
        inputs = [subs[n] for n in trainable]
        feed = {prefix + n: t for n, t in subs.items()}
        # Reductions overlap the rest of backward; their results are read after wait().
        deferred = DeferredReductions()
        deferred.tag(inputs)
        acc: list[torch.Tensor] | None = None
        loss_sum = torch.zeros(())
        for micro in _split(batch, grad_accum):
            loss = torch.func.functional_call(caller, feed, (micro,))
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            loss_sum = loss_sum + loss.detach().float()
            scaled = loss / grad_accum if grad_accum > 1 else loss
            try:
                grads = torch.autograd.grad(scaled, inputs, allow_unused=True)
            finally:
                deferred.wait()
            del loss, scaled  # drop the graph (and the packed shards its gathers kept) now
            locals_ = [
                _local(g) if g is not None else torch.zeros_like(_local(x))
                for g, x in zip(grads, inputs)
            ]
            if acc is None:
                acc = locals_
            else:
                torch._foreach_add_(acc, locals_)
        assert acc is not None
        del subs, inputs, feed
        norm = global_norm(acc, groups)
        if max_grad_norm is not None and acc:
            coef = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(acc, coef)
        params_local = {n: _local(state.params[n]) for n in trainable}
        opt_local = tree_map(_local, state.opt_state)
        new_local, new_opt_local = optimizer.update(
            dict(zip(trainable, acc)), opt_local, params_local, donate=donate
        )
        new_params = dict(state.params)
        for n in trainable:
            new_params[n] = _wrap(new_local[n], state.params[n])
        new_opt = optree.tree_map(
            lambda new, old: _wrap(new, old) if isinstance(old, torch.Tensor) else new,
            new_opt_local,
            state.opt_state,
            namespace=NAMESPACE,
        )
        new_step = state.step.add_(1) if donate else state.step + 1
        metrics = {"loss": loss_sum / grad_accum, "grad_norm": norm}
        return TrainState(new_params, new_opt, new_step), metrics

    return step


# --------------------------------------------------------------------------- checkpointing


def to_state_dict(state: TrainState) -> dict[str, Any]:
    """A flat ``{key: tensor}`` view of ``state`` for ``torch.distributed.checkpoint``.

    Keys are the pytree paths joined by ``/`` (``"params/blocks.0.fc.weight"``,
    ``"opt_state/mu/..."``, ``"step"``); values are the state's own tensors (no copy), so
    ``dcp.load`` into this dict writes into them.

    Example:
        >>> import torch.distributed.checkpoint as dcp  # doctest: +SKIP
        >>> dcp.save(to_state_dict(state), checkpoint_id=path)  # doctest: +SKIP
        >>> template = init(model, opt)  # doctest: +SKIP
        >>> sd = to_state_dict(template)  # doctest: +SKIP
        >>> dcp.load(sd, checkpoint_id=path)  # doctest: +SKIP
        >>> state = from_state_dict(template, sd)  # doctest: +SKIP
    """
    tree: Any = state
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return {"/".join(str(k) for k in path): leaf for path, leaf in zip(paths, leaves)}


def from_state_dict(template: TrainState, state_dict: dict[str, Any]) -> TrainState:
    """A :class:`TrainState` shaped like ``template`` with the tensors of ``state_dict``.

    Args:
        template: a state with the right structure (e.g. ``init(model, opt)``).
        state_dict: ``{key: tensor}`` as :func:`to_state_dict` names them (e.g. after
            ``dcp.load``).
    """
    tree: Any = template
    paths, _, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    keys = ["/".join(str(k) for k in path) for path in paths]
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise KeyError(f"from_state_dict: missing keys {missing[:5]} (of {len(missing)})")
    out: Any = optree.tree_unflatten(spec, [state_dict[k] for k in keys])
    return out
