"""functional_fsdp: fully sharded data parallelism for PyTorch around immutable state.

The top level is lazy: ``import functional_fsdp`` (and any pure core module such as
``functional_fsdp.core.layout``, ``core.records``, ``core.transitions`` or ``testing``) loads
only the core. The imperative shell (``fully_shard``, checkpoints, ``torch.distributed``) and
the functional API load on first use of one of their names. ``tests/integration/test_architecture.py``
checks this in a subprocess.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._torch_muon_guard import install as _install_torch_muon_guard
from .core import errors as _errors

__version__ = "0.1.0"

# The one list of public names: name -> (module, attribute; ``None``: the module itself).
# Names from ``.core`` load with the package; the shell's and the functional API's load on
# first use (module ``__getattr__``), so ``import functional_fsdp`` stays pure.
_PUBLIC: dict[str, tuple[str, str | None]] = {
    # the pure core: errors, records, policies, transitions, the communicator protocol, pytrees
    "errors": (".core.errors", None),
    **{n: (".core.errors", n) for n in _errors.__all__},  # every error and warning class
    "CPUOffloadPolicy": (".core.records", "CPUOffloadPolicy"),
    "GroupLayout": (".core.records", "GroupLayout"),
    "MixedPrecisionPolicy": (".core.records", "MixedPrecisionPolicy"),
    "OffloadPolicy": (".core.records", "OffloadPolicy"),
    "ParamSpec": (".core.records", "ParamSpec"),
    "PostForwardState": (".core.records", "PostForwardState"),
    "ShardedState": (".core.records", "ShardedState"),
    "UnshardedState": (".core.records", "UnshardedState"),
    "GradCompression": (".core.compression", "GradCompression"),
    "Communicator": (".core.comm", "Communicator"),
    "CommCapabilities": (".core.comm", "CommCapabilities"),
    "Work": (".core.comm", "Work"),
    "shard": (".core.transitions", "shard"),
    "unshard": (".core.transitions", "unshard"),
    "reshard": (".core.transitions", "reshard"),
    "writeback": (".core.transitions", "writeback"),
    "reduce_grad": (".core.transitions", "reduce_grad"),
    "ReducePolicy": (".core.reduction", "ReducePolicy"),
    "ReduceState": (".core.reduction", "ReduceState"),
    "reduce_grad_with_state": (".core.reduction", "reduce_grad_with_state"),
    "ReproduciblePolicy": (".core.reproducible", "ReproduciblePolicy"),
    "Redundancy": (".core.recovery", "Redundancy"),
    "Bucket": (".core.coalesce", "Bucket"),
    "CommunicationSchedule": (".core.coalesce", "CommunicationSchedule"),
    "tree_flatten": (".core._tree", "tree_flatten"),
    "tree_leaves": (".core._tree", "tree_leaves"),
    "tree_map": (".core._tree", "tree_map"),
    "tree_unflatten": (".core._tree", "tree_unflatten"),
    # the shell: the FSDP2 drop-in, summon, checkpoints, the local launcher
    "fully_shard": (".shell", "fully_shard"),
    "FSDPModule": (".shell", "FSDPModule"),
    "UnshardHandle": (".shell", "UnshardHandle"),
    "GradientReductionHandle": (".shell", "GradientReductionHandle"),
    "use_as_fsdp2": (".shell", "use_as_fsdp2"),
    "FSDP2Swap": (".shell", "FSDP2Swap"),
    "register_fsdp_forward_method": (".shell", "register_fsdp_forward_method"),
    "share_comm_ctx": (".shell", "share_comm_ctx"),
    "ProcessGroupComm": (".shell", "ProcessGroupComm"),
    "summon_full_params": (".shell", "summon_full_params"),
    "keep_neighbour_copies": (".shell", "keep_neighbour_copies"),
    "rebuild_on_survivors": (".shell", "rebuild_on_survivors"),
    "NeighbourCopies": (".shell", "NeighbourCopies"),
    "Rebuilt": (".shell", "Rebuilt"),
    "release_spares": (".shell", "release_spares"),
    "stand_by": (".shell", "stand_by"),
    "save_checkpoint": (".shell", "save_checkpoint"),
    "load_checkpoint": (".shell", "load_checkpoint"),
    "ChecksummingFileSystemWriter": (".shell", "ChecksummingFileSystemWriter"),
    "SafeFileSystemReader": (".shell", "SafeFileSystemReader"),
    "SafeLoadPlanner": (".shell", "SafeLoadPlanner"),
    "run_local": (".shell.launch", "run_local"),
    "set_local_optimizer_step": (".shell", "set_local_optimizer_step"),
    "set_host_buffer_pool_bytes": (".shell.device.pool", "set_host_buffer_pool_bytes"),
    # the functional API and the optimizers
    "functional": (".functional", None),
    "optim": (".optim", None),
    "TrainState": (".functional", "TrainState"),
    "apply_to_module": (".functional", "apply_to_module"),
    "make_train_step": (".functional", "make_train_step"),
    "init_train_state": (".functional", "init"),
    "clip_grad_norm_": (".functional.norms", "clip_grad_norm_"),
}
__all__ = sorted(_PUBLIC)


def _load(name: str) -> Any:
    module_name, attr = _PUBLIC[name]
    module = importlib.import_module(module_name, __name__)
    return module if attr is None else getattr(module, attr)


globals().update({n: _load(n) for n, (m, _) in _PUBLIC.items() if m.startswith(".core")})

# torch.optim.Muon stepped on sharded DTensor parameters raises instead of silently
# orthogonalizing without the whole matrix (a global step pre-hook, see _torch_muon_guard).
_TORCH_MUON_GUARD = _install_torch_muon_guard()


def __getattr__(name: str) -> Any:
    """Load a shell or functional-API name on first use (the core never imports the shell)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _load(name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
