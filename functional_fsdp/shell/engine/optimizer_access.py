"""The optimizer's accesses, told to a checking device runtime (the stream-ordering simulator).

An optimizer step reads each parameter's ``.grad`` and writes its shards: on compute, or on the
host for a CPU step over offloaded shards. The engine does not run the step, so it reports it
after the fact: a global optimizer step post-hook (installed once, when the first group runs on
a runtime that checks) finds the groups whose parameters the optimizer holds and annotates
:func:`.ordering.optimizer_stepped` for each. With it the simulator sees a gather's copy-in that
does not wait for the step, a step that does not wait for the post-reduce stream, and a host
step over shards a host-to-device copy still reads.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from . import ordering

__all__ = ["watch"]

_GROUP = "_ffsdp_checked_group"  # on a sharded parameter: a weak reference to its group
_HANDLE: list[Any] = []


def watch(group: Any) -> None:
    """Report the optimizer steps over ``group``'s parameters to its (checking) runtime."""
    ref = weakref.ref(group)
    for p in group.params:
        setattr(p, _GROUP, ref)
    if not _HANDLE:
        _HANDLE.append(register_optimizer_step_post_hook(_stepped))


def _stepped(optimizer: Any, args: Any = (), kwargs: Any = None) -> None:
    del args, kwargs
    groups: dict[int, Any] = {}
    for pg in optimizer.param_groups:
        for p in pg["params"]:
            ref = getattr(p, _GROUP, None)
            g = ref() if ref is not None else None
            if g is not None and g.runtime.checks:
                groups.setdefault(id(g), g)
    for g in groups.values():
        grads = [t for t in (sp.grad_local() for sp in g.sharded_params) if t is not None]
        ordering.optimizer_stepped(g.runtime, grads, [g.state.flat], on_host=g.offload)
