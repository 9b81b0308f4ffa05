"""``core/traced.py``'s comparison of the ranks' compiled graphs (pure; the shell's
``graph_agreement`` publishes and raises, ``tests/functional/test_compiled_step.py`` runs it on
2 ranks)."""

from __future__ import annotations

from functional_fsdp.core.traced import collectives_difference

AG = ("all_gather_into_tensor", 2, 6784, "torch.float32")
AG2 = ("all_gather_into_tensor", 2, 80, "torch.float32")
RS = ("reduce_scatter_tensor", 2, 6784, "torch.float32")


def test_equal_graphs_agree() -> None:
    assert collectives_difference({0: [AG, RS], 1: [AG, RS], 2: [AG, RS]}) is None
    assert collectives_difference({0: [], 1: []}) is None
    # lists (as they come back from the store's JSON) compare as tuples
    assert collectives_difference({0: [AG], 1: [list(AG)]}) is None  # type: ignore[list-item]


def test_the_first_difference_is_named() -> None:
    why = collectives_difference({0: [AG, RS], 1: [AG, AG2, RS]})
    assert why is not None
    assert "rank 0's graphs run 2 collectives, rank 1's 3" in why
    assert "collective #2 is reduce_scatter_tensor of 6784 torch.float32 elements" in why
    assert "all_gather_into_tensor of 80 torch.float32 elements over 2 ranks on rank 1" in why


def test_a_graph_that_ends_early_is_named() -> None:
    why = collectives_difference({3: [AG, RS], 1: [AG]})
    assert why is not None
    assert "collective #2 is nothing (its graphs end) on rank 1" in why
    assert "reduce_scatter_tensor of 6784 torch.float32 elements over 2 ranks on rank 3" in why
