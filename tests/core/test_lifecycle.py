"""The group life cycle (``core/lifecycle.py``) model-checked in one process.

A hypothesis state machine drives :func:`advance` the way the module hooks do (forwards with
and without autograd, a module called twice, backwards in any order, activation-checkpoint
recomputes, ``torch.autograd.grad`` with and without ``create_graph``, tied weights used by
another group, explicit ``unshard()``/``reshard()``, ``summon_full_params``, faults mid-forward
and the reset after them, accumulation without the last backward) under every setting, and
carries the returned actions out on a model of the shell (a buffer that is live or not, what
the modules hold, the reductions issued). After every step it checks the life cycle's
promises:

- the machine's storage says what the buffer holds, and every gathered buffer is freed exactly
  once by the step's end (no free of a buffer not held: each ``FREE`` frees something);
- no reduction is skipped or doubled: each use's backward issues one, and exactly one of a
  micro-batch's closes it (``REDUCE_LAST``), on the last use;
- after any forward the modules hold the sharded parameters unless an explicit ``unshard()``
  holds the full ones;
- a fault mid-forward and ``reset_iter_state()`` lead to the initial phase, from which the next
  forward is clean;
- an event the stage does not take raises ``LifecycleError`` naming the group and the stage.

``test_model_checking_catches_a_seeded_bug`` shows that the machine test fails on a broken
``advance`` (the bug of a module used twice: every use's reduction closing the micro-batch).
"""

from __future__ import annotations

from typing import Any

import attrs
import hypothesis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from functional_fsdp.core import lifecycle as L
from functional_fsdp.core.errors import LifecycleError, StateError
from functional_fsdp.core.lifecycle import Act, Event, LifecycleConfig, Phase, Stage, Storage

FULL_REGISTERING = {
    Act.REGISTER_OUTPUTS,
    Act.REGISTER_REGISTERED,
    Act.REGISTER_RECOMPUTE,
    Act.REGISTER_VIEWS,
}

configs = st.builds(
    LifecycleConfig,
    forward_users=st.sampled_from([1, 2]),
    reshard_after_forward=st.sampled_from([True, False, 2]),
    reshard_after_backward=st.booleans(),
    unshard_in_backward=st.booleans(),
    trains=st.booleans(),
    lends=st.booleans(),
    offload=st.booleans(),
)


@attrs.define
class Shell:
    """What the shell's interpreter does with the actions, as a model."""

    live: bool = False  # the unsharded buffer holds the full parameters
    gathers: int = 0
    frees: int = 0
    registered: str = "sharded"
    reductions: int = 0  # reductions issued in this backward
    closes: int = 0  # REDUCE_LAST in this micro-batch
    holding: bool = False  # a use's gradients are held (HOLD_USE) and not yet reduced
    log: list[str] = attrs.Factory(list)

    def carry_out(self, acts: tuple[Act, ...], *, strict: bool = True) -> None:
        for a in acts:
            self.log.append(a.name)
            if a is Act.WAIT_GATHER:
                if not self.live:
                    self.live, self.gathers = True, self.gathers + 1
            elif a is Act.FREE:
                # Strict: the machine frees only what it holds (each buffer freed once).
                assert self.live or not strict, f"FREE of a buffer not held: {self.log[-12:]}"
                if self.live:
                    self.live, self.frees = False, self.frees + 1
            elif a is Act.REGISTER_SHARDED:
                self.registered = "sharded"
            elif a in FULL_REGISTERING:
                self.registered = "full"
            elif a is Act.HOLD_USE:
                self.reductions += 1
                self.holding = True
            elif a is Act.REDUCE_RETURNED:
                self.reductions += 1
            elif a is Act.REDUCE_LAST:
                self.reductions += 1
                self.closes += 1
                self.holding = False
            elif a is Act.CLOSE_USES:
                self.closes += self.holding
                self.holding = False


class LifecycleMachine(RuleBasedStateMachine):
    """Legal event sequences of one group, as the hooks produce them."""

    @initialize(config=configs)
    def start(self, config: LifecycleConfig) -> None:
        self.c = config
        self.p = Phase()
        self.shell = Shell()
        self.open_iteration = False
        self.tracked_uses = 0  # this micro-batch's uses whose backward reduces
        self.backwards_done = 0
        self.held = False  # an explicit unshard() holds the full parameters
        self.lent_open = 0  # another group's uses of a tied weight, open now
        self.double_backward = False
        self.no_grad_uses = 0  # modules' forwards under no_grad whose recompute may still record
        self.recomputed = 0  # reentrant recomputes in this micro-batch

    # --------------------------------------------------------------- driving

    def ev(self, e: Event, *, strict: bool = True, **facts: Any) -> tuple[Act, ...]:
        self.p, acts = L.advance(self.p, e, self.c, group="blocks.0", **facts)
        self.shell.carry_out(acts, strict=strict)
        return acts

    def _begin_iteration(self) -> None:
        if not self.open_iteration:
            self.ev(Event.START_ITERATION)
            self.open_iteration = True
            self.shell.reductions = 0

    @precondition(lambda self: self.p.stage is Stage.IDLE and self.lent_open == 0)
    @rule(grad=st.booleans(), uses=st.integers(1, 3))
    def forward(self, grad: bool, uses: int) -> None:
        """The group's modules run their forward (every module of a list-form group), once
        or several times in a row (a module called twice in one forward)."""
        self._begin_iteration()
        self.held = False
        for _ in range(uses):
            self._one_forward(grad)

    def _one_forward(self, grad: bool) -> None:
        for _ in range(self.c.forward_users):
            # A use whose backward reduces is one whose outputs are made now (a lending
            # group's later uses take the iteration's outputs: one backward for all of them).
            if Act.MAKE_OUTPUTS in self.ev(Event.PRE_FORWARD, grad=grad):
                self.tracked_uses += 1
            assert self.shell.live and self.shell.registered == "full"
        self.no_grad_uses += self.c.forward_users * (not grad)
        for i in range(self.c.forward_users):
            self.ev(Event.POST_FORWARD)
            if i < self.c.forward_users - 1:
                assert self.p.stage is Stage.FORWARD
        assert self.p.stage is Stage.IDLE
        assert self.shell.registered == "sharded", "a forward left the full parameters on"

    @precondition(
        lambda self: self.p.stage is Stage.IDLE and self.lent_open == 0 and self.c.forward_users > 1
    )
    @rule(grad=st.booleans(), runs=st.integers(1, 4))
    def forward_of_some_modules(self, grad: bool, runs: int) -> None:
        """A list-form group's modules run ``runs`` times in all, one after another, in any
        pattern (one module alone, or one again after the group closed), then the root's
        forward ends: the group is closed and its modules hold the sharded parameters."""
        self._begin_iteration()
        self.held = False
        for _ in range(runs):
            if Act.MAKE_OUTPUTS in self.ev(Event.PRE_FORWARD, grad=grad):
                self.tracked_uses += 1
            assert self.shell.live and self.shell.registered == "full"
            self.ev(Event.POST_FORWARD)
        self.no_grad_uses += runs * (not grad)
        self.ev(Event.FORWARD_ENDS)
        assert self.p.stage is Stage.IDLE, f"the root's forward end left {self.p}"
        assert self.shell.registered == "sharded", "a forward left the full parameters on"

    @precondition(lambda self: self.p.stage is Stage.IDLE and self.lent_open == 0)
    @rule()
    def fault_mid_forward_then_reset(self) -> None:
        """A forward raises; the next forward (or the user) resets the iteration."""
        self._begin_iteration()
        self.ev(Event.PRE_FORWARD, grad=True)
        self.ev(Event.RESET, strict=False)
        assert self.p == Phase(), f"reset left {self.p}"
        assert not self.shell.live and self.shell.registered == "sharded"
        self._after_reset()

    def _after_reset(self) -> None:
        self.open_iteration = False
        self.tracked_uses = self.backwards_done = 0
        self.held = self.double_backward = False
        self.lent_open = self.no_grad_uses = self.recomputed = 0
        self.shell.closes = self.shell.reductions = 0
        self.shell.holding = False
        self.shell.gathers = self.shell.frees = 0

    @precondition(lambda self: self.p.stage is not Stage.SUMMON_FULL_PARAMS)
    @rule()
    def reset(self) -> None:
        """``reset_iter_state()`` at any point outside summon."""
        self.ev(Event.RESET, strict=False)
        assert self.p == Phase()
        assert not self.shell.live and self.shell.registered == "sharded"
        self._after_reset()

    @precondition(
        lambda self: (
            self.tracked_uses > self.backwards_done
            and self.p.stage is not Stage.FORWARD
            and self.p.stage is not Stage.SUMMON_FULL_PARAMS
        )
    )
    @rule(
        recompute=st.booleans(),
        prefetch=st.booleans(),
        every=st.booleans(),
        partial=st.integers(0, 2),
    )
    def backward_of_a_use(self, recompute: bool, prefetch: bool, every: bool, partial: int) -> None:
        """The backward reaches one use's outputs, then its parameters (``.grad``); with
        ``every``, then the other uses' too. ``partial``: plain submodules of the group
        checkpointed reentrantly inside the use, whose nested backwards come first."""
        self._backward_of_a_use(recompute, prefetch, partial)
        while every and self.tracked_uses > self.backwards_done:
            self._backward_of_a_use(recompute, prefetch, partial)

    def _backward_of_a_use(self, recompute: bool, prefetch: bool, partial: int) -> None:
        if prefetch:
            self.ev(Event.PREFETCH_FOR_BACKWARD)
        self.ev(Event.PRE_BACKWARD)
        if self.c.unshard_in_backward:
            assert self.shell.live
        if recompute:
            self.ev(Event.RECOMPUTE)
            assert self.shell.live and self.shell.registered == "full"
        for _ in range(partial):
            # A submodule's recompute read the registered full parameters; its checkpoint's
            # nested backward reaches them (PARTIAL_BACKWARD) with part of this use's
            # gradient: held, not a use. Nothing closes and the parameters stay as they are
            # (the next recompute reads them).
            live, registered, closes = self.shell.live, self.shell.registered, self.shell.closes
            acts = self.ev(Event.PARTIAL_BACKWARD)
            assert acts == (Act.HOLD_USE,), f"a nested backward's part of a use did {acts}"
            assert (self.shell.live, self.shell.registered) == (live, registered)
            assert self.shell.closes == closes and self.shell.holding
        before = self.shell.reductions
        self.ev(Event.POST_BACKWARD)
        self.backwards_done += 1
        assert self.shell.reductions == before + 1, "a use's backward must reduce once"
        last = self.backwards_done == self.tracked_uses and not self._recompute_to_come()
        assert self.shell.closes == (1 if last else 0), (
            f"{self.shell.closes} closing reductions after {self.backwards_done} of "
            f"{self.tracked_uses} uses"
        )

    @precondition(
        lambda self: (
            self.no_grad_uses > 0
            and self.c.trains
            and self.lent_open == 0
            and self.p.stage in (Stage.IDLE, Stage.PRE_BACKWARD, Stage.POST_BACKWARD)
        )
    )
    @rule()
    def reentrant_recompute_and_its_backward(self) -> None:
        """A reentrant checkpoint (``use_reentrant=True``) ran a module's forward under
        no_grad; in the backward its recompute records (``REENTRANT_RECOMPUTE``: the shell
        sends it for a module whose forwards all ran under no_grad) and a nested backward
        reaches the parameters (no pre-backward: the recompute's outputs get no hooks). The
        recompute is a use of its own, as FSDP2's: its backward reduces once, and closes the
        uses when no other use's backward is pending (else the last one's closes them all).
        (A frozen group's recompute registers what it has: nothing reduces.)"""
        if self.backwards_done == self.tracked_uses:
            self.shell.closes = 0  # the uses so far are closed; this recompute opens anew
        acts = self.ev(Event.REENTRANT_RECOMPUTE)
        assert self.shell.live and self.shell.registered == "full"
        assert Act.MAKE_OUTPUTS in acts, f"a recording recompute with no use of its own: {acts}"
        self.no_grad_uses -= 1
        self.recomputed += 1
        self.tracked_uses += 1
        before = self.shell.reductions
        self.ev(Event.POST_BACKWARD)
        self.backwards_done += 1
        assert self.shell.reductions == before + 1, "the recompute's backward must reduce once"
        last = self.backwards_done == self.tracked_uses and not self._recompute_to_come()
        assert self.shell.closes == (1 if last else 0), (
            f"{self.shell.closes} closing reductions after {self.backwards_done} of "
            f"{self.tracked_uses} uses"
        )
        self.shell.closes = 0  # the uses so far are closed; a later recompute opens anew

    def _recompute_to_come(self) -> bool:
        """A no_grad forward that may still be recomputed (a reentrant checkpoint's, known
        only when its recompute comes): the uses stay open (one reduction for all)."""
        return self.no_grad_uses > 0

    @precondition(
        lambda self: (
            self.tracked_uses > self.backwards_done
            and self.p.stage in (Stage.IDLE, Stage.PRE_BACKWARD, Stage.POST_BACKWARD)
        )
    )
    @rule(create_graph=st.booleans())
    def autograd_grad_of_a_use(self, create_graph: bool) -> None:
        """``torch.autograd.grad`` reaches one use's parameters (returned, not into .grad)."""
        self.ev(Event.PRE_BACKWARD)
        self.ev(Event.RETURNED_BACKWARD, grad=create_graph)
        self.backwards_done += 1
        self.double_backward = create_graph
        if create_graph and self.c.unshard_in_backward:
            assert self.shell.live, "a create_graph backward keeps the full parameters"

    @precondition(lambda self: self.open_iteration and self.p.stage is not Stage.FORWARD)
    @rule(last=st.booleans())
    def final_callback(self, last: bool) -> None:
        """The backward is over (every use's, or only some of them)."""
        self.ev(Event.FINAL_CALLBACK, last=last)
        self.no_grad_uses = self.recomputed = 0
        assert not self.shell.holding, "the backward ended with a use's gradients held"
        assert self.p.stage is Stage.IDLE
        assert self.shell.registered == "sharded"
        assert self.p.grad_uses == self.p.backward_uses == 0
        assert self.shell.closes <= 1
        keep = self.double_backward or not self.c.reshard_after_backward
        if not keep:
            assert not self.shell.live, "the step's end left the full parameters"
            assert self.shell.gathers == self.shell.frees, (
                f"{self.shell.gathers} gathers, {self.shell.frees} frees in the step"
            )
        self.open_iteration = False
        self.tracked_uses = self.backwards_done = 0
        self.double_backward = False
        self.lent_open = 0
        self.shell.closes = self.shell.reductions = 0
        if not self.shell.live:
            self.shell.gathers = self.shell.frees = 0

    @precondition(lambda self: self.c.lends and self.p.stage is Stage.IDLE)
    @rule(grad=st.booleans(), backward=st.booleans())
    def tied_use_by_another_group(self, grad: bool, backward: bool) -> None:
        """Another group's module forwards with a tied weight (and maybe runs its backward)."""
        self._begin_iteration()
        if Act.MAKE_OUTPUTS in self.ev(Event.LENT_FULL, grad=grad):
            self.tracked_uses += 1
        self.lent_open += 1
        assert self.shell.live
        self.ev(Event.LENT_DONE, after_backward=False)
        self.lent_open -= 1
        if backward:
            self.ev(Event.LENT_LIVE)
            self.lent_open += 1
            assert self.shell.live
            self.ev(Event.LENT_RECOMPUTE)
            self.ev(Event.LENT_DONE, after_backward=True)
            self.lent_open -= 1

    @precondition(lambda self: self.p.stage is Stage.IDLE and not self.open_iteration)
    @rule()
    def explicit_unshard(self) -> None:
        self.ev(Event.UNSHARD)
        self.held = True
        assert self.shell.live and self.shell.registered == "full"

    @precondition(lambda self: self.p.stage is Stage.IDLE and not self.open_iteration)
    @rule()
    def explicit_reshard(self) -> None:
        self.ev(Event.RESHARD, strict=False)
        self.held = False
        assert not self.shell.live and self.shell.registered == "sharded"
        self.shell.gathers = self.shell.frees = 0

    @precondition(lambda self: self.p.stage is Stage.IDLE and not self.open_iteration)
    @rule(write=st.booleans())
    def summon(self, write: bool) -> None:
        self.ev(Event.ENTER_SUMMON)
        assert self.p.stage is Stage.SUMMON_FULL_PARAMS
        if write:
            self.ev(Event.SHARDS_WRITTEN, strict=False)
            assert not self.shell.live
            self.shell.gathers = self.shell.frees = 0
        self.ev(Event.EXIT_SUMMON)
        self.held = False
        assert self.p.stage is Stage.IDLE and self.shell.registered == "sharded"

    @rule(data=st.data())
    def illegal_event(self, data: st.DataObject) -> None:
        """An event the stage does not take: a named error, the phase unchanged."""
        illegal = [e for e, ok in L._ACCEPTS.items() if self.p.stage not in ok]
        if not illegal:
            return
        e = data.draw(st.sampled_from(illegal))
        before = self.p
        with pytest.raises(LifecycleError) as info:
            L.advance(self.p, e, self.c, group="blocks.0")
        text = str(info.value)
        assert "blocks.0" in text and self.p.stage.value in text and e.name in text
        assert self.p is before

    # --------------------------------------------------------------- invariants

    @invariant()
    def storage_says_what_the_buffer_holds(self) -> None:
        if not hasattr(self, "p"):
            return
        if self.p.storage in (Storage.SHARDED, Storage.ROWS):
            assert not self.shell.live, f"{self.p.storage} with a live buffer"
        elif self.p.storage in (Storage.UNSHARDED, Storage.KEPT):
            assert self.shell.live, f"{self.p.storage} without a live buffer"

    @invariant()
    def idle_modules_hold_the_sharded_parameters(self) -> None:
        if not hasattr(self, "p"):
            return
        if self.p.stage is Stage.IDLE and not self.held:
            assert self.shell.registered == "sharded"


LifecycleMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
test_lifecycle_machine = LifecycleMachine.TestCase


# ------------------------------------------------------------------- single cases


def test_module_called_twice_reduces_each_use_and_closes_on_the_last() -> None:
    c, p = LifecycleConfig(), Phase()
    acts: list[tuple[Act, ...]] = []
    for e, kw in [
        (Event.START_ITERATION, {}),
        (Event.PRE_FORWARD, {"grad": True}),
        (Event.POST_FORWARD, {}),
        (Event.PRE_FORWARD, {"grad": True}),
        (Event.POST_FORWARD, {}),
        (Event.PRE_BACKWARD, {}),
        (Event.POST_BACKWARD, {}),
        (Event.PRE_BACKWARD, {}),
        (Event.POST_BACKWARD, {}),
    ]:
        p, a = L.advance(p, e, c, **kw)
        acts.append(a)
    assert p.grad_uses == 2 and p.backward_uses == 2
    assert Act.HOLD_USE in acts[6] and Act.REDUCE_LAST in acts[8]


def _run(c: LifecycleConfig, events: list[tuple[Event, dict[str, bool]]]) -> list[tuple[Act, ...]]:
    p, acts = Phase(), []
    for e, kw in events:
        p, a = L.advance(p, e, c, **kw)
        acts.append(a)
    assert (p.grad_uses, p.backward_uses, p.no_grad_uses, p.recomputed) == (0, 0, 0, 0), p
    assert not p.holding and p.stage is Stage.IDLE
    return acts


def test_a_module_checkpointed_reentrantly_twice_reduces_once() -> None:
    """Two no_grad forwards, both recomputed in the backward (the later checkpoint's first):
    the first recompute's backward holds, the second's closes, and nothing is left to land."""
    forward = [(Event.PRE_FORWARD, {"grad": False}), (Event.POST_FORWARD, {})]
    recompute = [(Event.REENTRANT_RECOMPUTE, {}), (Event.POST_BACKWARD, {})]
    acts = _run(
        LifecycleConfig(),
        [(Event.START_ITERATION, {}), *forward, *forward, *recompute, *recompute]
        + [(Event.FINAL_CALLBACK, {})],
    )
    assert Act.HOLD_USE in acts[6] and Act.REDUCE_LAST in acts[8]
    assert Act.CLOSE_USES not in acts[9]


def test_gradients_held_for_a_use_the_backward_skipped_are_landed() -> None:
    """A module called twice; one use's backward holds, the other's ran under
    torch.autograd.grad (it reduces its own): the final callback lands what was held. (The
    model-checking found this: the callback counted uses and saw none missing.) With a no_grad
    forward that never recomputes, the same."""
    twice = [(Event.PRE_FORWARD, {"grad": True}), (Event.POST_FORWARD, {})] * 2
    acts = _run(
        LifecycleConfig(),
        [(Event.START_ITERATION, {}), *twice, (Event.PRE_BACKWARD, {}), (Event.POST_BACKWARD, {})]
        + [(Event.PRE_BACKWARD, {}), (Event.RETURNED_BACKWARD, {}), (Event.FINAL_CALLBACK, {})],
    )
    assert Act.HOLD_USE in acts[6] and Act.CLOSE_USES in acts[9]
    no_grad = [(Event.PRE_FORWARD, {"grad": False}), (Event.POST_FORWARD, {})] * 2
    acts = _run(
        LifecycleConfig(),
        [(Event.START_ITERATION, {}), *no_grad, (Event.REENTRANT_RECOMPUTE, {})]
        + [(Event.POST_BACKWARD, {}), (Event.FINAL_CALLBACK, {})],
    )
    assert Act.HOLD_USE in acts[6] and Act.CLOSE_USES in acts[7]


def test_illegal_event_names_the_group_the_stage_and_the_fix() -> None:
    with pytest.raises(LifecycleError, match=r"'layers\.3' got POST_FORWARD .* stage 'idle'"):
        L.advance(Phase(), Event.POST_FORWARD, LifecycleConfig(), group="layers.3")
    with pytest.raises(StateError, match="accepted only in 'summon_full_params'"):
        L.advance(Phase(), Event.EXIT_SUMMON, LifecycleConfig())
    inside = attrs.evolve(Phase(), stage=Stage.SUMMON_FULL_PARAMS)
    with pytest.raises(LifecycleError, match="Leave summon_full_params"):
        L.advance(inside, Event.PRE_FORWARD, LifecycleConfig(), grad=True)


def test_every_event_has_a_handler() -> None:
    assert set(L._HANDLERS) == set(Event)


def _hunt() -> None:
    """Run the machine test long enough to find a planted bug (the same search every run).
    Generation only: the test needs the failure, not its smallest form (shrinking took 80 %
    of the time: 7.4 s against 0.7 s for the three hunts)."""
    run_state_machine_as_test(
        LifecycleMachine,
        settings=settings(
            max_examples=300,
            stateful_step_count=30,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[hypothesis.Phase.generate],
            suppress_health_check=list(hypothesis.HealthCheck),
        ),
    )


def test_model_checking_catches_a_seeded_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded bug: every use's reduction closes the micro-batch (the double reduction of a
    module called twice). The machine test finds it."""

    def every_use_closes(p: Phase, c: LifecycleConfig, *rest: bool) -> L.Step:
        p2, acts = _post_backward(p, c, *rest)
        return p2, tuple(Act.REDUCE_LAST if a is Act.HOLD_USE else a for a in acts)

    _post_backward = L._HANDLERS[Event.POST_BACKWARD]
    monkeypatch.setitem(L._HANDLERS, Event.POST_BACKWARD, every_use_closes)
    with pytest.raises(AssertionError, match="closing reductions"):
        _hunt()


def test_model_checking_catches_a_nested_backward_taken_for_a_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fourth seeded bug: a nested backward's part of a use (a reentrant checkpoint of a
    plain submodule) is taken for the use's own backward, as before PARTIAL_BACKWARD existed:
    it resharded the group under the next recompute ("got mixed torch.Tensor and DTensor")
    and reduced twice."""

    def as_a_use(p: Phase, c: LifecycleConfig, *rest: bool) -> L.Step:
        return L._post_backward(p, c, *rest)

    monkeypatch.setitem(L._HANDLERS, Event.PARTIAL_BACKWARD, as_a_use)
    with pytest.raises(AssertionError, match="nested backward's part"):
        _hunt()


def test_model_checking_catches_uses_closed_before_a_recompute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fifth seeded bug, the rule before 2026-12-01: the uses close while a no_grad forward
    is still to be recomputed, unless a recompute already came (a list-form group whose
    recorded module's backward precedes the other's reentrant recompute reduced twice)."""

    def closes_early(p: Phase, uses: int) -> bool:
        return uses >= p.grad_uses and not 0 < p.recomputed < p.no_grad_uses

    monkeypatch.setattr(L, "_closes", closes_early)
    with pytest.raises(AssertionError, match="closing reductions"):
        _hunt()


def test_model_checking_catches_a_leaked_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second seeded bug: the final callback forgets to free when the group's backward
    never ran (a forward under no_grad, a use whose output the loss ignores)."""

    def keeps_the_buffer(p: Phase, c: LifecycleConfig, *rest: bool) -> L.Step:
        p2, acts = _final(p, c, *rest)
        if p.ran_post_backward:
            return p2, acts
        return attrs.evolve(p2, storage=p.storage), tuple(a for a in acts if a is not Act.FREE)

    _final = L._HANDLERS[Event.FINAL_CALLBACK]
    monkeypatch.setitem(L._HANDLERS, Event.FINAL_CALLBACK, keeps_the_buffer)
    with pytest.raises(AssertionError):
        _hunt()


def test_model_checking_catches_a_list_group_left_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """A third seeded bug: the root's forward end leaves a list-form group open when its
    modules did not each finish the forward once (the next forward then ran on the last
    forward's full tensors: a 33% wrong or missing gradient)."""

    def stays_open(p: Phase, c: LifecycleConfig, *rest: bool) -> L.Step:
        return p, ()

    monkeypatch.setitem(L._HANDLERS, Event.FORWARD_ENDS, stays_open)
    with pytest.raises(AssertionError, match="forward end left"):
        _hunt()


# ------------------------------------------------------------------- the root's iteration


@given(events=st.lists(st.sampled_from(list(L.RootEvent)), max_size=30))
def test_the_root_resets_a_raised_iteration_before_the_next_forward(events: list) -> None:
    """Over any sequence of root events: a forward that begins after a raised forward or a
    raised finish, or while a backward's callback is queued, resets first; one callback is
    queued per backward; a reset keeps only the recorded order."""
    p = L.RootPhase()
    for e in events:
        q, acts = L.advance_root(p, e)
        if e is L.RootEvent.FORWARD_BEGINS:
            assert (L.RootAct.RESET_FIRST in acts) == (p.interrupted or p.callback_queued)
            assert q.in_forward and not q.interrupted and not q.callback_queued
        if e is L.RootEvent.BACKWARD_BEGINS:
            assert (L.RootAct.QUEUE_CALLBACK in acts) == (not p.callback_queued)
            assert q.callback_queued
        if e is L.RootEvent.RESET:
            assert q == L.RootPhase(order_recorded=p.order_recorded)
        if e in (L.RootEvent.FORWARD_RAISED, L.RootEvent.FINISH_RAISED):
            assert q.interrupted and not acts
        assert q.order_recorded >= p.order_recorded  # once recorded, the order stays
        p = q


def test_model_checking_catches_a_reentrant_recompute_without_a_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fourth seeded bug, the engine as it was: a recording recompute of a forward that ran
    under no_grad (a reentrant checkpoint) registers the plain full tensors, so its backward
    reaches no reduction (FSDP2 reduces it; its gradients were lost, then refused by name)."""

    def registers_what_it_has(p: Phase, c: LifecycleConfig, *rest: bool) -> L.Step:
        return attrs.evolve(p, storage=Storage.UNSHARDED), (
            Act.WAIT_GATHER,
            Act.REGISTER_RECOMPUTE,
        )

    monkeypatch.setitem(L._HANDLERS, Event.REENTRANT_RECOMPUTE, registers_what_it_has)
    with pytest.raises(AssertionError, match="a recording recompute with no use of its own"):
        _hunt()
