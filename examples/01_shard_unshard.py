"""Shard a small MLP's parameters over 4 simulated ranks, then gather them back.

Runs in one process in a few seconds: ``python examples/01_shard_unshard.py``.

Each rank keeps only its dim-0 chunk of every parameter (``torch.chunk`` rules: with 5 output
rows on 4 ranks, the ranks hold 2, 2, 1 and 0 rows). ``unshard`` all-gathers the chunks (here over
a :class:`~functional_fsdp.testing.SimulatedWorld`, whose ranks are threads) and returns the full
parameters, bit for bit, which the model then runs with via ``torch.func.functional_call``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from functional_fsdp import reshard, shard, unshard
from functional_fsdp.testing import SimulatedWorld

WORLD_SIZE = 4


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 5))
    params = {name: p.detach() for name, p in model.named_parameters()}

    # Sharding is local (no communication): each rank builds its own ShardedState.
    states = [shard(params, world_size=WORLD_SIZE, rank=r) for r in range(WORLD_SIZE)]
    layout = states[0].layout
    print(f"{len(layout)} parameters, {WORLD_SIZE} ranks")
    for i, spec in enumerate(layout.specs):
        local = [tuple(s.local(i).shape) for s in states]
        print(
            f"  {spec.fqn:10s} {spec.shape!s:10s} -> per-rank shards {local} (padded {layout.shard_shapes[i]})"
        )

    # Unsharding needs the collective: run every rank concurrently in the simulated world.
    world = SimulatedWorld(WORLD_SIZE)
    full = world.run(lambda comm, state: unshard(state, comm), states)

    x = torch.randn(3, 16)
    expected = model(x)
    for rank, unsharded in enumerate(full):
        tree = unsharded.tree()  # the same dict structure as ``params``
        assert tree.keys() == params.keys()
        for name, tensor in tree.items():
            assert torch.equal(tensor, params[name]), (
                f"rank {rank}: {name} changed in the round trip"
            )
        assert torch.equal(functional_call(model, tree, (x,)), expected)
        assert reshard(unsharded) is states[rank]  # dropping the full tensors returns the shards
    print(f"round trip exact on all {WORLD_SIZE} ranks; forward with gathered params matches")


if __name__ == "__main__":
    main()
