"""Public testing tools: a simulated N-rank world and hypothesis strategies.

Use them to property-test your own sharding in one process::

    from hypothesis import given
    from functional_fsdp import shard, unshard
    from functional_fsdp.testing import SimulatedWorld, strategies as st

    @given(tree=st.param_trees(), world_size=st.world_sizes())
    def test_round_trip(tree, world_size):
        world = SimulatedWorld(world_size)
        outs = world.run(lambda c: unshard(shard(tree, world_size=world_size, rank=c.rank), c))
        ...
"""

from ._world import SimulatedComm, SimulatedGroup, SimulatedWorld

__all__ = ["SimulatedComm", "SimulatedGroup", "SimulatedWorld"]
