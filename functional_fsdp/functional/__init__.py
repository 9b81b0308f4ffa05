"""The functional API: an immutable :class:`TrainState`, a pure training step, and optax-style
functional optimizers, over modules sharded with ``fully_shard``.

See ``docs/functional.md``. The typical loop::

    opt = adamw(1e-3)
    state = init(model, opt)
    step = make_train_step(model, lambda m, b: m.loss(*b), opt)
    for batch in data:
        state, metrics = step(state, batch)
"""

from .optim import AdamWState, InitFn, Optimizer, SGDState, UpdateFn, adamw, sgd
from .train import (
    LossFn,
    TrainState,
    TrainStep,
    apply_to_module,
    from_state_dict,
    global_norm,
    init,
    make_train_step,
    to_state_dict,
)

__all__ = [
    "AdamWState",
    "InitFn",
    "LossFn",
    "Optimizer",
    "SGDState",
    "TrainState",
    "TrainStep",
    "UpdateFn",
    "adamw",
    "apply_to_module",
    "from_state_dict",
    "global_norm",
    "init",
    "make_train_step",
    "sgd",
    "to_state_dict",
]
