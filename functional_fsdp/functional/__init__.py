"""The functional API: an immutable :class:`TrainState`, a pure training step, and optax-style
optimizers (composable gradient transformations and schedules), over modules sharded with
``fully_shard``.

See ``docs/functional.md``. The typical loop::

    opt = chain(clip_by_global_norm(1.0), adamw(1e-3))
    state = init(model, opt)
    step = make_train_step(model, lambda m, b: m.loss(*b), opt)
    for batch in data:
        state, metrics = step(state, batch)
"""

from typing import TYPE_CHECKING, Any

# The optimizer half (transforms, optim, schedules, hyper-parameters, norms) is shell-free:
# ``import functional_fsdp.functional.optim`` loads no ``functional_fsdp.shell`` module.
from . import schedules
from .hyperparams import InjectHyperparamsState, inject_hyperparams, set_hyperparams
from .norms import global_norm
from .optim import AdamWState, InitFn, Optimizer, SGDState, UpdateFn, adamw, sgd
from .transforms import (
    EmptyState,
    GradientTransformation,
    ScaleByAdamState,
    ScaleByScheduleState,
    TransformInitFn,
    TransformUpdateFn,
    add_decayed_weights,
    apply_updates,
    as_optimizer,
    chain,
    clip_by_global_norm,
    identity,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
)
from .whole_matrix import MuonState, WholeMatrixState, muon, whole_matrix

if TYPE_CHECKING:
    from .bridges import (
        SummonedState,
        from_state_dict,
        from_torch_optimizer,
        summon_state,
        to_state_dict,
        to_torch_optimizer,
    )
    from .compiled import CompileReport, compile_backward
    from .step import (
        LossFn,
        TrainState,
        TrainStep,
        apply_to_module,
        check_not_donated,
        init,
        make_train_step,
        with_params,
    )

# The step half needs the shell (module hooks, summon): loaded on first use of one of its names.
_SHELL_HALF = {
    "bridges": (
        "SummonedState",
        "from_state_dict",
        "from_torch_optimizer",
        "summon_state",
        "to_state_dict",
        "to_torch_optimizer",
    ),
    "compiled": ("CompileReport", "compile_backward"),
    "step": (
        "LossFn",
        "TrainState",
        "TrainStep",
        "apply_to_module",
        "check_not_donated",
        "init",
        "make_train_step",
        "with_params",
    ),
}


def __getattr__(name: str) -> Any:
    for module, names in _SHELL_HALF.items():
        if name in names:
            import importlib

            return getattr(importlib.import_module(f".{module}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdamWState",
    "CompileReport",
    "EmptyState",
    "GradientTransformation",
    "InitFn",
    "InjectHyperparamsState",
    "LossFn",
    "MuonState",
    "Optimizer",
    "SGDState",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "SummonedState",
    "TrainState",
    "TrainStep",
    "TransformInitFn",
    "TransformUpdateFn",
    "UpdateFn",
    "WholeMatrixState",
    "adamw",
    "add_decayed_weights",
    "apply_to_module",
    "apply_updates",
    "as_optimizer",
    "chain",
    "check_not_donated",
    "clip_by_global_norm",
    "compile_backward",
    "from_state_dict",
    "from_torch_optimizer",
    "global_norm",
    "identity",
    "init",
    "inject_hyperparams",
    "make_train_step",
    "muon",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "schedules",
    "set_hyperparams",
    "sgd",
    "summon_state",
    "to_state_dict",
    "to_torch_optimizer",
    "whole_matrix",
    "with_params",
]
