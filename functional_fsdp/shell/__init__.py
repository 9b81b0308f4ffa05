"""The imperative shell: the only code that touches torch.distributed, hooks and autograd.

Its rooms (see ``docs/design.md``):

- ``engine/``: the runtime of one parameter group (its gathers, reductions, autograd Functions
  and the functional path's per-call gathers);
- ``api/``: ``fully_shard``, ``FSDPModule``, the per-module hook state and root logic;
- ``io/``: state dicts and checkpoints, ``summon_full_params``, reloading parameters;
- ``comm/``: communicators over real process groups and FSDP2's custom-collective hooks;
- ``parallel/``: tensor-parallel ``DTensor`` parameters under ``fully_shard`` (2-D);
- ``recovery/``: the copies of a neighbour's state that a lost rank is rebuilt from;
- ``launch.py``: running a function on N local CPU ranks.

Everything other layers (``functional_fsdp.functional``, the top level) use from the shell is
exported here, in the one table below; they import this package, never its modules.
"""

from __future__ import annotations

import importlib
from typing import Any

# Exported name -> the module that defines it. Loaded on first use: the checkpoint names load
# torch.distributed.checkpoint (about 6 MiB of RSS per rank), which a run that never
# checkpoints should not pay for.
_EXPORTS: dict[str, str] = {
    "fully_shard": ".api.fully_shard",
    "register_fsdp_forward_method": ".api.state",
    "FSDPModule": ".api.module",
    "UnshardHandle": ".api.module",
    "GradientReductionHandle": ".api.finalization",
    "use_as_fsdp2": ".api.as_fsdp2",
    "FSDP2Swap": ".api.as_fsdp2",
    "share_comm_ctx": ".api.module",
    "DeferredReductions": ".engine.functional_path",
    "TracedModel": ".api.traced",
    "TreeReductions": ".engine.reproducible",
    "agree_on_run": ".comm.graph_agreement",
    "unused_locals": ".comm.graph_agreement",
    "graph_collectives": ".comm.graph_agreement",
    "next_graph_key": ".comm.graph_agreement",
    "set_local_optimizer_step": ".engine.local_step",
    "wrap_like": ".engine.dtensors",
    "ProcessGroupComm": ".comm.process_group",
    "summon_full_params": ".io.summon",
    "keep_neighbour_copies": ".recovery.copies",
    "rebuild_on_survivors": ".recovery.rebuild",
    "NeighbourCopies": ".recovery.copies",
    "Rebuilt": ".recovery.rebuild",
    "release_spares": ".recovery.rebuild",
    "stand_by": ".recovery.rebuild",
    "save_checkpoint": ".io.checkpoint",
    "load_checkpoint": ".io.checkpoint",
    "ChecksummingFileSystemWriter": ".io.checkpoint_files",
    "SafeFileSystemReader": ".io.checkpoint_files",
    "SafeLoadPlanner": ".io.checkpoint_files",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
