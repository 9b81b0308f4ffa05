"""Bridges between a :class:`~.train.TrainState` and the module API.

- Checkpoints: :func:`to_state_dict` / :func:`from_state_dict` (``torch.distributed.checkpoint``).
- Torch optimizers: :func:`from_torch_optimizer` builds a state from a ``fully_shard`` model and
  a ``torch.optim.AdamW`` / ``SGD`` (or its state dict), so an FSDP2-style checkpoint (model +
  torch optimizer state) resumes on the functional path; :func:`to_torch_optimizer` goes back.
- Full parameters: :func:`summon_state` is ``summon_full_params`` on a state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import attrs
import optree
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..core._tree import NAMESPACE
from ..core.errors import ArgumentTypeError, OptimizerStateError
from ..shell import summon_full_params
from .hyperparams import InjectHyperparamsState
from .optim import AdamWState, Optimizer, SGDState
from .step import (
    TrainState,
    _check_model,
    _copy,
    _local,
    _trainable,
    apply_to_module,
    check_not_donated,
    init,
)
from .transforms import GradientTransformation, ScaleByScheduleState

__all__ = [
    "SummonedState",
    "from_state_dict",
    "from_torch_optimizer",
    "summon_state",
    "to_state_dict",
    "to_torch_optimizer",
]


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
    check_not_donated(state, "to_state_dict")
    tree: Any = state
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return {"/".join(str(k) for k in path): leaf for path, leaf in zip(paths, leaves)}


def from_state_dict(template: TrainState, state_dict: dict[str, Any]) -> TrainState:
    """A :class:`TrainState` shaped like ``template`` with the tensors of ``state_dict``.

    Args:
        template: a state with the right structure (e.g. ``init(model, opt)``).
        state_dict: ``{key: tensor}`` as :func:`to_state_dict` names them (e.g. after
            ``dcp.load``). For a checkpoint of a module and a torch optimizer (FSDP2 style),
            load them into the module and the torch optimizer and use
            :func:`from_torch_optimizer` instead.
    """
    tree: Any = template
    paths, _, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    keys = ["/".join(str(k) for k in path) for path in paths]
    missing = [k for k in keys if k not in state_dict]
    if missing:
        hint = ""
        if any(str(k).startswith(("model", "optim", "state")) for k in state_dict):
            hint = (
                "; this looks like a module/torch-optimizer checkpoint: load it into the model "
                "and a torch.optim optimizer, then state = from_torch_optimizer(model, opt, ...)"
            )
        raise KeyError(f"from_state_dict: missing keys {missing[:5]} (of {len(missing)}){hint}")
    out: Any = optree.tree_unflatten(spec, [state_dict[k] for k in keys])
    return out


# ------------------------------------------------------------------------ torch optimizers

# torch's per-parameter state keys for each functional optimizer state (read-only).
_TORCH_KEYS = MappingProxyType(
    {AdamWState: ("exp_avg", "exp_avg_sq"), SGDState: ("momentum_buffer",)}
)


def _by_name(model: nn.Module, torch_opt: Any) -> dict[str, dict[str, Any]]:
    """``{fqn: per-parameter torch state}`` from a torch optimizer or its state dict."""
    if isinstance(torch_opt, torch.optim.Optimizer):
        names = {id(p): n for n, p in model.named_parameters()}
        out = {}
        for group in torch_opt.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise OptimizerStateError(
                        "from_torch_optimizer: the optimizer holds a parameter not in model"
                    )
                out[names[id(p)]] = torch_opt.state.get(p, {})
        return out
    if not isinstance(torch_opt, dict) or "state" not in torch_opt:
        raise ArgumentTypeError(
            "from_torch_optimizer: pass a torch.optim.Optimizer over model.parameters() or its "
            f"state_dict(), got {type(torch_opt).__name__}"
        )
    ids = [i for g in torch_opt.get("param_groups", []) for i in g["params"]]
    if all(isinstance(i, str) for i in ids):  # get_optimizer_state_dict: keyed by fqn
        return {i: torch_opt["state"].get(i, {}) for i in ids}
    order = [n for n, p in model.named_parameters() if p.requires_grad]
    if len(ids) != len(order):
        raise OptimizerStateError(
            f"from_torch_optimizer: the state dict has {len(ids)} parameters, the model "
            f"{len(order)} trainable ones; pass the torch optimizer itself instead"
        )
    return {order[k]: torch_opt["state"].get(i, {}) for k, i in enumerate(ids)}


def _torch_nodes(opt_state: Any) -> list[Any]:
    """The ``AdamWState`` / ``SGDState`` nodes of an optimizer state (what torch's maps to)."""
    leaves = optree.tree_leaves(
        opt_state, is_leaf=lambda n: type(n) in _TORCH_KEYS, none_is_leaf=True
    )
    return [n for n in leaves if type(n) in _TORCH_KEYS]


def _steps_taken(per_name: dict[str, dict[str, Any]], step: int | None) -> int:
    """The torch optimizer's step count: its recorded ``step`` (AdamW), else ``step``.

    torch's SGD records no count, and a count of 0 would make the functional ``sgd`` take
    its next step as the first (overwriting the loaded momentum with the gradient) and a
    schedule restart; so a momentum buffer without ``step=`` is refused."""
    recorded = {float(s["step"]) for s in per_name.values() if "step" in s}
    if len(recorded) > 1:
        raise OptimizerStateError(
            f"from_torch_optimizer: parameters have different step counts {recorded}"
        )
    if recorded:
        taken = int(recorded.pop())
        if step is not None and step != taken:
            raise OptimizerStateError(
                f"from_torch_optimizer: step={step}, but the torch optimizer recorded {taken}"
            )
        return taken
    if step is not None:
        return int(step)
    if any("momentum_buffer" in s for s in per_name.values()):
        raise OptimizerStateError(
            "from_torch_optimizer: torch.optim.SGD records no step count; pass step=<the "
            "steps it took> (with 0 the functional sgd would take its next step as the first, "
            "replacing the loaded momentum, and a schedule would restart)"
        )
    return 0


def _fill(node: Any, per_name: dict[str, dict[str, Any]], names: list[str], taken: int) -> Any:
    keys = _TORCH_KEYS.get(type(node))
    if keys is None:
        return node
    trees = [node.mu, node.nu] if isinstance(node, AdamWState) else [node.momentum]
    filled = []
    for key, tree in zip(keys, trees):
        if tree is None or not any(key in per_name.get(n, {}) for n in names):
            filled.append(tree)
            continue
        filled.append({n: _copy(per_name[n][key]) if key in per_name[n] else tree[n] for n in tree})
    return type(node)(torch.tensor(float(taken)), *filled)


def _count_steps(node: Any, taken: int) -> Any:
    """The other counters of the optimizer's state at ``taken`` (schedules continue)."""
    if isinstance(node, InjectHyperparamsState):
        return attrs.evolve(
            node,
            count=torch.tensor(taken, dtype=node.count.dtype),
            inner_state=_map_counts(node.inner_state, taken),
        )
    if isinstance(node, ScaleByScheduleState):
        return attrs.evolve(node, count=torch.tensor(taken, dtype=node.count.dtype))
    return node


def _map_counts(tree: Any, taken: int) -> Any:
    return optree.tree_map(
        lambda n: _count_steps(n, taken),
        tree,
        is_leaf=lambda n: isinstance(n, (InjectHyperparamsState, ScaleByScheduleState)),
        none_is_leaf=True,
    )


def from_torch_optimizer(
    model: nn.Module,
    torch_optimizer: torch.optim.Optimizer | dict[str, Any],
    optimizer: Optimizer | GradientTransformation,
    *,
    step: int | None = None,
) -> TrainState:
    """A :class:`~.train.TrainState` from a ``fully_shard`` model and a torch optimizer's state.

    The parameters are copied from the module; the moments (``exp_avg``, ``exp_avg_sq``, or
    SGD's ``momentum_buffer``) and the step count from the torch optimizer, into the
    ``AdamWState`` / ``SGDState`` inside ``optimizer`` 's state (also inside a ``chain`` or
    ``inject_hyperparams``). Continuing with ``adamw`` equals continuing with
    ``torch.optim.AdamW`` bit for bit, and ``sgd`` with ``torch.optim.SGD``. Every step counter
    of the state is set to the steps taken (``inject_hyperparams`` and ``scale_by_schedule``
    schedules continue where torch's left off). Hyper-parameters are ``optimizer`` 's, not the
    torch optimizer's param groups'.

    Args:
        model: the root module sharded with ``fully_shard``.
        torch_optimizer: a ``torch.optim.AdamW``/``SGD`` over ``model.parameters()`` (e.g.
            after loading an FSDP2 checkpoint into it), or its ``state_dict()`` (keyed by index
            in ``model.parameters()`` order, or by fqn as ``get_optimizer_state_dict`` gives).
        optimizer: the functional optimizer to continue with (its state must hold an
            ``AdamWState`` or ``SGDState`` when the torch optimizer has moments to carry over).
        step: the steps the torch optimizer took, where it records none (``torch.optim.SGD``).

    Returns:
        A new state (copies; the module and the torch optimizer are unchanged).

    Raises:
        OptimizerStateError: ``step`` missing for an SGD with momentum buffers, or different
            from the count torch recorded; or the torch optimizer has moments and
            ``optimizer`` has no ``adamw``/``sgd`` state to take them (an optax-style chain
            such as ``scale_by_adam``: they would be dropped silently).
    """
    state = init(model, optimizer)
    per_name = _by_name(model, torch_optimizer)
    names = _trainable(model)
    taken = _steps_taken(per_name, step)
    holders = _torch_nodes(state.opt_state)
    moments = {k for s in per_name.values() for k in s if k != "step"}
    if moments and not holders:
        raise OptimizerStateError(
            f"from_torch_optimizer: the torch optimizer has {sorted(moments)}, but the "
            "functional optimizer's state has no AdamWState or SGDState to take them (they "
            "would be dropped and training would restart from fresh moments). Continue with "
            "functional_fsdp.functional.adamw or sgd"
        )
    opt_state = optree.tree_map(
        lambda node: _fill(node, per_name, names, taken),
        state.opt_state,
        is_leaf=lambda n: type(n) in _TORCH_KEYS,
        none_is_leaf=True,
    )
    opt_state = _map_counts(opt_state, taken)
    return attrs.evolve(state, opt_state=opt_state, step=torch.tensor(taken, dtype=torch.int64))


def to_torch_optimizer(
    state: TrainState, model: nn.Module, torch_optimizer: torch.optim.Optimizer
) -> None:
    """Write ``state`` into ``model`` and ``torch_optimizer`` (``AdamW`` or ``SGD``), in place.

    The parameters go into the module's shards (:func:`~.train.apply_to_module`), the moments
    and step count into the torch optimizer's state (through ``load_state_dict``), so
    training continues with the module API as it would have functionally.

    Args:
        state: the state (with an ``AdamWState`` or ``SGDState`` in its optimizer state).
        model: the root module the state belongs to.
        torch_optimizer: a torch optimizer over ``model.parameters()``.
    """
    _check_model(model, "to_torch_optimizer")
    apply_to_module(state, model)
    nodes = _torch_nodes(state.opt_state)
    if len(nodes) != 1:
        raise OptimizerStateError(
            f"to_torch_optimizer: the state needs exactly one AdamWState or SGDState, found "
            f"{len(nodes)}"
        )
    node = nodes[0]
    keys = _TORCH_KEYS[type(node)]
    trees = [node.mu, node.nu] if isinstance(node, AdamWState) else [node.momentum]
    names = {id(p): n for n, p in model.named_parameters()}
    sd = torch_optimizer.state_dict()
    params = [p for g in torch_optimizer.param_groups for p in g["params"]]
    sd["state"] = {}
    for i, p in enumerate(params):
        n = names[id(p)]
        entry: dict[str, Any] = {"step": node.count.detach().clone()}
        for key, tree in zip(keys, trees):
            if tree is not None:
                entry[key] = _copy(tree[n])
        sd["state"][i] = entry
    torch_optimizer.load_state_dict(sd)


# ------------------------------------------------------------------------- full parameters


class SummonedState:
    """What :func:`summon_state` yields.

    Attributes:
        params: ``{fqn: full tensor}`` inside the ``with`` block: edit them in place (under
            ``torch.no_grad()``) or replace entries with tensors of the same shape.
    """

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self._state: TrainState | None = None

    @property
    def state(self) -> TrainState:
        """The new state with the edited parameters (after the ``with`` block)."""
        if self._state is None:
            raise RuntimeError("summon_state: the new state exists only after the with block")
        return self._state


@contextlib.contextmanager
def summon_state(state: TrainState, model: nn.Module) -> Iterator[SummonedState]:
    """``summon_full_params`` on a state: edit its full parameters, keep its optimizer state.

    Every rank must enter it (it all-gathers). The module is used as scratch space: the state's
    parameters are written into it, summoned, written back into the shards and read out into
    a new state; the module's own parameters are restored afterwards.

    Example:
        >>> with summon_state(state, model) as s:  # doctest: +SKIP
        ...     with torch.no_grad():
        ...         s.params["head.weight"].mul_(0.5)
        >>> state = s.state  # doctest: +SKIP

    Args:
        state: the state to edit (unchanged).
        model: the root module the state belongs to.

    Yields:
        A :class:`SummonedState`; ``.state`` is the new state after the block.
    """
    check_not_donated(state, "summon_state")
    _check_model(model, "summon_state")
    own = dict(model.named_parameters())
    backup = {n: _local(p).detach().clone() for n, p in own.items()}
    apply_to_module(state, model)
    try:
        with summon_full_params(model, writeback=True):
            full = dict(model.named_parameters())
            summoned = SummonedState(dict(full))
            yield summoned
            with torch.no_grad():
                for n, t in summoned.params.items():
                    if t is not full[n]:
                        full[n].copy_(t)
        new = {
            n: _copy(p) if isinstance(p, DTensor) else p.detach().clone()
            for n, p in model.named_parameters()
        }
        summoned._state = attrs.evolve(state, params=new)
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if backup[n].numel():
                    _local(p).copy_(backup[n])
