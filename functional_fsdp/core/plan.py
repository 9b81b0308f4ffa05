"""The step's communication plan (pure): who may share a collective, and the buckets.

Two questions decide how a step's collectives travel, and each is answered here once:

- **May a group's collective share a bucket with others'?** :func:`gathers_together` (its
  all-gather) and :func:`reduces_together` (its reduce-scatter) read a record of facts
  (:class:`SharingFacts`, :class:`ReduceFacts`) that the shell fills from a group. The
  plan asks when it is derived; the engine asks again when it starts a collective (a setting
  may have changed since, e.g. ``set_reshard_after_forward(2)`` keeps rows).
- **Which groups travel together in each phase?** :func:`derive_plan` cuts the recorded
  orders (the forward's, the backward's gathers, the post-backwards') into buckets of
  adjacent groups that may share and run over the same route (process group and wire dtype),
  and names the groups of the last forward bucket that keep their buffers for the backward.
  The hooks follow it: a group whose bucket has not started starts it whole, and the bucket's
  last group prefetches the next bucket.
- **What does each module prefetch?** :func:`prefetch_targets`: in each phase, the next module
  in the recorded order that gathers something (a group, or another group's tied weight). The
  plan holds the answer for every module, so a hook looks it up instead of searching the
  order at every call.

Communicators declare whether they can run a bucket (``coalesces``, :func:`~.comm.coalesces`)
instead of being tested for their type. Every rank derives the plan from facts every rank
shares, so every rank issues the same collectives.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import TypeVar

import attrs

from .coalesce import Bucket, CommunicationSchedule, plan_buckets

__all__ = [
    "GroupPlanFacts",
    "Plan",
    "ReduceFacts",
    "SharingFacts",
    "gathers_together",
    "derive_plan",
    "prefetch_targets",
    "reduces_together",
]

K = TypeVar("K", bound=Hashable)


@attrs.frozen
class SharingFacts:
    """What decides whether a group's all-gather may travel with other groups'.

    Attributes:
        world_size: ranks in the group's shard group (one rank: nothing to gather).
        coalesces: its communicator can run a bucket (a process group's; not a custom
            ``AllGather``/``ReduceScatter``, not a simulated one).
        offload: its shards live on the host (CPU offload stages them alone).
        codecs: tensor-subclass all-gather codecs (each encodes its own input).
        keeps_rows: ``reshard_after_forward=k``: it keeps, or gathers from, a sub-group's rows.
        tied: its modules use another group's weight (the owner gathers it).
        lends: another group's modules use one of its weights.
        forward_users: modules forwarding through it (``fully_shard([m1, m2])``).
    """

    world_size: int
    coalesces: bool
    offload: bool = False
    codecs: bool = False
    keeps_rows: bool = False
    tied: bool = False
    lends: bool = False
    forward_users: int = 1


@attrs.frozen
class ReduceFacts:
    """What decides whether a group's reduce-scatter may travel with other groups'.

    Attributes:
        world_size: ranks in the group's shard group.
        coalesces: its communicator can run a bucket.
        sync: gradient sync is on (off: the gradients are accumulated, not reduced).
        plain: the packed exact reduce-scatter: no compression, all-reduce hook, reproducible
            tree or pieces path.
    """

    world_size: int
    coalesces: bool
    sync: bool = True
    plain: bool = True


def _collective_may_coalesce(world_size: int, coalesces: bool) -> bool:
    """The part both collectives share: several ranks, on a communicator that can."""
    return world_size > 1 and coalesces


def gathers_together(f: SharingFacts) -> bool:
    """Whether the group's all-gather may share a bucket (the one rule for it)."""
    return (
        _collective_may_coalesce(f.world_size, f.coalesces)
        and not f.offload
        and not f.codecs
        and not f.keeps_rows
        and not f.tied
        and not f.lends
        and f.forward_users == 1
    )


def reduces_together(f: ReduceFacts) -> bool:
    """Whether the group's reduce-scatter may share a bucket (the one rule for it)."""
    return _collective_may_coalesce(f.world_size, f.coalesces) and f.sync and f.plain


@attrs.frozen
class GroupPlanFacts:
    """One group, as the plan sees it.

    Attributes:
        unsharded_bytes: its all-gather output's bytes.
        route: what a bucket never crosses (the process group and the wire dtype).
        shares: :func:`gathers_together` when the plan is derived.
    """

    unsharded_bytes: int
    route: Hashable
    shares: bool


@attrs.frozen
class Plan:
    """The step's communication plan.

    Attributes:
        schedule: the buckets per phase (``FSDPModule.communication_schedule()``).
        forward: each group's forward bucket (its name -> the bucket's names, in order).
        backward: each group's backward bucket.
        reduce: the reduce buckets of several groups, each as its names.
        kept: the groups of the last forward bucket that keep their unsharded buffer for the
            backward (it comes first): those that may share, when the bucket fits the size.
        forward_prefetch: each module's forward prefetch target (:func:`prefetch_targets`
            of the forward's order); a module without one is absent.
        backward_prefetch: each module's backward prefetch target (of the backward's order:
            the reverse of the order the forwards ended).
    """

    schedule: CommunicationSchedule
    forward: Mapping[str, tuple[str, ...]]
    backward: Mapping[str, tuple[str, ...]]
    reduce: tuple[tuple[str, ...], ...]
    kept: frozenset[str]
    forward_prefetch: Mapping[str, str] = attrs.field(factory=dict)
    backward_prefetch: Mapping[str, str] = attrs.field(factory=dict)


def prefetch_targets(order: Sequence[K], gathers: Collection[K]) -> dict[K, K]:
    """Each module's prefetch target: the first module after its first place in ``order``
    that ``gathers`` something (a module used again later may be its own target).

    Example:
        >>> prefetch_targets("abcab", gathers="ab")
        {'a': 'b', 'b': 'a', 'c': 'a'}
    """
    after: list[K | None] = [None] * (len(order) + 1)
    for i in range(len(order) - 1, -1, -1):
        after[i] = order[i] if order[i] in gathers else after[i + 1]
    out: dict[K, K] = {}
    for i, k in enumerate(order):
        target = after[i + 1]
        if k not in out and target is not None:
            out[k] = target
    return out


def _cut(
    order: Sequence[str], facts: Mapping[str, GroupPlanFacts], bucket_bytes: int
) -> tuple[tuple[Bucket, ...], dict[str, tuple[str, ...]]]:
    """Buckets over ``order``: a change of route closes a bucket, so each run of one route
    is planned on its own."""
    buckets: list[Bucket] = []
    start = 0
    for i in range(1, len(order) + 1):
        cut = i == len(order)
        if not cut:
            a, b = facts[order[i - 1]], facts[order[i]]
            cut = not a.shares or not b.shares or a.route != b.route
        if cut:
            run = order[start:i]
            buckets.extend(
                plan_buckets(
                    run,
                    [facts[n].unsharded_bytes for n in run],
                    [facts[n].shares for n in run],
                    bucket_bytes,
                )
            )
            start = i
    members = {n: b.groups for b in buckets for n in b.groups}
    return tuple(buckets), members


def derive_plan(
    forward: Sequence[str],
    backward: Sequence[str],
    reduce: Sequence[str],
    facts: Mapping[str, GroupPlanFacts],
    bucket_bytes: int,
    *,
    keep_last: bool = True,
    forward_uses: Sequence[str] = (),
    backward_uses: Sequence[str] = (),
    gathering: Collection[str] = frozenset(),
) -> Plan:
    """The plan of a step from its recorded orders.

    Args:
        forward: the groups in forward order (each once, at its first use).
        backward: the groups in the order the backward reaches them (each once).
        reduce: the groups in the order their post-backwards run (each once).
        facts: every group's facts, by name.
        bucket_bytes: the bucket size (``<= 0``: one collective per group).
        keep_last: the last forward bucket may keep its buffers (``False``: none kept).
        forward_uses: every module's forward, in order (repeats included), for prefetching.
        backward_uses: every module's backward, in order.
        gathering: the modules that gather something (prefetch targets).

    Example:
        >>> f = {n: GroupPlanFacts(4, "pg", True) for n in "abc"}
        >>> p = derive_plan("abc", "cba", "cba", f, 8)
        >>> p.forward["b"], sorted(p.kept)
        (('a', 'b'), ['c'])
    """
    fwd, fmembers = _cut(forward, facts, bucket_bytes)
    bwd, bmembers = _cut(backward, facts, bucket_bytes)
    red, _ = _cut(reduce, facts, bucket_bytes)
    last = fmembers.get(forward[-1], ()) if forward and keep_last else ()
    fits = sum(facts[n].unsharded_bytes for n in last) <= bucket_bytes
    kept = frozenset(n for n in last if fits and facts[n].shares)
    return Plan(
        CommunicationSchedule(max(bucket_bytes, 0), fwd, bwd, red),
        fmembers,
        bmembers,
        tuple(b.groups for b in red if b.coalesced),
        kept,
        prefetch_targets(forward_uses, gathering),
        prefetch_targets(backward_uses, gathering),
    )
