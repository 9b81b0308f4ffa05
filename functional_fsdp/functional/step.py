"""The functional training step: ``state, metrics = step(state, batch)`` over sharded parameters.

A :class:`TrainState` is an immutable record of the sharded parameters (``DTensor`` s, one shard
per rank), the optimizer state and the step count. :func:`make_train_step` builds a step from a
module sharded with ``fully_shard``, a loss function and a functional optimizer
(:mod:`functional_fsdp.functional.optim`, :mod:`functional_fsdp.functional.transforms`). The
step runs the module through ``torch.func.functional_call`` with the state's parameters, so the
module's FSDP hooks gather *those* parameters one group at a time (the functional path of the
shell: per-group unshard, reshard after forward, re-gather in backward, reduce-scatter of
gradients), exactly the memory schedule of the module API. It then takes the global gradient
norm and mean loss (one all-reduce), runs the optimizer on the shards and returns a new state;
the input state is never modified (unless ``donate=True``).

Example:
    >>> for block in model.blocks:  # doctest: +SKIP
    ...     fully_shard(block)
    >>> fully_shard(model)  # doctest: +SKIP
    >>> opt = chain(clip_by_global_norm(1.0), adamw(1e-3))  # doctest: +SKIP
    >>> state = init(model, opt)  # doctest: +SKIP
    >>> step = make_train_step(model, lambda m, b: m.loss(*b), opt)  # doctest: +SKIP
    >>> for batch in data:  # doctest: +SKIP
    ...     state, metrics = step(state, batch)
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import optree
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor

from ..core._tree import NAMESPACE, tree_map
from ..core.errors import (
    ArgumentTypeError,
    DonatedStateError,
    HyperparameterError,
    OptimizerStateError,
    ReproducibilityError,
)
from ..core.reproducible import ReproduciblePolicy
from ..shell import FSDPModule, wrap_like
from ._pytrees import register_everywhere
from ._stepping import Accumulated, accumulate_grads, dp_size
from .norms import StepNorms
from .optim import Optimizer
from .transforms import (
    EmptyState,
    GradientTransformation,
    as_optimizer,
    check_functional_optimizer,
    clip_by_global_norm,
)

__all__ = [
    "LossFn",
    "TrainState",
    "TrainStep",
    "apply_to_module",
    "check_not_donated",
    "init",
    "make_train_step",
    "with_params",
]

LossFn = Callable[[nn.Module, Any], Any]
"""``loss_fn(module, batch) -> loss`` (a scalar tensor), or ``-> (loss, aux)`` with
``has_aux=True``: called with the sharded module (running on the state's parameters) and one
(micro-)batch."""

TrainStep = Callable[["TrainState", Any], tuple["TrainState", dict[str, Any]]]
"""``step(state, batch) -> (new_state, metrics)``."""

_DONATED = -1  # the step counter of a state consumed by a donating step


@register_everywhere
@attrs.frozen(eq=False)
class TrainState:
    """Sharded parameters, optimizer state and step count: a pytree of ``DTensor`` s and tensors.

    A pytree in optree's default namespace and in ``torch.utils._pytree``:
    ``optree.tree_map(fn, state)`` maps every tensor. Edit it functionally with
    :func:`with_params` or ``attrs.evolve(state, opt_state=...)``.

    Attributes:
        params: ``{fqn: DTensor}``, the module's parameters by ``named_parameters()`` name, each
            this rank's shard (same placement as the module's own parameters).
        opt_state: the optimizer's state over the trainable parameters (``DTensor`` leaves).
        step: number of steps taken (0-d int64 tensor).
    """

    params: dict[str, Any]
    opt_state: Any
    step: torch.Tensor


def check_not_donated(state: TrainState, where: str) -> None:
    """Raise :class:`~functional_fsdp.core.errors.DonatedStateError` if ``state`` was donated.

    Args:
        state: the state about to be used.
        where: the caller's name, for the message.
    """
    if not isinstance(state, TrainState):
        raise ArgumentTypeError(f"{where}: expected a TrainState, got {type(state).__name__}")
    if int(state.step.item()) == _DONATED:
        raise DonatedStateError(
            f"{where}: this TrainState was donated to a step made with donate=True, which "
            "updated its buffers in place into the state it returned; use the returned state "
            "(state, metrics = step(state, batch)), or make the step with donate=False to keep "
            "old states usable"
        )


def _copy(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        return wrap_like(t._local_tensor.detach().clone(), t)
    return t.detach().clone()


def _local(t: Any) -> Any:
    return t._local_tensor if isinstance(t, DTensor) else t


def _check_model(model: nn.Module, what: str) -> None:
    if not isinstance(model, FSDPModule):
        raise ArgumentTypeError(
            f"{what} expects the root module passed to fully_shard (an FSDPModule), got "
            f"{type(model).__name__}; call fully_shard on each block and then on the model"
        )
    # A group left unsharded (the root after a no-grad forward, FSDPModule.unshard()) has its
    # full parameters registered, as in FSDP2: reshard so named_parameters() are the shards.
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def init(model: nn.Module, optimizer: Optimizer | GradientTransformation) -> TrainState:
    """A :class:`TrainState` holding a copy of ``model``'s sharded parameters.

    Args:
        model: the root module sharded with ``fully_shard`` (parameters are ``DTensor`` s).
        optimizer: a functional optimizer (:func:`~functional_fsdp.functional.adamw`,
            ``chain(...)``, ...); its state covers the parameters with ``requires_grad``.

    Returns:
        A new state at step 0. Its tensors are copies: later changes to the module do not
        change the state (write a state back with :func:`apply_to_module`).
    """
    _check_model(model, "init")
    check_functional_optimizer(optimizer, "init")
    params = {n: _copy(p) for n, p in model.named_parameters()}
    trainable = {n: params[n] for n in _trainable(model)}
    return TrainState(params, optimizer.init(trainable), torch.zeros((), dtype=torch.int64))


def with_params(state: TrainState, params: dict[str, Any]) -> TrainState:
    """A new state with some parameters replaced (optimizer state and step kept).

    Args:
        state: the state to start from (unchanged).
        params: ``{fqn: tensor}`` for the parameters to replace: a ``DTensor`` with the old
            one's shape and placement, or a plain tensor holding this rank's shard (the old
            ``DTensor`` 's local shape; it is wrapped with the old placement).

    Returns:
        The new state; the tensors are used as they are (not copied).
    """
    check_not_donated(state, "with_params")
    unknown = sorted(set(params) - set(state.params))
    if unknown:
        raise KeyError(f"with_params: {unknown[:5]} are not parameters of the state")
    new = dict(state.params)
    for n, t in params.items():
        old = state.params[n]
        if isinstance(old, DTensor) and not isinstance(t, DTensor):
            if tuple(t.shape) != tuple(old._local_tensor.shape):
                raise OptimizerStateError(
                    f"with_params: {n!r} is a plain tensor of shape {tuple(t.shape)}; pass this "
                    f"rank's shard (shape {tuple(old._local_tensor.shape)}) or a DTensor (to "
                    "edit full parameters use summon_state(state, model))"
                )
            t = wrap_like(t, old)
        elif tuple(t.shape) != tuple(old.shape) or type(t) is not type(old):
            raise OptimizerStateError(
                f"with_params: {n!r} must be a {type(old).__name__} of shape "
                f"{tuple(old.shape)}, got a {type(t).__name__} of shape {tuple(t.shape)}"
            )
        new[n] = t
    return attrs.evolve(state, params=new)


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
    check_not_donated(state, "apply_to_module")
    own = dict(model.named_parameters())
    if set(own) != set(state.params):
        raise OptimizerStateError(
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


def _check_activation_checkpointing(model: nn.Module) -> None:
    """Refuse checkpoint_wrapper / composable checkpoint up front (before any collective)."""
    registry = importlib.import_module("torch.distributed._composable.contract")._get_registry
    for name, m in model.named_modules():
        if isinstance(m, CheckpointWrapper) or "checkpoint" in (registry(m) or {}):
            from ..core.errors import UnsupportedError

            raise UnsupportedError(
                f"make_train_step: {name or 'the model'} ({type(m).__name__}) uses activation "
                "checkpointing, which the functional step does not support (the recompute runs "
                "after functional_call has put the module's own parameters back); train this "
                "model with the module API (loss.backward() + a torch optimizer), or remove "
                "checkpoint_wrapper / checkpoint() for the functional step"
            )


def _with_clipping(optimizer: Any, max_grad_norm: float | None) -> Any:
    if max_grad_norm is None:
        return optimizer
    warnings.warn(
        "make_train_step(max_grad_norm=...) is deprecated: pass "
        "chain(clip_by_global_norm(max_grad_norm), optimizer) instead",
        DeprecationWarning,
        stacklevel=3,
    )
    if not max_grad_norm > 0:
        raise HyperparameterError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
    # Clipping in front of the optimizer, keeping the optimizer's own state structure, so a
    # state from init(model, optimizer) works with the shortcut as before.
    clip = clip_by_global_norm(max_grad_norm)
    inner = as_optimizer(optimizer)

    def update(
        grads: Any, state: Any, params: Any, *, donate: bool = False, **extra: Any
    ) -> tuple[Any, Any]:
        grads, _ = clip.update(grads, EmptyState(), params, **extra)
        return inner.update(grads, state, params, donate=donate, **extra)

    return Optimizer(inner.init, update, inner.learning_rate)


def _check_state(state: Any, names: list[str]) -> None:
    check_not_donated(state, "step")
    if list(state.params) != names:
        raise OptimizerStateError(
            "step: the state's parameters do not match the model's; build the state with "
            "init(model, optimizer) from the model this step was made for"
        )


def _apply(
    opt: Optimizer,
    state: TrainState,
    trainable: list[str],
    grads: list[torch.Tensor],
    norms: StepNorms,
    donate: bool,
) -> TrainState:
    """The optimizer on the local shards, wrapped back into ``DTensor`` s; a new state."""
    params_local = {n: _local(state.params[n]) for n in trainable}
    opt_local = tree_map(_local, state.opt_state)
    new_local, new_opt_local = opt.update(
        dict(zip(trainable, grads)),
        opt_local,
        params_local,
        donate=donate,
        global_norm_fn=norms.norm_fn,
    )
    new_params = dict(state.params)
    for n in trainable:
        new_params[n] = wrap_like(new_local[n], state.params[n])
    new_opt = optree.tree_map(
        lambda new, old: wrap_like(new, old) if isinstance(old, torch.Tensor) else new,
        new_opt_local,
        state.opt_state,
        namespace=NAMESPACE,
    )
    new_step = state.step + 1
    if donate:
        state.step.fill_(_DONATED)  # the input is consumed: reusing it raises
    return TrainState(new_params, new_opt, new_step)


def _reproducible(
    model: nn.Module, policy: Any, grad_accum: int, params: dict[str, Any]
) -> ReproduciblePolicy | None:
    """The step's policy (given, or the model's groups'), checked against ``grad_accum``."""
    if policy is None:
        state = getattr(model, "_ffsdp_state", None)
        group = getattr(state, "group", None)
        policy = None if group is None else group.config.reproducible
    if policy is None:
        return None
    if not isinstance(policy, ReproduciblePolicy):
        raise ArgumentTypeError(
            f"reproducible must be a functional_fsdp.ReproduciblePolicy, got {type(policy).__name__}"
        )
    per_rank = policy.micro_batches_per_rank(dp_size(params.values()))
    if grad_accum != per_rank:
        raise ReproducibilityError(
            f"make_train_step: grad_accum={grad_accum}, but ReproduciblePolicy("
            f"virtual_world_size={policy.virtual_world_size}) runs {per_rank} micro-batches per "
            f"rank on this data-parallel world; pass grad_accum={per_rank} and each rank's "
            f"{per_rank} micro-batches (policy.micro_batches(rank, world_size)) as its batch"
        )
    return policy


def make_train_step(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: Optimizer | GradientTransformation,
    *,
    grad_accum: int = 1,
    has_aux: bool = False,
    max_grad_norm: float | None = None,
    donate: bool = False,
    reproducible: ReproduciblePolicy | None = None,
    compile: bool | str = False,
    compile_overlap: bool = True,
) -> TrainStep:
    """Build ``step(state, batch) -> (state, metrics)`` for a module sharded with ``fully_shard``.

    Each step, for every micro-batch: ``loss_fn(model, micro_batch)`` runs through
    ``torch.func.functional_call`` on the state's parameters (the FSDP hooks unshard one group at
    a time, reshard after forward, re-gather in backward), and ``torch.autograd.grad`` returns
    the reduce-scattered (averaged over ranks) sharded gradients. Then: gradients summed over
    micro-batches (each loss divided by ``grad_accum``), one all-reduce for the global gradient
    norm and the global mean loss, and the optimizer on the local shards.

    Args:
        model: the root module sharded with ``fully_shard``; it provides the computation, its
            own parameters are not read or written by the step.
        loss_fn: ``loss_fn(module, batch) -> scalar`` (mean over the batch), or
            ``-> (scalar, aux)`` with ``has_aux=True``.
        optimizer: a functional optimizer: ``adamw``/``sgd``, a ``chain(...)`` (e.g.
            ``chain(clip_by_global_norm(1.0), adamw(lr))``), or a ``GradientTransformation``
            (its updates are added to the parameters). Not a ``torch.optim.Optimizer``.
        grad_accum: split every tensor of ``batch`` on dim 0 into this many micro-batches
            (must divide evenly) and accumulate their gradients before one update.
        has_aux: ``loss_fn`` returns ``(loss, aux)`` (as ``jax.value_and_grad(has_aux=True)``);
            ``metrics["aux"]`` is ``aux`` detached (a list over micro-batches if
            ``grad_accum > 1``).
        max_grad_norm: deprecated (warns): ``chain(clip_by_global_norm(n), optimizer)``.
        donate: like JAX's ``donate_argnums``: the step updates the input state's parameters
            and moments in place, saving one copy of them per step. The input state is consumed:
            using it again raises :class:`~functional_fsdp.core.errors.DonatedStateError`.
        reproducible: a :class:`~functional_fsdp.ReproduciblePolicy` (default: the model's
            groups'): gradients summed in its canonical tree, the norm canonical: the same bits
            on every world size dividing ``V``; ``grad_accum`` must be ``V / N``
            (``docs/reproducibility.md``).
        compile: ``True`` (inductor) or a ``torch.compile`` backend's name (``"aot_eager"``):
            forward and backward traced whole, collectives in the graphs (docs/compiled_step.md).
        compile_overlap: each all-gather issued a bucket ahead, each wait where its result is
            needed (:mod:`functional_fsdp.core.overlap`); ``False``: the traced order.

    Returns:
        The step function. ``metrics``: ``"loss"`` (the mean loss over the micro-batches and
        the data-parallel ranks), ``"local_loss"`` (this rank's), ``"grad_norm"`` (global, before
        clipping), ``"lr"`` (a float, when the optimizer reports one) and ``"aux"``.
    """
    _check_arguments(model, optimizer, grad_accum)
    opt = as_optimizer(_with_clipping(optimizer, max_grad_norm))
    names = [n for n, _ in model.named_parameters()]
    trainable = _trainable(model)
    own = dict(model.named_parameters())
    policy = _reproducible(model, reproducible, grad_accum, own)
    norms = StepNorms([own[n] for n in trainable], trainable, canonical=policy is not None)
    del own
    how = (compile, compile_overlap)
    grads_of, report = _gradients(model, loss_fn, trainable, grad_accum, has_aux, policy, *how)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        _check_state(state, names)
        acc: Accumulated = grads_of(state.params, batch)
        local_loss = acc.loss_sum / grad_accum
        norm, loss = norms.norm_and_loss(acc.grads, local_loss)
        new_state = _apply(opt, state, trainable, acc.grads, norms, donate)
        metrics: dict[str, Any] = {"loss": loss, "local_loss": local_loss, "grad_norm": norm}
        if opt.learning_rate is not None:
            metrics["lr"] = opt.learning_rate(new_state.opt_state)
        if has_aux:
            metrics["aux"] = acc.aux[0] if grad_accum == 1 else acc.aux
        return new_state, metrics

    if report is not None:
        step.compile_report = report  # type: ignore[attr-defined]
    return step


def _gradients(
    model: nn.Module,
    loss_fn: LossFn,
    trainable: list[str],
    grad_accum: int,
    has_aux: bool,
    policy: ReproduciblePolicy | None,
    compile: bool | str,
    overlap: bool = True,
) -> tuple[Callable[[dict[str, Any], Any], Accumulated], Any]:
    """``grads_of(params, batch)``, eager or compiled, and the compiled one's report (or
    ``None``)."""
    compiled = _compiled(model, loss_fn, trainable, compile, policy, overlap=overlap)
    if compiled is not None:
        return (lambda p, b: compiled.grads(p, b, grad_accum, has_aux)), compiled.report
    return (
        lambda p, b: accumulate_grads(model, loss_fn, p, trainable, b, grad_accum, has_aux, policy)
    ), None


def _check_arguments(
    model: nn.Module, optimizer: Any, grad_accum: Any, *, where: str = "make_train_step"
) -> None:
    _check_model(model, where)
    if where == "make_train_step":  # compile_backward steps with a torch optimizer
        check_functional_optimizer(optimizer, where)
    _check_activation_checkpointing(model)
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise HyperparameterError(f"grad_accum must be a positive int, got {grad_accum!r}")


def _compiled(
    model: nn.Module,
    loss_fn: LossFn,
    trainable: list[str],
    compile: bool | str,
    policy: ReproduciblePolicy | None,
    where: str = "make_train_step",
    *,
    overlap: bool = True,
) -> Any:
    """The compiled forward and backward (``None``: eager), checked before any collective;
    ``where`` names the caller in errors."""
    if compile is False:
        return None
    if not (compile is True or (isinstance(compile, str) and compile)):
        raise ArgumentTypeError(
            f"{where}: compile must be True, False or a torch.compile backend name, got {compile!r}"
        )
    from .compiled import CompiledGrads

    if not isinstance(overlap, bool):
        raise ArgumentTypeError(f"{where}: compile_overlap must be True or False, got {overlap!r}")
    backend = "inductor" if compile is True else compile
    return CompiledGrads(
        model, loss_fn, trainable, backend, overlap=overlap, reproducible=policy, where=where
    )
