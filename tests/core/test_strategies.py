"""functional_fsdp.testing.strategies: they reach the edge cases the suite relies on."""

from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from strategies import float_dtypes, mesh_shapes, param_trees, shapes, tensors, world_sizes

# generate only: an example that satisfies the condition is enough, no need to shrink it
FIND = settings(database=None, max_examples=2000, phases=[Phase.generate])


def _depth(tree: object) -> int:
    if isinstance(tree, dict):
        return 1 + max(_depth(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return 1 + max(_depth(v) for v in tree)
    return 0


def test_shapes_reach_empty_dims_and_short_dim0() -> None:
    assert 0 in find(shapes(), lambda s: 0 in s, settings=FIND)
    shape, ws = find(
        st.tuples(shapes(), world_sizes()), lambda p: 0 < p[0][0] < p[1] > 2, settings=FIND
    )
    assert 0 < shape[0] < ws
    assert find(shapes(max_dims=3), lambda s: len(s) == 3, settings=FIND)


def test_param_trees_reach_mixed_dtypes_and_nesting() -> None:
    mixed = find(
        param_trees(), lambda t: len({x.dtype for x in optree.tree_leaves(t)}) > 1, settings=FIND
    )
    assert len({x.dtype for x in optree.tree_leaves(mixed)}) > 1
    assert _depth(find(param_trees(), lambda t: _depth(t) >= 3, settings=FIND)) >= 3
    assert isinstance(find(param_trees(), lambda t: isinstance(t, dict), settings=FIND), dict)
    assert isinstance(find(param_trees(), lambda t: isinstance(t, list), settings=FIND), list)


def test_mesh_shapes_reach_true_2d_meshes() -> None:
    r, s = find(mesh_shapes(), lambda m: m[0] > 1 and m[1] > 1, settings=FIND)
    assert r * s <= 8


@given(mesh=mesh_shapes(), ws=world_sizes(), shape=shapes(allow_empty=False), dtype=float_dtypes())
def test_drawn_values_respect_their_bounds(
    mesh: tuple[int, int], ws: int, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    assert mesh[0] >= 1 and mesh[1] >= 1 and mesh[0] * mesh[1] <= 8
    assert 1 <= ws <= 8
    assert 1 <= len(shape) <= 3 and all(1 <= d <= 9 for d in shape)
    assert dtype in (torch.float32, torch.bfloat16, torch.float16)


@given(tree=param_trees(max_leaves=4, dtypes=[torch.float16, torch.int32]))
def test_tree_leaves_are_finite_small_tensors(tree: object) -> None:
    leaves = optree.tree_leaves(tree)
    assert 1 <= len(leaves) <= 4
    for t in leaves:
        assert isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.int32)
        assert t.dim() >= 1
        if t.numel():
            assert torch.isfinite(t.float()).all() and t.float().abs().max() <= 8


@given(t=tensors(shape=(4, 3), dtype=st.just(torch.bfloat16)))
def test_tensors_take_fixed_or_drawn_shape_and_dtype(t: torch.Tensor) -> None:
    assert t.shape == (4, 3) and t.dtype == torch.bfloat16


def test_tensor_values_are_a_function_of_the_seed() -> None:
    from functional_fsdp.testing.strategies import _values

    # the same seed gives the same values, so a failing example replays exactly
    assert torch.equal(_values((4, 3), torch.bfloat16, 7), _values((4, 3), torch.bfloat16, 7))
    assert not torch.equal(_values((4, 3), torch.float32, 7), _values((4, 3), torch.float32, 8))


def test_arguments_are_keyword_only_and_validated() -> None:
    with pytest.raises(TypeError):
        world_sizes(1, 8)  # type: ignore[misc]
    with pytest.raises(TypeError):
        shapes(1)  # type: ignore[misc]
    with pytest.raises(ValueError):
        world_sizes(min_size=0)
    with pytest.raises(ValueError):
        shapes(min_dims=3, max_dims=2)
    with pytest.raises(ValueError):
        mesh_shapes(max_size=0)


def test_param_trees_discard_few_examples() -> None:
    # A counting wrapper: the first element of the tuple is drawn (and counted) at the start of
    # every attempt; the body runs only for the valid ones. The nested-composite version
    # discarded 33-37% ("max depth exceeded", failed st.sets); hypothesis itself rejects about
    # 15-20% of attempts even for st.lists(st.integers()) (duplicates), and param_trees is now
    # at that floor. Derandomized, so the measured rate is stable.

    starts: list[int] = []
    valid: list[int] = []

    @settings(
        database=None, max_examples=300, phases=[Phase.generate], derandomize=True, deadline=None
    )
    @given(st.tuples(st.just(0).map(starts.append), param_trees()))
    def draw_many(_: object) -> None:
        valid.append(1)

    draw_many()
    rate = 1 - len(valid) / len(starts)
    assert len(valid) == 300 and rate < 0.25, rate
