"""Per-module FSDP state: forward/backward hooks, root logic, prefetching."""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.autograd import Variable

from ...core.coalesce import CommunicationSchedule
from ...core.errors import PolicyError, ReproducibilityError, StateError, TiedParameterError
from ...core.lifecycle import RootAct, RootEvent, RootPhase, advance_root
from ...core.records import MixedPrecisionPolicy
from ..comm.scoped import introduce, resync
from ..device.runtime import DeviceRuntime
from ..engine.coalesced import start_together
from ..engine.gradients import ReduceChain
from ..engine.group import ParamGroup
from ..engine.group_common import profiled, traced
from ..engine.local_step import restore_raised
from ..engine.tied import LentCall, TiedUse
from . import buckets, functional_call

__all__ = ["FSDPState", "hooks_for", "register_fsdp_forward_method"]

_log = logging.getLogger("functional_fsdp")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class FSDPState:
    """State of one module passed to ``fully_shard``: its group (if any) and root bookkeeping."""

    def __init__(
        self,
        module: nn.Module,
        group: ParamGroup | None,
        mp_policy: MixedPrecisionPolicy,
        name: str,
    ) -> None:
        self.module = module
        self.group = group
        self.mp_policy = mp_policy
        self.name = name
        self.root: FSDPState | None = None
        self.explicit_forward_prefetch: list[FSDPState] | None = None
        self.explicit_backward_prefetch: list[FSDPState] | None = None
        # Root-only bookkeeping.
        self.all_states: list[FSDPState] = []
        # The groups of several modules (fully_shard([m1, m2])): the root's forward closes
        # one whose modules did not each finish it once (ParamGroup.forward_ends).
        self.list_groups: list[ParamGroup] = []
        self.forward_order: list[FSDPState] = []
        # Backward runs in reverse post-forward order (the root finishes forward last and
        # starts backward first; then the last block).
        self.post_forward_order: list[FSDPState] = []
        # Root: the iteration's control state (core/lifecycle.py RootPhase), advanced only by
        # _root_event; in_forward, callback_queued, interrupted, order_recorded read it.
        self.root_phase = RootPhase()
        self._root_transitions: dict[tuple[Any, ...], tuple[RootPhase, tuple[RootAct, ...]]] = {}
        self.is_last_backward = True
        self.user_reshard_after_forward: bool | int | None = None
        # Nesting depth of this state's forward (a forward method registered with
        # register_fsdp_forward_method that calls forward runs the hooks twice).
        self.depth = 0
        # Where this forward's parameters come from: None for the group's own shards (its
        # persistent GatherSlot), else the record of a forward over caller-passed sources
        # (functional_call / torch.func; shell/functional_path.py, a GatherSlot per call).
        self.functional: functional_call.Functional | None = None
        # One token per module call in progress (the post hook marks it; the always-called
        # exit hook pops it): an unmarked token means the forward raised.
        self.calls: list[list[bool]] = []
        # Root: the event the user recorded after the optimizer step (set_post_optim_event):
        # the next forward's gather streams wait for it, then it is dropped (FSDP2's).
        self.post_optim_event: Any = None
        # Parameters of other groups that this state's modules use (weights tied across
        # groups, engine/tied.py), and the root's: the lending groups' gathers of the
        # functional forward in progress, by group.
        self.tied: list[TiedUse] = []
        self.lent_calls: dict[int, LentCall] = {}
        # This iteration's forwards of this state's modules, by module id: bit 1 when one ran
        # under no_grad, bit 2 when one recorded. A recording recompute of a module whose
        # forwards all ran under no_grad is a reentrant checkpoint's (the life cycle's
        # REENTRANT_RECOMPUTE); the root's forward clears it.
        self.forward_grads: dict[int, int] = {}
        # The bucket size of the communication schedule (the root's governs; None: the
        # default), and the root's schedule, derived after its first forward (buckets.py).
        self.bucket_bytes: int | None = None
        self._plan: buckets.StepPlan | None = None

    @property
    def is_root(self) -> bool:
        return self.root is self

    # ------------------------------------------------------------------ the root's iteration

    @property
    def in_forward(self) -> bool:
        """Root: a forward through it is running."""
        return self.root_phase.in_forward

    @property
    def callback_queued(self) -> bool:
        """Root: the backward began and its final callback is queued."""
        return self.root_phase.callback_queued

    @property
    def interrupted(self) -> bool:
        """Root: a forward raised since the last reset (the next forward resets first)."""
        return self.root_phase.interrupted

    @property
    def order_recorded(self) -> bool:
        """Root: the first forward recorded the order its groups run in."""
        return self.root_phase.order_recorded

    def _root_answer(self, event: RootEvent) -> tuple[RootPhase, tuple[RootAct, ...]]:
        """:func:`~functional_fsdp.core.lifecycle.advance_root` from the root's phase now
        (pure, so remembered: a steady step's root events are lookups)."""
        key = (self.root_phase, event)
        known = self._root_transitions.get(key)
        if known is None:
            known = self._root_transitions[key] = advance_root(self.root_phase, event)
        return known

    def _root_event(self, event: RootEvent) -> tuple[RootAct, ...]:
        """Advance the root's iteration; return the actions to carry out."""
        self.root_phase, acts = self._root_answer(event)
        return acts

    # ------------------------------------------------------------------ lazy init

    def lazy_init(self) -> None:
        """Make this state the root of every FSDP state below it (first forward)."""
        if self.root is not None:
            return
        states = [
            s for m in self.module.modules() if (s := getattr(m, "_ffsdp_state", None)) is not None
        ]
        for s in states:
            if s.root is not None:
                raise StateError(
                    f"FSDP module {s.name!r} ran forward before its ancestor {self.name!r} and became a "
                    f"root itself; try running forward through the root module first (call "
                    f"model(x) on {self.name!r}, not a submodule), or build the model again and "
                    "apply fully_shard afresh"
                )
        from ..io.reload import readopt_replaced

        for s in states:
            # A parameter replaced on its module since fully_shard (e.g. a meta parameter
            # swapped for a real one) is sharded and adopted, as FSDP2 re-registers at lazy init
            # (not a functional_call / torch.func substitute: a plain or wrapped tensor).
            if s.group is not None and not torch._C._are_functorch_transforms_active():
                readopt_replaced(
                    s.group,
                    "a parameter replaced before the first forward",
                    parameters_only=True,
                    warn_new_objects=True,
                )
        for s in states:
            if s.group is not None and s.group.state.flat.is_meta:
                raise StateError(
                    f"the parameters of {s.name!r} are on the meta device: FSDP parameters must be "
                    "materialized from meta device before the first forward; call "
                    "model.to_empty(device=...) and initialise them, or load a state dict"
                )
        _check_one_reproducible_policy(self, states)
        seen: dict[int, str] = {}
        seen_groups: set[int] = set()
        for s in states:
            s.root = self
            # fully_shard([m1, m2]) gives both states one group: check each group once.
            if s.group is not None and id(s.group) not in seen_groups:
                seen_groups.add(id(s.group))
                for p in s.group.params:
                    if id(p) in seen:
                        from ...core.errors import TiedParameterError

                        raise TiedParameterError(
                            f"a parameter is managed by both {seen[id(p)]!r} and {s.name!r}; tie it "
                            "within one group (fully_shard a common parent) or untie it"
                        )
                    seen[id(p)] = s.name
        _check_tied_under_root(self, states)
        self.all_states = states
        lists = {id(s.group): s.group for s in states if s.group and s.group.forward_users > 1}
        self.list_groups = list(lists.values())
        # Collectives that wait past the grace period name their group by module path.
        paths = {id(m): p for p, m in self.module.named_modules()}
        named: dict[int, tuple[str, list[Any]]] = {}
        for s in states:  # a fully_shard([m1, m2]) group is named after its first module
            if s.group is not None and id(s.group) not in named:
                label = paths.get(id(s.module)) or f"{s.name} (the root)"
                named[id(s.group)] = (label, s.group.comms())
        introduce(list(named.values()))
        chain = ReduceChain()
        # One device runtime per model (one set of streams and events): the root's group's,
        # else the first group's (states start with the root).
        runtime = self.runtime()
        for s in states:
            if s.group is not None:
                s.group.join_reduce_chain(chain)
                if runtime is not None:
                    s.group.use_runtime(runtime)
        if self.group is not None and self.user_reshard_after_forward is None:
            self.group.configure(reshard_after_forward=False)

    # ------------------------------------------------------------------ forward

    def runtime(self) -> DeviceRuntime | None:
        """Root: the model's one device runtime (its first group's: the root's, if it has a
        group; lazy init gives it to every group)."""
        return next((s.group.runtime for s in self.all_states if s.group is not None), None)

    def _wait_post_optim_event(self) -> None:
        """Root: the gather streams wait for the user's post-optimizer event (an optimizer step
        on another stream writes the shards this forward gathers), once."""
        event, self.post_optim_event = self.post_optim_event, None
        if event is None:
            return
        runtime = self.runtime()
        if runtime is not None:
            for role in ("copy_in", "all_gather"):
                runtime.wait_user_event(runtime.side_stream(role), event)

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Unshard this group (consuming a prefetch), prefetch the next, register full params."""
        label = "root_pre_forward" if self.root is None or self.is_root else "pre_forward"
        with profiled(lambda: f"FSDP::{label} ({self.name})"):
            return self._pre_forward(module, args, kwargs)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.root is None:
            self.lazy_init()
        root = self.root
        assert root is not None
        g = self.group
        if (
            self.is_root
            and not _in_backward()
            and RootAct.RESET_FIRST in root._root_answer(RootEvent.FORWARD_BEGINS)[1]
        ):
            # The previous forward raised, or a backward raised before its final callback ran
            # (the callback is still queued: reductions in flight, groups mid-backward), and
            # nobody called reset_iter_state(). Do now what it does, on every rank alike.
            _log.warning(
                "functional_fsdp: the previous forward or backward of %r raised; resetting its "
                "iteration state (reset_iter_state()) before this forward",
                self.name,
            )
            self.reset()
        if _in_backward():
            # Activation-checkpoint recompute: only make sure the parameters are unsharded.
            for use in self.tied:
                use.refuse_reentrant()
            if g is not None:
                reentrant = torch.is_grad_enabled() and self.forward_grads.get(id(module)) == 1
                g.unshard_for_recompute(reentrant=reentrant)
            for use in self.tied:
                use.recompute()
            return args, kwargs
        self.depth += 1
        if self.depth > 1:
            return args, kwargs
        # (A reset the machine asks for ran above, with its warning.)
        if self.is_root and RootAct.START_ITERATIONS in root._root_event(RootEvent.FORWARD_BEGINS):
            restore_raised()  # an optimizer step that raised since the last forward
            for s in root.all_states:
                s.forward_grads.clear()
                if s.group is not None:
                    s.group.start_iteration()
            self._wait_post_optim_event()
        self.forward_grads[id(module)] = self.forward_grads.get(id(module), 0) | (
            2 if torch.is_grad_enabled() else 1
        )
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        if not root.order_recorded:
            root.forward_order.append(self)
        # The parameter source: tensors the caller registered (functional_call, torch.func)
        # are gathered per call by the same engine; otherwise the group's own shards below.
        if functional_call.pre_forward(self):
            return args, kwargs
        plan = root.plan()
        if plan is not None and plan.gathers and root.in_forward and plan.rest(self, False):
            # The derived schedule: this group's bucket starts (if its prefetch did not), and
            # the bucket's last group prefetches the next bucket, whole.
            start_together(_not_run(plan.rest(self, backward=False)))
            nxt = self.forward_prefetch_targets() if plan.is_last(self, backward=False) else []
            prefetch = _not_run(plan.rest(nxt[0], backward=False)) if nxt else []
            together = True
        else:
            prefetch, together = _groups(self.forward_prefetch_targets()), False
        if g is not None:
            g.pre_forward(prefetch, together=together)
        elif together:
            start_together(prefetch)
        else:
            for pg in prefetch:
                pg.start_unshard()
        for use in self.tied:  # weights of other groups: their owner's full tensors
            use.pre_forward()
        return args, kwargs

    def plan(self) -> buckets.StepPlan | None:
        """Root: the step's communication plan, derived from the recorded order on first use
        (``None`` before the first forward recorded it, or with coalescing off)."""
        p = self.derived_plan()
        return p if p is not None and p.record.bucket_bytes > 0 else None

    def derived_plan(self) -> buckets.StepPlan | None:
        """Root: the step's plan, buckets or none (``None`` before the first forward recorded
        the order): the prefetch targets are the plan's at any bucket size."""
        if not self.order_recorded:
            return None
        if self._plan is None:
            size = buckets.DEFAULT_BUCKET_BYTES if self.bucket_bytes is None else self.bucket_bytes
            groups = [s.group for s in self.all_states if s.group is not None]
            explicit = any(
                s.explicit_forward_prefetch is not None or s.explicit_backward_prefetch is not None
                for s in self.all_states
            )
            self._plan = buckets.derive(
                self.forward_order,
                self.post_forward_order,
                groups,
                size,
                gathers=not explicit,
            )
        return self._plan

    def schedule_record(self) -> CommunicationSchedule:
        """Root: the schedule as a record (after the first forward; bucket size 0 too)."""
        self.plan()
        assert self._plan is not None, "schedule_record before the first forward"
        return self._plan.record

    def set_bucket_bytes(self, n: int) -> None:
        """Root: the bucket size from now on (the schedule is derived again)."""
        self.bucket_bytes = n
        self.forget_plan()

    def forget_plan(self) -> None:
        """Root: derive the schedule again at its next use (a setting it reads changed)."""
        self._plan = None
        for s in self.all_states:
            if s.group is not None:
                s.group.join_reduce_bucket(None)

    def forward_prefetch_targets(self) -> list[FSDPState]:
        """The states whose groups this one's forward prefetches (explicit, else the next
        group in the root's forward order, inside a root forward only)."""
        if self.explicit_forward_prefetch is not None:
            return [s for s in self.explicit_forward_prefetch if s.group is not None]
        root = self.root
        # Only inside a root forward: a submodule run on its own must not leave a gather in
        # flight that could go stale across an optimizer step.
        if root is None or not root.in_forward:
            return []
        plan = root.derived_plan()
        target = plan.forward_next.get(id(self)) if plan is not None else None
        return [target] if target is not None else []  # type: ignore[list-item]

    @traced("post_forward")
    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Register sharded params, reshard per policy, hook the pre-backward, cast outputs."""
        g = self.group
        if _in_backward():
            return output
        self.depth = max(0, self.depth - 1)
        if self.depth > 0:
            return output
        functional = self.functional is not None  # caller-passed sources (see _pre_forward)
        if functional:
            output = functional_call.post_forward(self, output)
        root = self.root
        if root is not None and not root.order_recorded:
            root.post_forward_order.append(self)
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        tensors = []
        if torch.is_grad_enabled() and not functional:
            tensors = [
                t
                for t in pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
        if g is not None and not functional:
            # The root keeps its parameters only for the backward that follows; with no
            # backward to serve (no_grad, inference mode, nothing requires grad) it reshards
            # like every other group. So does the last forward bucket under the derived
            # schedule (its backward comes first), unless the user chose how it reshards.
            default = self.user_reshard_after_forward is None
            plan = root.plan() if tensors and default and root is not None else None
            g.post_forward(
                force_reshard=not tensors and self.is_root and default,
                keep=plan is not None and plan.keeps(self),
            )
        if not functional:
            for use in self.tied:
                use.post_forward()
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        if self.is_root:
            # (A list-form root group counts its modules across their root forwards.)
            for lg in self.list_groups:
                if lg is not g:
                    lg.forward_ends()
        if self.is_root and RootAct.FORGET_PREFETCHES in self._root_event(RootEvent.FORWARD_ENDS):
            for s in self.all_states:
                if s.group is not None and s.group.pending is not None:
                    s.group.discard_pending()
            runtime = self.runtime()
            if runtime is not None:
                runtime.forward_ends()
        return output

    # ------------------------------------------------------------------ backward

    @traced("pre_backward")
    def _pre_backward(self, grad: Any) -> None:
        root = self.root
        assert root is not None
        if RootAct.QUEUE_CALLBACK in root._root_event(RootEvent.BACKWARD_BEGINS):
            Variable._execution_engine.queue_callback(root._final_callback)
        plan = root.plan()
        if plan is not None and plan.gathers and not self.tied and plan.rest(self, True):
            # The derived schedule: the groups of this bucket that gather again in backward
            # start together; the bucket's last group prefetches the next bucket's.
            start_together(_regather(plan.rest(self, backward=True)))
            if self.group is not None:
                self.group.pre_backward()
            if plan.is_last(self, backward=True):
                for t in self.backward_prefetch_targets()[:1]:
                    start_together(_regather(plan.rest(t, backward=True)))
            return
        if self.group is not None:
            self.group.pre_backward()
        for use in self.tied:
            use.pre_backward()
        for t in self.backward_prefetch_targets():
            if t.group is not None:
                t.group.prefetch_for_backward()
            for use in t.tied:  # another group's weight the target's backward reads
                use.owner.start_unshard()

    def backward_prefetch_targets(self) -> list[FSDPState]:
        """The states whose groups this one's backward prefetches (explicit, else the group
        before it in the root's post-forward order)."""
        if self.explicit_backward_prefetch is not None:
            return self.explicit_backward_prefetch
        root = self.root
        plan = root.derived_plan() if root is not None else None
        target = plan.backward_next.get(id(self)) if plan is not None else None
        return [target] if target is not None else []  # type: ignore[list-item]

    def _final_callback(self) -> None:
        """Root: finish every group (reductions, groups that got no gradient) and go idle."""
        with profiled("FSDP::root_post_backward_callback"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        self._root_event(RootEvent.FINAL_CALLBACK)  # FINISH_GROUPS: the rest of this method
        try:
            self._finish_groups()
        except BaseException:
            # A reduction could not land (a peer left, a hook raised): the callback is no
            # longer queued, so say so, and the next forward resets first.
            self._root_event(RootEvent.FINISH_RAISED)
            raise

    def _finish_groups(self) -> None:
        if self._plan is not None:
            for bucket in self._plan.reduce_buckets:  # members that got no gradient
                bucket.flush()
        # is_last_backward is False only under manual finalization (set_manual_backward_
        # finalization): the reductions stay in flight until finalize_backward lands them.
        for s in self.all_states:
            if s.group is not None:
                s.group.finish_backward(self.is_last_backward)
        for s in self.all_states:
            for use in s.tied:
                use.finish()
        # Nothing is in flight until the next forward: memory kept for reuse goes back now
        # (the optimizer step and the forward's start run without it).
        runtime = self.runtime()
        if runtime is not None:
            runtime.release_kept()

    def reset(self) -> None:
        """``reset_iter_state``: drop in-flight work, reshard, go idle (after an exception)."""
        restore_raised()  # an optimizer step that raised leaves its parameters swapped
        root = self.root if self.root is not None else self
        states = root.all_states or [self]
        for s in states:
            if s.group is not None:
                s.group.reset_iter_state()
        for s in states:
            s.depth = 0
            for use in s.tied:
                use.finish()
        if self.root is not None:
            self.root._root_event(RootEvent.RESET)
        # Collectives the failed step left behind must never pair with the next step's: every
        # rank agrees on a fresh epoch of tags (peers still waiting are told to give up).
        bases: list[Any] = []
        for s in states:
            for b in s.group.base_comms() if s.group is not None else ():
                if all(b is not c for c in bases):
                    bases.append(b)
        resync(bases)


def _not_run(states: Sequence[buckets.Scheduled]) -> list[ParamGroup]:
    """The groups of ``states`` whose forward has not run yet in this iteration."""
    return [g for s in states if (g := s.group) is not None and not g.ran_forward]


def _regather(states: Sequence[buckets.Scheduled]) -> list[ParamGroup]:
    """The groups of ``states`` whose backward gathers their parameters again (not yet
    reduced this backward, unsharding in backward)."""
    return [
        g
        for s in states
        if (g := s.group) is not None and not g.ran_post_backward and g.config.unshard_in_backward
    ]


def _groups(states: Sequence[buckets.Scheduled]) -> list[ParamGroup]:
    """The groups the states' forwards gather: their own, and the owners of the weights of
    other groups their modules use (tied across groups)."""
    out = [s.group for s in states if s.group is not None]
    return out + [u.owner for s in states for u in s.tied if all(u.owner is not o for o in out)]


def _check_one_reproducible_policy(root: FSDPState, states: list[FSDPState]) -> None:
    """Every group under ``root`` reduces under the same ``ReproduciblePolicy``, or none does.

    A group without the policy (or with another one) sums its gradients in an order set by the
    world size, so a run with the policy on some groups only is silently not reproducible
    (measured: the blocks under the policy and the root without it gave a step-2 gradient norm
    that differs in the last bit between 2 ranks and 1 or 4). Checked at the root's first
    forward, before any state is marked as initialised and before any collective, so it is
    raised on every rank alike and again at the next forward.

    Raises:
        ReproducibilityError: naming the groups with each policy and the groups without one.
    """
    paths = {id(m): p for p, m in root.module.named_modules()}
    by_policy: dict[Any, list[str]] = {}
    seen: set[int] = set()
    for s in states:
        if s.group is None or id(s.group) in seen:
            continue
        seen.add(id(s.group))
        label = paths.get(id(s.module)) or f"{s.name} (the root)"
        by_policy.setdefault(s.group.config.reproducible, []).append(label)
    if len(by_policy) <= 1:
        return
    parts = [
        f"{'without a ReproduciblePolicy' if p is None else f'with {p!r}'}: {', '.join(labels)}"
        for p, labels in by_policy.items()
    ]
    raise ReproducibilityError(
        f"the groups under the root {root.name!r} do not reduce under one ReproduciblePolicy "
        f"({'; '.join(parts)}). A group without the policy, or with another one, sums its "
        "gradients in an order that depends on the world size, so the run would silently not be "
        "reproducible; pass the same policy to every fully_shard call of the model (each block "
        "and the root: fully_shard(module, reproducible=policy)), or to none"
    )


def _check_tied_under_root(root: FSDPState, states: list[FSDPState]) -> None:
    """A weight tied across groups must be owned by a group under the same root: one
    iteration (one forward, one final callback) then covers every use."""
    groups = {id(s.group) for s in states if s.group is not None}
    for s in states:
        for use in s.tied:
            if id(use.owner) not in groups:
                raise TiedParameterError(
                    f"{use.name} is tied to {use.param.fqn!r} of {use.owner.name} (a weight "
                    f"tied across groups), but that group is not under the root {root.name!r}; "
                    "call fully_shard on a module that contains both (the model) and run "
                    "forward through it"
                )


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return pytree.tree_map(cast, tree)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run FSDP's pre/post-forward around ``module.method_name`` (e.g. ``generate``)."""
    state = getattr(module, "_ffsdp_state", None)
    if state is None:
        raise StateError(
            f"{type(module).__name__} is not an FSDP module; call fully_shard on it first"
        )
    if not callable(getattr(type(module), method_name, None)):
        raise PolicyError(
            f"{type(module).__name__} does not have a method {method_name!r} to register as an "
            "FSDP forward method; pass the name of a method defined on its class"
        )
    orig = getattr(type(module), method_name)

    @functools.wraps(orig)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            args, kwargs = state.pre_forward(self, args, kwargs)
            out = orig(self, *args, **kwargs)
        except BaseException:
            # As the module's always-called exit hook does for forward: the next forward
            # resets what this one left half done.
            if not _in_backward():
                (state.root or state)._root_event(RootEvent.FORWARD_RAISED)
            raise
        return state.post_forward(self, args, out)

    object.__setattr__(module, method_name, types.MethodType(wrapped, module))


def hooks_for(state: FSDPState) -> tuple[Callable, Callable, Callable]:
    """The module forward pre-hook, hook and always-called exit hook that drive ``state``.

    Register the third with ``register_forward_hook(exit, always_call=True)``: it runs after
    the hook, or alone when the forward raised, and then marks the root interrupted.
    """

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        state.calls.append([False])
        return state.pre_forward(module, args, kwargs)

    def post(module: nn.Module, args: tuple, output: Any) -> Any:
        state.calls[-1][0] = True
        return state.post_forward(module, args, output)

    def exit_(module: nn.Module, args: tuple, output: Any) -> None:
        finished = state.calls.pop()[0] if state.calls else True
        # (An activation-checkpoint recompute in backward stops early by raising inside the
        # module on purpose: that is not a failed forward.)
        if not finished and not _in_backward():
            (state.root or state)._root_event(RootEvent.FORWARD_RAISED)

    # Under torch.compile the hooks run eagerly (a graph break on each side of the module's
    # forward, which compiles): they gather, register tensors on modules and start
    # collectives, none of which belongs in a graph.
    return torch._dynamo.disable(pre), torch._dynamo.disable(post), torch._dynamo.disable(exit_)
