"""``core/traced.py``'s comparison and digest of the ranks' compiled graphs (pure; the shell's
``graph_agreement`` publishes and raises, ``tests/functional/test_compiled_step.py`` runs it on
2 ranks)."""

from __future__ import annotations

from functional_fsdp.core.traced import collectives_difference, collectives_digest

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


def test_the_digest_tells_graphs_apart_and_survives_a_float64_all_reduce() -> None:
    """The ranks compare digests with one max all-reduce of ``float64``s before each graph run:
    equal collectives give equal digests (also as the store's JSON lists), a change of op,
    group size, elements, dtype or order gives another, and every digest is exact in a
    ``float64``."""
    base = [AG, RS]
    digests = {
        collectives_digest(c)
        for c in (
            base,
            [RS, AG],
            [AG],
            [],
            [AG2, RS],
            [("all_gather_into_tensor", 4, 6784, "torch.float32"), RS],
            [("all_gather_into_tensor", 2, 6784, "torch.bfloat16"), RS],
        )
    }
    assert len(digests) == 7
    assert collectives_digest(base) == collectives_digest([list(c) for c in base])  # type: ignore[misc]
    for d in digests:
        assert 0 <= d < 2**52 and int(float(d)) == d and int(-float(d)) == -d
