"""``summon_full_params``: FSDP1's context manager on FSDP2-style modules.

Inside the context every parameter of the summoned groups is its full, unsharded tensor,
registered on its modules as an ``nn.Parameter``; on exit each rank writes its unpadded slice of
the (possibly edited) full tensors back through the pure :func:`~functional_fsdp.writeback`
transition, and the sharded ``DTensor`` parameters are registered again.

Design notes:

- The full tensors come from the pure :func:`~functional_fsdp.core.transitions.unshard` over the
  group's communicator, in each parameter's *original* dtype (FSDP1 summons full precision even
  under mixed precision), and independent of the group's unsharded compute buffer.
- The new sharded record that ``writeback`` returns is committed by copying its buffer into the
  group's live sharded buffer, so every alias stays valid: the ``DTensor`` parameters' local
  tensors (views into that buffer), the ``nn.Parameter`` objects optimizers hold, pinned CPU
  memory under CPU offload.
- A cached unsharded buffer (e.g. the root's after a no-grad forward) or a
  ``reshard_after_forward=k`` slice would be stale after a writeback: both are dropped, so the
  next forward all-gathers the edited shards.
- Exceptions inside the context still write back (as FSDP1 does) and always restore the
  sharded parameters.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn as nn

from ...core import transitions as T
from ...core.errors import PolicyError, StateError
from ...core.records import GroupLayout, ShardedState, UnshardedState
from ..engine.dtensors import shard_like
from ..engine.group import ParamGroup, TrainingState
from ..engine.group_common import profiled

__all__ = ["summon_full_params"]


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    *,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Expose the full parameters of ``module``'s FSDP groups (FSDP1's ``summon_full_params``).

    Every rank must enter the context (it all-gathers). Inside, ``module.weight`` (etc.) is the
    full tensor as an ``nn.Parameter``: read it, export it, or edit it in place
    (``with torch.no_grad(): m.weight.mul_(2)``, ``m.weight.data[...] = ...``) or replace it with
    a tensor of the same shape. Forward of a summoned FSDP module inside the context raises.

    Args:
        module: a module passed to ``fully_shard``, or any module containing some.
        recurse: summon the groups of every FSDP module below ``module`` too (default), or only
            ``module``'s own group.
        writeback: on exit, write each rank's slice of the (edited) full tensors back into its
            shard; ``False`` discards edits.
        rank0_only: only global rank 0 materialises the full tensors; the other ranks keep
            their sharded parameters inside the context. Requires ``writeback=False``.
        offload_to_cpu: the full tensors live on CPU. Without ``rank0_only`` every rank holds a
            full CPU copy (a warning says so).
        with_grads: the full gradients are visible as ``.grad`` of the full parameters (an
            all-gather of the sharded gradients) and, with ``writeback``, written back.

    Raises:
        PolicyError: ``writeback`` with ``rank0_only``, or ``with_grads`` with
            ``offload_to_cpu``.
        StateError: called during forward or backward, nested over a group that is already
            summoned, a group that is not materialised (meta device), a forward/backward run
            inside the context, or a full parameter replaced by a tensor of another shape.
            Every check that does not depend on the body runs before any collective, so no rank
            hangs and nothing changes.

    Example:
        >>> with summon_full_params(model):  # doctest: +SKIP
        ...     with torch.no_grad():
        ...         model.head.weight.zero_()
    """
    _check_options(
        writeback=writeback,
        rank0_only=rank0_only,
        offload_to_cpu=offload_to_cpu,
        with_grads=with_grads,
    )
    states = _fsdp_states(module, recurse)
    groups = _unique_groups(states)
    _check_can_summon(module, states, groups)
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "summon_full_params(offload_to_cpu=True, rank0_only=False): every rank holds a full CPU "
            "copy of the parameters; pass rank0_only=True (and writeback=False) to keep only one",
            UserWarning,
            stacklevel=3,
        )
    if not groups:
        yield
        return
    materialise = not rank0_only or dist.get_rank() == 0
    sessions, guards = _open_all(
        states,
        groups,
        materialise=materialise,
        offload_to_cpu=offload_to_cpu,
        with_grads=with_grads,
    )
    try:
        yield
    finally:
        _close_all(sessions, guards, writeback=writeback)


def _open_all(
    states: Sequence[Any], groups: Sequence[ParamGroup], **options: bool
) -> tuple[list[_Summoned], list[Any]]:
    """Gather every group and guard every module's forward; on failure undo what was done."""
    sessions: list[_Summoned] = []
    guards: list[Any] = []
    try:
        for g in groups:
            session = _Summoned(g, **options)
            sessions.append(session)
            session.open()
        for s in states:
            guards.append(s.module.register_forward_pre_hook(_forward_guard, prepend=True))
    except BaseException:
        for h in guards:
            h.remove()
        for session in sessions:
            session.close(writeback=False)
        raise
    return sessions, guards


def _close_all(sessions: Sequence[_Summoned], guards: Sequence[Any], *, writeback: bool) -> None:
    """Remove the guards, write back (if asked) and restore every group; first error wins."""
    for h in guards:
        h.remove()
    errors: list[BaseException] = []
    for session in sessions:
        try:
            session.close(writeback=writeback)
        except StateError as e:
            errors.append(e)
    if errors:
        raise errors[0]


# ------------------------------------------------------------------------------ validation


def _check_options(
    *, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> None:
    if writeback and rank0_only:
        raise PolicyError(
            "summon_full_params(writeback=True, rank0_only=True) is not supported: only rank 0 "
            "would hold full parameters, so the other ranks' shards could not be written back; "
            "pass writeback=False with rank0_only=True, or rank0_only=False to edit"
        )
    if with_grads and offload_to_cpu:
        raise PolicyError(
            "summon_full_params(with_grads=True, offload_to_cpu=True) is not supported (as in "
            "FSDP1): a parameter and its gradient must live on the same device; pass "
            "offload_to_cpu=False to see gradients"
        )


def _fsdp_states(module: nn.Module, recurse: bool) -> list[Any]:
    if not recurse:
        st = getattr(module, "_ffsdp_state", None)
        return [st] if st is not None else []
    return [s for m in module.modules() if (s := getattr(m, "_ffsdp_state", None)) is not None]


def _unique_groups(states: Sequence[Any]) -> list[ParamGroup]:
    """The states' groups, and the owners of the weights of other groups their modules use
    (tied across groups: summoned with them, on every module that holds them)."""
    seen: set[int] = set()
    out = []
    for s in states:
        for g in (s.group, *(use.owner for use in s.tied)):
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                out.append(g)
    return out


def _check_can_summon(
    module: nn.Module, states: Sequence[Any], groups: Sequence[ParamGroup]
) -> None:
    name = type(module).__name__
    if torch._C._current_graph_task_id() != -1:
        raise StateError(
            f"summon_full_params({name}) was called during backward; call it before forward or "
            "after backward (and optimizer.step) has finished"
        )
    for s in states:
        if s.root is not None and s.root.in_forward:
            raise StateError(
                f"summon_full_params({name}) was called during the forward of {s.root.name!r}; call "
                "it outside forward/backward (after loss.backward() and optimizer.step())"
            )
    for g in groups:
        if g.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise StateError(
                f"summon_full_params({name}): the parameters of {g.name!r} are already summoned by an "
                "enclosing summon_full_params; nesting it over the same group is not supported: "
                "use the outer context's full parameters, or exit it first"
            )
        if g.training_state is not TrainingState.IDLE:
            raise StateError(
                f"summon_full_params({name}) was called while {g.name!r} is in "
                f"{g.training_state.value}; call it outside forward/backward (or call "
                "reset_iter_state() after an exception mid-iteration)"
            )
        if g.state.flat.is_meta:
            raise StateError(
                f"summon_full_params({name}): the parameters of {g.name!r} are on the meta device; "
                "materialise them first (module.to_empty(device=...) and initialise, or load a state dict)"
            )


def _full_shape(spec: Any) -> tuple[int, ...]:
    return spec.global_shape if spec.global_shape is not None else spec.shape


def _local_of(t: Any) -> torch.Tensor:
    return t.to_local()


def _forward_guard(module: nn.Module, args: Any) -> None:
    raise StateError(
        f"{type(module).__name__}.forward was called inside summon_full_params; exit the context "
        "before running forward (inside, the full parameters are plain tensors for reading and editing)"
    )


# ------------------------------------------------------------------------------ one group


def _full_precision(layout: GroupLayout) -> GroupLayout:
    """The layout with every parameter gathered in its original dtype (same sharded storage),
    and without all-gather codecs: summon gives a tensor subclass's high-precision data (what
    the shards hold), never its encoded all-gather."""
    if layout.codec_inputs is None and all(
        d == s.dtype for d, s in zip(layout.gather_dtypes, layout.specs)
    ):
        return layout
    return GroupLayout.build(layout.specs, layout.world_size)


class _Summoned:
    """One group inside ``summon_full_params``: gather on open, write back and restore on close."""

    def __init__(
        self, group: ParamGroup, *, materialise: bool, offload_to_cpu: bool, with_grads: bool
    ) -> None:
        self.group = group
        self.materialise = materialise
        self.offload_to_cpu = offload_to_cpu
        self.with_grads = with_grads
        self.layout = _full_precision(group.layout)
        self.fulls: list[nn.Parameter] = []
        self.opened = False

    def _source(self) -> ShardedState:
        g = self.group
        flat = g.state.flat
        if flat.device != g.device:  # CPU-offloaded shards are gathered on the compute device
            flat = flat.to(g.device)
        return attrs.evolve(g.state, layout=self.layout, flat=flat)

    def open(self) -> None:
        with profiled(lambda: f"FSDP::summon_full_params ({self.group.name})"):
            self._open()

    def _open(self) -> None:
        g = self.group
        g.enter_summon()
        self.opened = True
        source = self._source()
        params: Sequence[torch.Tensor] = T.unshard(source, g.summon_comm()).params
        grads = self._gather_grads(source) if self.with_grads else None
        if g.tp is not None:  # 2-D: the global tensors (TP all-gather of the TP-local ones)
            params = [
                g.tp.to_global(i, s, t) for i, (s, t) in enumerate(zip(g.layout.specs, params))
            ]
            if grads is not None:
                grads = [
                    None if t is None else g.tp.to_global(i, s, t)
                    for i, (s, t) in enumerate(zip(g.layout.specs, grads))
                ]
        if not self.materialise:
            return
        fulls = []
        for i, (t, p) in enumerate(zip(params, g.params)):
            if self.offload_to_cpu:
                t = t.cpu()
            full = nn.Parameter(t, requires_grad=p.requires_grad)
            if grads is not None and grads[i] is not None:
                full.grad = grads[i]
            fulls.append(full)
        self.fulls = fulls
        if g.tp is None:
            g.register_full(fulls)
            g.register_lent_full(fulls)  # a weight tied across groups: on both groups' modules
        else:  # plain global tensors, not the TP DTensors of a forward
            for sp, t in zip(g.sharded_params, fulls):
                sp.register(t)

    def _gather_grads(self, source: ShardedState) -> list[torch.Tensor | None]:
        """All-gather the sharded gradients; ``None`` where no rank has one (FSDP1's rule)."""
        g = self.group
        present = torch.tensor(
            [p.grad is not None for p in g.params], dtype=torch.int32, device=source.flat.device
        )
        comm = g.summon_comm()
        comm.all_reduce(present, op="sum")
        if not bool(present.any()):
            return [None] * len(g.params)
        grads: list[Any] = [None if p.grad is None else _local_of(p.grad) for p in g.params]
        state = T.pack_locals(grads, self.layout, source.rank, device=source.flat.device)
        full = T.unshard(state, comm)
        return [t if bool(present[i]) else None for i, t in enumerate(full.params)]

    def close(self, *, writeback: bool) -> None:
        """Write back (if asked and materialised) and register the sharded parameters again."""
        if not self.opened:
            return
        self.opened = False
        g = self.group
        backward_ran = g.training_state is not TrainingState.SUMMON_FULL_PARAMS
        try:
            if self.materialise and writeback and not backward_ran:
                current = self._current_full()
                self._commit(current)
        finally:
            self.fulls = []
            g.exit_summon()
        if backward_ran:
            raise StateError(
                f"a forward or backward of {g.name!r} ran inside summon_full_params; the edits were "
                "not written back. Run forward/backward outside the context"
            )

    def _current_full(self) -> list[torch.Tensor]:
        """The full tensors now on the modules (the user may have replaced them)."""
        g = self.group
        out: list[torch.Tensor] = []
        for sp, spec, full in zip(g.sharded_params, self.layout.specs, self.fulls):
            t = sp.registered()
            if t is None:
                t = full
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != _full_shape(spec):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise StateError(
                    f"summon_full_params: {spec.fqn!r} of {g.name!r} was replaced by {shape} inside "
                    f"the context, but it must keep its full shape {_full_shape(spec)} to be written back; "
                    "edit it in place or assign a tensor of the same shape (nothing was written back)"
                )
            out.append(t)
        return out

    def _commit(self, current: Sequence[torch.Tensor]) -> None:
        g, lay = self.group, self.layout
        fp_state = attrs.evolve(g.state, layout=lay)
        params = tuple(
            self._tp_local(i, t.detach().to(s.dtype))
            for i, (t, s) in enumerate(zip(current, lay.specs))
        )
        new = T.writeback(UnshardedState(lay, fp_state.rank, params), fp_state)
        grads = self._sharded_grads(current, fp_state) if self.with_grads else None
        with torch.no_grad():
            g.state.flat.copy_(new.flat)
            if grads is not None:
                self._set_grads(grads)
        # Cached unsharded data is stale now: the next forward all-gathers the new shards.
        g.drop_unsharded()

    def _sharded_grads(
        self, current: Sequence[torch.Tensor], fp_state: ShardedState
    ) -> list[torch.Tensor | None]:
        """This rank's unpadded slices of the full gradients now on the full parameters."""
        lay = self.layout
        full = [t.grad for t in current]
        filled = tuple(
            self._tp_local(i, gr.detach().to(s.dtype))
            if gr is not None
            else torch.zeros(s.shape, dtype=s.dtype, device=t.device)
            for i, (gr, s, t) in enumerate(zip(full, lay.specs, current))
        )
        sharded = T.writeback(UnshardedState(lay, fp_state.rank, filled), fp_state)
        return [sharded.local(i) if gr is not None else None for i, gr in enumerate(full)]

    def _tp_local(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """2-D: this rank's TP-local block of a global tensor (what the dp shards hold)."""
        tp = self.group.tp
        return full if tp is None else tp.to_local(i, self.layout.specs[i], full).contiguous()

    def _set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        for p, local in zip(self.group.params, grads):
            dp: Any = p
            if local is None:
                dp.grad = None
            elif dp.grad is None:
                # Beside the shard (on the host under CPU offload, as the reduction puts it).
                dp.grad = shard_like(local.to(dp._local_tensor.device), dp)
            else:
                dp.grad.to_local().copy_(local)
