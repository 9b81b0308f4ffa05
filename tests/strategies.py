"""The library's public hypothesis strategies, re-exported for the tests.

Tests draw from the same strategies users get, so the public ones are exercised by the suite.
"""

from __future__ import annotations

from functional_fsdp.testing.strategies import (
    float_dtypes,
    mesh_shapes,
    param_trees,
    shapes,
    tensors,
    world_sizes,
)

__all__ = ["float_dtypes", "mesh_shapes", "param_trees", "shapes", "tensors", "world_sizes"]
