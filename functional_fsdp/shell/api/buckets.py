"""The root's communication schedule: which groups' collectives travel together.

After its first forward the root knows the order its groups run in (``forward_order``), the
order the backward reaches them (the reverse of the post-forward order) and the order their
post-backwards run (the reverse of the pre-forward order: a group's post-backward is the
backward of the ``UnshardFn`` node its pre-forward made, and autograd runs the nodes that are
ready latest-made first, so the root's runs last even when its only parameters are a head used
at the end). :func:`derive` cuts each order into buckets
of adjacent small groups with :func:`functional_fsdp.core.coalesce.plan_buckets` (the bucket
size: ``fully_shard(..., bucket_bytes=n)`` or ``FSDPModule.set_bucket_bytes(n)`` on the root;
``0`` turns coalescing off), from facts every rank shares, so every rank issues the same
collectives. During a step (``state.py``):

- forward: a group whose bucket has not started starts it (one all-gather for the bucket's
  groups from it on); the bucket's last group prefetches the next bucket, whole;
- backward: the same over the backward buckets, for the groups that gather again in backward;
  each reduce bucket of several groups reduce-scatters in one collective
  (:class:`~functional_fsdp.shell.engine.coalesced.ReduceBucket`), issued by the last of them
  to hand in its gradients. (Cut on the backward's gather order instead, the root shared the
  first reduce bucket with the last blocks and held their gradients, and the bucket's send
  buffer, until the end of the backward.)

A group travels alone when it cannot share a collective: tensor-subclass all-gather codecs,
CPU offload, ``reshard_after_forward=k``, custom collectives, weights tied across groups, a
``fully_shard([m1, m2])`` group, one rank, or a group larger than the bucket. Explicit prefetch
(``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``) on any module wins: the
all-gathers then follow the user's lists, one per group, as without a schedule (the
reduce-scatters still coalesce).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from ...core.coalesce import Bucket, CommunicationSchedule
from ...core.plan import GroupPlanFacts, derive_plan, gathers_together
from ..comm.custom import base_comm
from ..engine.coalesced import ReduceBucket
from ..engine.group import ParamGroup
from ..engine.tied import TiedUse

__all__ = ["DEFAULT_BUCKET_BYTES", "StepPlan", "Scheduled", "derive"]


class Scheduled(Protocol):
    """What the schedule reads of a module's FSDP state (``state.FSDPState`` is one)."""

    name: str
    group: ParamGroup | None
    tied: list[TiedUse]


# Chosen by measurement (benchmarks/bench_step.py --model deep --bucket-bytes ...; README).
DEFAULT_BUCKET_BYTES = 4 << 20


@attrs.frozen(eq=False)
class StepPlan:
    """The root's derived schedule: the record, and each state's bucket per phase.

    Attributes:
        record: the :class:`~functional_fsdp.core.coalesce.CommunicationSchedule`.
        gathers: whether all-gathers coalesce (not when a module sets explicit prefetch: the
            user's lists decide when each group gathers; reduce-scatters still coalesce).
        forward: ``id(state)`` -> the states of its forward bucket, in forward order.
        backward: ``id(state)`` -> the states of its backward bucket, in backward order.
        reduce_buckets: the reduce buckets of several groups (cut on the order the groups'
            post-backwards run).
        kept: ``id(state)`` of the states of the last forward bucket that may share a
            collective, when the bucket is no larger than the bucket size: their backward
            comes first, so they keep their unsharded buffer from the forward (registered
            sharded as any resharded group) instead of freeing it and gathering it again at
            once.
        forward_next: ``id(state)`` -> the state its forward prefetches (the plan's
            ``forward_prefetch``).
        backward_next: ``id(state)`` -> the state its backward prefetches.
    """

    record: CommunicationSchedule
    gathers: bool
    forward: dict[int, tuple[Scheduled, ...]]
    backward: dict[int, tuple[Scheduled, ...]]
    reduce_buckets: tuple[ReduceBucket, ...]
    kept: frozenset[int] = frozenset()
    forward_next: dict[int, Scheduled] = attrs.field(factory=dict)
    backward_next: dict[int, Scheduled] = attrs.field(factory=dict)

    def rest(self, state: Scheduled, backward: bool) -> tuple[Scheduled, ...]:
        """The states of ``state``'s bucket from ``state`` on (``()``: not scheduled)."""
        bucket = (self.backward if backward else self.forward).get(id(state), ())
        return bucket[bucket.index(state) :] if bucket else ()

    def keeps(self, state: Scheduled) -> bool:
        """Whether ``state`` keeps its unsharded buffer from its forward for the backward
        (it is in the last forward bucket; see :attr:`kept`)."""
        return id(state) in self.kept

    def is_last(self, state: Scheduled, backward: bool) -> bool:
        """Whether ``state`` ends its bucket (it prefetches the next one)."""
        bucket = (self.backward if backward else self.forward).get(id(state), ())
        return bool(bucket) and bucket[-1] is state


def _facts(state: Scheduled) -> GroupPlanFacts:
    """What the plan reads of a state's group: its bytes, its route (a bucket never changes
    process group or wire dtype) and whether it may share a collective now (the engine asks
    the same rule again at every start: ``ParamGroup.coalesce_gather``)."""
    g = state.group
    assert g is not None
    base = base_comm(g.comm)
    return GroupPlanFacts(
        unsharded_bytes=g.layout.unsharded_bytes,
        route=(id(base.group) if base is not None else None, g.layout.gather_buffer_dtype),
        shares=gathers_together(attrs.evolve(g.sharing_facts(), tied=bool(state.tied))),
    )


def _first_uses(order: Sequence[Scheduled]) -> list[Scheduled]:
    """``order``'s states with a group, each group at its first place only (in the forward
    order: its first use, where its pre-forward made the ``UnshardFn`` node whose backward is
    its post-backward)."""
    seen: set[int] = set()
    out = []
    for s in order:
        if s.group is not None and id(s.group) not in seen:
            seen.add(id(s.group))
            out.append(s)
    return out


def derive(
    forward_order: Sequence[Scheduled],
    post_forward_order: Sequence[Scheduled],
    groups: Sequence[ParamGroup],
    bucket_bytes: int,
    *,
    gathers: bool = True,
) -> StepPlan:
    """The schedule of a root's recorded orders with buckets of ``bucket_bytes``
    (:func:`~functional_fsdp.core.plan.derive_plan`); gives each group of a reduce bucket
    of several groups that bucket's reduce-scatter (and every other of the root's ``groups``
    none)."""
    fwd = _first_uses(forward_order)
    backward_order = list(post_forward_order)[::-1]
    bwd = _first_uses(backward_order)
    states = {id(s): s for s in (*forward_order, *backward_order)}
    name = {k: f"{s.name}#{i}" for i, (k, s) in enumerate(states.items())}
    by_name = {name[k]: s for k, s in states.items()}
    planned = {id(s) for s in (*fwd, *bwd)}
    plan = derive_plan(
        [name[id(s)] for s in fwd],
        [name[id(s)] for s in bwd],
        [name[id(s)] for s in fwd[::-1]],
        {name[k]: _facts(s) for k, s in states.items() if k in planned},
        bucket_bytes,
        # (A last forward that reuses a group used before ends in no bucket of its own.)
        keep_last=bool(forward_order) and forward_order[-1] is fwd[-1],
        forward_uses=[name[id(s)] for s in forward_order],
        backward_uses=[name[id(s)] for s in backward_order],
        gathering={n for n, s in by_name.items() if s.group is not None or s.tied},
    )

    def shown(bs: tuple[Bucket, ...]) -> tuple[Bucket, ...]:
        return tuple(
            Bucket(tuple(by_name[n].name for n in b.groups), b.unsharded_bytes) for b in bs
        )

    def members(m: Mapping[str, tuple[str, ...]]) -> dict[int, tuple[Scheduled, ...]]:
        return {id(by_name[n]): tuple(by_name[x] for x in b) for n, b in m.items()}

    for g in groups:
        g.join_reduce_bucket(None)
    reduce_buckets = []
    for names in plan.reduce:
        reducers = [r for n in names if (r := by_name[n].group) is not None]
        bucket = ReduceBucket(reducers)
        for r in reducers:
            r.join_reduce_bucket(bucket)
        reduce_buckets.append(bucket)
    sched = plan.schedule
    record = CommunicationSchedule(
        sched.bucket_bytes, shown(sched.forward), shown(sched.backward), shown(sched.reduce)
    )
    kept = frozenset(id(by_name[n]) for n in plan.kept)
    return StepPlan(
        record,
        gathers,
        members(plan.forward),
        members(plan.backward),
        tuple(reduce_buckets),
        kept,
        {id(by_name[a]): by_name[b] for a, b in plan.forward_prefetch.items()},
        {id(by_name[a]): by_name[b] for a, b in plan.backward_prefetch.items()},
    )
