"""Public testing tools: a simulated N-rank world and hypothesis strategies.

- :class:`SimulatedWorld` runs ``world_size`` ranks as threads of one process; its
  communicators (:class:`SimulatedComm`, one per rank of a :class:`SimulatedGroup`) implement
  :class:`~functional_fsdp.core.comm.Communicator` exactly, with HSDP meshes and sub-groups.
- :mod:`functional_fsdp.testing.strategies` holds hypothesis strategies (keyword-only
  arguments): ``world_sizes``, ``shapes`` (0-size dims, dim 0 smaller than the world),
  ``float_dtypes``, ``tensors`` (deterministic values from a drawn seed), ``param_trees`` (dicts,
  lists and nestings of tensors, possibly mixed dtypes) and ``mesh_shapes`` (2-D
  ``(replicate, shard)`` shapes). It needs ``hypothesis`` and is imported on first use, so the
  simulated world works without it.

Use them to property-test your own sharding in one process::

    import optree
    import torch
    from hypothesis import given
    from functional_fsdp import shard, unshard
    from functional_fsdp.testing import SimulatedWorld, strategies as fst

    @given(tree=fst.param_trees(), world_size=fst.world_sizes())
    def test_round_trip(tree, world_size):
        world = SimulatedWorld(world_size)
        outs = world.run(lambda c: unshard(shard(tree, world_size=world_size, rank=c.rank), c))
        for out in outs:
            for got, want in zip(out.params, optree.tree_leaves(tree)):
                assert torch.equal(got, want)

See ``docs/testing.md`` for more.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._world import SimulatedComm, SimulatedGroup, SimulatedWorld

__all__ = ["SimulatedComm", "SimulatedGroup", "SimulatedWorld", "strategies"]


def __getattr__(name: str) -> Any:
    # hypothesis is a test extra: import the strategies module only when asked for.
    if name == "strategies":
        return importlib.import_module(f"{__name__}.strategies")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
