"""The functional path runs on the group life cycle: every action the machine can hand a
functional call, for the events the functional path sends, is one the call carries out or one
its callers own (a new action in the machine fails here, not in a rank at run time)."""

from __future__ import annotations

import itertools

import pytest

from functional_fsdp.core.errors import LifecycleError
from functional_fsdp.core.lifecycle import Event, LifecycleConfig, Phase, advance
from functional_fsdp.shell.engine import functional_path as fp

# What functional_call, GatherCall and LentCall send.
EVENTS = (
    Event.PRE_FORWARD,
    Event.POST_FORWARD,
    Event.PREFETCH_FOR_BACKWARD,
    Event.PRE_BACKWARD,
    Event.RETURNED_BACKWARD,
    Event.LENT_FULL,
    Event.LENT_LIVE,
    Event.LENT_DONE,
)
FACTS = ({}, {"grad": True}, {"keep": True}, {"after_backward": True})


@pytest.mark.parametrize(
    "config",
    [
        LifecycleConfig(reshard_after_forward=r, reshard_after_backward=b, lends=lends)
        for r, b, lends in itertools.product((True, False), (True, False), (True, False))
    ],
    ids=str,
)
def test_every_action_of_a_call_has_an_interpreter(config: LifecycleConfig) -> None:
    handled = set(fp._CARRY_OUT) | fp.CALLERS_ACTS
    assert not set(fp._CARRY_OUT) & fp.CALLERS_ACTS
    seen, frontier, emitted = {Phase()}, [Phase()], set()
    while frontier and len(seen) < 400:  # the counters grow: a bounded walk
        p = frontier.pop()
        for e, facts in itertools.product(EVENTS, FACTS):
            try:
                q, acts = advance(p, e, config, **facts)
            except LifecycleError:
                continue
            emitted |= set(acts)
            if q not in seen and q.lent_open < 3 and q.grad_uses < 3:
                seen.add(q)
                frontier.append(q)
    assert emitted - handled == set()
    assert len(seen) > 20  # the walk went somewhere
