"""Gradient reduction, the fifth transition: ``reduce_grad`` and its halves.

``reduce_grad(grads, sharded, comm) -> sharded`` averages full gradients over the ranks and
keeps this rank's shard, as FSDP2 does: pack in the reduce dtype, pre-divide, one
reduce-scatter, HSDP all-reduce, post-divide, cast, accumulate. How is one record,
:class:`ReducePolicy`. A reduction whose policy keeps state from one backward to the next
(compression's error feedback, HSDP's partial sum) threads that state beside the sharded
state, as an optimizer's state sits beside the parameters: :class:`ReduceState`, in and out of
:func:`reduce_grad_with_state` (and of :func:`reduce_input` / :func:`finish_reduce`).
:func:`begin_reduce` / :func:`finish_reduce` split it around the collective so a caller can
overlap it with compute; :func:`begin_reduce` is :func:`reduce_input` (the copy-in) then
:func:`issue_reduce` (the collective), for a caller that runs them on different streams.
Re-exported by :mod:`functional_fsdp.core.transitions`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import optree
import torch

from . import layout as L
from ._tree import register
from .comm import (
    Communicator,
    DoneWork,
    PiecesCommunicator,
    Work,
    capabilities,
    check_comm,
    collective_or_copy,
    uses_pieces,
)
from .compression import GradCompression, begin_compressed_reduce
from .errors import LayoutMismatchError, StateError
from .records import GroupLayout, ShardedState

__all__ = [
    "PendingReduce",
    "ReduceInput",
    "ReducePolicy",
    "ReduceState",
    "accumulate_local_grads",
    "agreed_present",
    "begin_reduce",
    "carries_presence",
    "finish_reduce",
    "hold_unsynced",
    "hold_use",
    "issue_reduce",
    "lands_every_trainable",
    "pack_grads",
    "reduce_divide_factors",
    "reduce_grad",
    "reduce_grad_with_state",
    "reduce_input",
    "reduce_row_numel",
    "refit_partial",
    "release_unsynced",
    "release_uses",
    "split_reduced",
]


def _grad_list(grads: Any, layout: GroupLayout) -> list[torch.Tensor | None]:
    spec = layout.treespec
    if isinstance(grads, (list, tuple)) and all(
        g is None or isinstance(g, torch.Tensor) for g in grads
    ):
        if spec is not None and spec.kind in (
            optree.PyTreeKind.DICT,
            optree.PyTreeKind.ORDEREDDICT,
        ):
            raise LayoutMismatchError(
                f"reduce_grad: the state was sharded from a dict with keys {spec.entries()}; pass "
                "the gradients as a dict with the same keys. A list is refused: the layout's order "
                "is the sorted keys, not the dict's insertion order, so a list would silently pair "
                "gradients with the wrong parameters"
            )
        return list(grads)
    if layout.treespec is not None:
        try:
            return list(layout.treespec.flatten_up_to(grads))  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:
            raise LayoutMismatchError(
                f"reduce_grad: gradients do not match the structure the state was sharded from "
                f"({layout.treespec}): {e}; pass one gradient (or None) per parameter"
            ) from None
    raise LayoutMismatchError(
        f"reduce_grad: expected {len(layout)} gradients in layout order, got {type(grads).__name__}"
    )


def pack_grads(
    grads: Sequence[torch.Tensor | None],
    layout: GroupLayout,
    *,
    device: torch.device | None = None,
    out: torch.Tensor | None = None,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
    flags: bool = False,
) -> torch.Tensor:
    """Reduce-scatter input: grads cast to the reduce dtype, padded, packed as ``(ws, S)``.

    Missing gradients pack as zeros. ``flags=True`` appends one presence flag per parameter
    to every row (``(ws, S + P)``, :func:`reduce_row_numel`): 1 where this rank has the
    gradient, else 0, so that the reduced shard says which parameters *some* rank had
    (:func:`agreed_present`). ``out``: a tensor of that shape in the reduce dtype to pack into
    (*donated*: written in place), e.g. this group's columns of a bucket's send buffer; the
    result is then ``out`` itself (flat only when ``out`` is contiguous). Else ``alloc``
    (default ``torch.empty``) makes the buffer when every gradient is present.
    """
    layout.check_full(grads, what="reduce_grad")
    dtype = layout.grad_reduce_dtype()
    ws = layout.world_size
    present = [g for g in grads if g is not None]
    dev = device or (present[0].device if present else torch.device("cpu"))
    total = reduce_row_numel(layout, flags)
    mask = tuple(g is not None for g in grads) if flags else ()
    # torch._chunk_cat rejects empty tensors: zero-size gradients take the general path.
    fast = bool(present) and len(present) == len(grads) and all(g.numel() > 0 for g in present)
    if out is not None and (tuple(out.shape) != (ws, total) or out.dtype != dtype):
        raise StateError(
            f"pack_grads: out must be ({ws}, {total}) of {dtype}, got {tuple(out.shape)} of "
            f"{out.dtype}"
        )
    if fast and layout.dim0:
        cast = [g if g.dtype == dtype else g.to(dtype) for g in present]
        if flags:
            cast.append(_flag_rows(ws, mask, dtype, dev))
        if out is None:
            out = (alloc or empty_buffer)(ws * total, dtype, dev).view(ws, total)
        torch._chunk_cat(cast, dim=0, num_chunks=ws, out=out)
        return _flat_if_contiguous(out)
    if out is None:
        out = torch.zeros(ws, total, dtype=dtype, device=dev)
    else:
        out.zero_()
    if flags:
        out.narrow(1, layout.shard_numel, len(mask)).copy_(_flag_rows(ws, mask, dtype, dev))
    off = 0
    for i, g in enumerate(grads):
        n = L.prod(layout.shard_shapes[i])
        if g is not None:
            dim = layout.shard_dims[i]
            padded = torch.zeros(layout.padded_full_shape(i), dtype=dtype, device=dev)
            padded.narrow(dim, 0, g.shape[dim]).copy_(g)
            chunks = padded.chunk(ws, dim=dim)
            for r in range(ws):
                out[r, off : off + n].copy_(chunks[r].reshape(-1))
        off += n
    return _flat_if_contiguous(out)


def _flat_if_contiguous(out: torch.Tensor) -> torch.Tensor:
    return out.view(-1) if out.is_contiguous() else out


@functools.lru_cache(maxsize=256)
def _flag_rows(
    ws: int, mask: tuple[bool, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The ``(ws, P)`` presence flags a rank sends (the same row to every rank): a constant,
    made once per mask (read only: packed by copy)."""
    row = torch.tensor([1.0 if m else 0.0 for m in mask], dtype=dtype)
    return row.expand(ws, len(mask)).contiguous().to(device)


def reduce_row_numel(layout: GroupLayout, flagged: bool) -> int:
    """The width of one rank's row of a reduce-scatter of ``layout``: its padded shard
    (``shard_numel``), plus one presence flag per parameter when the reduction carries them
    (:func:`carries_presence`)."""
    return layout.shard_numel + (len(layout) if flagged else 0)


def lands_every_trainable(comm: Communicator, policy: ReducePolicy) -> bool:
    """Whether a reduction under ``policy`` over ``comm`` lands every trainable parameter,
    also one no rank had a gradient for (zeros): with ``reduce_unused``, under compression
    (error feedback keeps a residual for each) and through the user's reduce-scatter (which
    sees FSDP2's buffer sizes, so no presence flags travel: a parameter some ranks did not
    use still lands the others' sum everywhere). The others carry presence flags
    (:func:`carries_presence`)."""
    return (
        policy.reduce_unused
        or policy.compression is not None
        or capabilities(comm).custom_reduce_scatter
    )


def carries_presence(comm: Communicator, policy: ReducePolicy, *, replicated: bool = False) -> bool:
    """Whether a reduction under ``policy`` over ``comm`` carries one presence flag per
    parameter in its payload, so that every rank lands a gradient some rank had and none
    that no rank had (:func:`agreed_present`): a parameter a rank never used this backward
    (a routed expert) still gets the sum of the others' gradients there.

    Not needed with ``reduce_unused`` (every trainable parameter lands). Not carried by a
    compressed reduction (flags would share the quantization blocks of the gradients) nor by
    the user's own reduce-scatter (``set_custom_reduce_scatter``, which sees FSDP2's buffer
    sizes): those land every trainable parameter instead (:func:`lands_every_trainable`).
    Nor needed by one rank without replicas (``replicated``: HSDP's replicate group): what it
    had is what lands.
    """
    return (comm.world_size > 1 or replicated) and not lands_every_trainable(comm, policy)


def refit_partial(reduce_state: ReduceState, layout: GroupLayout, flagged: bool) -> ReduceState:
    """``reduce_state`` with HSDP's partial sum as wide as a reduction that carries presence
    flags (``flagged``) or not makes it (:func:`reduce_row_numel`): a setting that decides
    it (``reduce_unused``, compression, a custom reduce-scatter) changed while a partial sum
    waits for its all-reduce. The padded shard is kept; flags are dropped, or added as every
    trainable parameter present (what a reduction without them lands). A partial sum of
    another size (another layout) is left for :meth:`ReduceState.check` to refuse."""
    p = reduce_state.partial
    size = reduce_row_numel(layout, flagged)
    shard, flags = layout.shard_numel, len(layout)
    if p is None or p.numel() == size or p.numel() not in (shard, shard + flags):
        return reduce_state
    if flagged:
        trains = [1.0 if s.requires_grad else 0.0 for s in layout.specs]
        p = torch.cat([p, torch.tensor(trains, dtype=p.dtype, device=p.device)])
    else:
        p = p[:shard].clone()
    return attrs.evolve(reduce_state, partial=p)


def agreed_present(
    present: Sequence[bool], layout: GroupLayout, out: torch.Tensor, flagged: bool
) -> tuple[bool, ...]:
    """Which parameters the reduced shard ``out`` lands: those this rank had (``present``) or,
    when the reduction carried presence flags (``flagged``), any rank had (a flag summed over
    the ranks is nonzero). The flags are read (a device sync) only when this rank lacks a
    trainable parameter's gradient; with every one present the union is known."""
    if not flagged or all(p or not s.requires_grad for p, s in zip(present, layout.specs)):
        return tuple(present)
    flags = out.narrow(0, layout.shard_numel, len(layout)).tolist()
    return tuple(bool(p or f != 0) for p, f in zip(present, flags))


@attrs.frozen
class ReducePolicy:
    """How a group's gradients are reduced: one record, handed whole to every reduction
    function of the core (the shell builds it once from a group's settings).

    Attributes:
        divide_factor: divide the summed gradients by this instead of the data-parallel size
            (FSDP2's ``set_gradient_divide_factor``).
        force_sum: sum reductions only, dividing locally (``set_force_sum_reduction_for_comms``).
        all_reduce: under HSDP, all-reduce across the replicas now; ``False`` keeps the
            reduce-scattered sum in :attr:`ReduceState.partial`, added before the next
            all-reduce (``set_requires_all_reduce(False)``).
        reduce_unused: reduce (zeros for) parameters without a gradient too
            (``set_reduce_scatter_unused_params``).
        compression: reduce-scatter in a narrow format with error feedback (beyond FSDP2; see
            :mod:`functional_fsdp.core.compression`); with error feedback the residual is
            read from and returned in :attr:`ReduceState.residual`. ``None``: the exact
            reduce-scatter.
    """

    divide_factor: float | None = None
    force_sum: bool = False
    all_reduce: bool = True
    reduce_unused: bool = False
    compression: GradCompression | None = attrs.field(default=None)

    @compression.validator
    def _check_compression(self, _attr: object, value: object) -> None:
        if value is not None and not isinstance(value, GradCompression):
            raise StateError(
                f"ReducePolicy.compression must be a GradCompression or None, got "
                f"{type(value).__name__}"
            )

    def keeps_state(self, replicated: bool) -> bool:
        """Whether a reduction under this policy hands state to the next one (so it must be
        run by :func:`reduce_grad_with_state`): compression with error feedback, or HSDP
        (``replicated``) without the all-reduce."""
        feedback = self.compression is not None and self.compression.error_feedback
        return feedback or (replicated and not self.all_reduce)


EXACT = ReducePolicy()  # FSDP2's defaults


@register
@attrs.frozen(eq=False)
class ReduceState:
    """What a group's gradient reduction carries from one backward to the next: the state of
    each reducer that keeps any, threaded beside the sharded state (as an optimizer's state
    sits beside the parameters), never inside it. FSDP2's exact reduction with gradient sync
    on keeps none: every field ``None``. A pytree record (its tensors are leaves).

    Attributes:
        residual: compression's error feedback (:attr:`ReducePolicy.compression` with
            ``error_feedback``): what encoding dropped last time, fp32, the group's padded
            unsharded gradient size (``world_size * shard_numel``); ``None`` before the first
            compressed reduction.
        partial: HSDP's reduce-scattered sum not yet all-reduced across the replicas
            (:attr:`ReducePolicy.all_reduce` ``False``), in the reduce dtype; added before the
            next all-reduce. One reduce-scatter row (:func:`reduce_row_numel`): the padded
            shard, then the summed presence flags when the reduction carries them.
        unsynced: full gradients held while gradient sync is off (FSDP2's
            ``set_requires_gradient_sync(False)``), one per parameter (``None``: none yet), in
            the reduce dtype: :func:`hold_unsynced` adds to them, :func:`release_unsynced`
            hands them to the next reduction.
    """

    residual: torch.Tensor | None = None
    partial: torch.Tensor | None = None
    unsynced: tuple[torch.Tensor | None, ...] | None = None

    def check(self, layout: GroupLayout, row_numel: int | None = None) -> None:
        """Refuse a state that does not belong to ``layout`` (a residual of another size).
        ``row_numel``: the reduction's row width (:func:`reduce_row_numel`; default the
        padded shard), the size of a partial sum."""
        if self.residual is not None:
            numel = layout.world_size * layout.shard_numel
            if self.residual.dtype != torch.float32 or tuple(self.residual.shape) != (numel,):
                raise LayoutMismatchError(
                    f"ReduceState.residual must be an fp32 vector of {numel} elements (the "
                    f"group's padded unsharded gradient), got {self.residual.dtype} "
                    f"{tuple(self.residual.shape)}; start from ReduceState() after the layout "
                    "changes"
                )
        if self.unsynced is not None and len(self.unsynced) != len(layout):
            raise LayoutMismatchError(
                f"ReduceState.unsynced holds {len(self.unsynced)} gradients for "
                f"{len(layout)} parameters; start from ReduceState() after the layout changes"
            )
        width = layout.shard_numel if row_numel is None else row_numel
        if self.partial is not None and self.partial.numel() != width:
            raise LayoutMismatchError(
                f"ReduceState.partial must hold {width} elements (one padded shard and the "
                f"presence flags), got {self.partial.numel()}; start from ReduceState() after "
                "the layout or the reduction settings change"
            )


NO_REDUCE_STATE = ReduceState()


def hold_unsynced(
    reduce_state: ReduceState, grads: Sequence[torch.Tensor | None], layout: GroupLayout
) -> ReduceState:
    """Gradient sync off: keep this backward's full gradients (``None`` for none) instead of
    reducing them, added to those already held, in the reduce dtype. The held tensors are
    *donated*: the sum is written into them (a first gradient is copied, never aliased)."""
    if len(grads) != len(layout):
        raise LayoutMismatchError(
            f"hold_unsynced: {len(grads)} gradients for {len(layout)} parameters"
        )
    rdtype = layout.grad_reduce_dtype()
    held = reduce_state.unsynced or (None,) * len(grads)
    new = _added(held, grads, lambda g: g.to(rdtype, copy=True))
    return attrs.evolve(reduce_state, unsynced=tuple(new))


def release_unsynced(
    reduce_state: ReduceState, grads: Sequence[torch.Tensor | None]
) -> tuple[list[torch.Tensor | None], ReduceState]:
    """Gradient sync on again: this backward's full gradients plus the held ones (the held
    tensors *donated*: the sums are written into them), and the state without them. Nothing
    held: ``grads`` as they are."""
    held = reduce_state.unsynced
    if held is None:
        return list(grads), reduce_state
    if len(held) != len(grads):
        raise LayoutMismatchError(
            f"release_unsynced: {len(grads)} gradients for {len(held)} held ones"
        )
    return _added(held, grads, lambda g: g), attrs.evolve(reduce_state, unsynced=None)


def hold_use(
    held: Sequence[torch.Tensor | None] | None, grads: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor | None, ...]:
    """A group used more than once in one forward: the full gradients of a use whose backward
    ran while another use's is to come, added to those already held (*donated*: in place; a
    first gradient is copied), in their own dtype. The last use adds its gradients to them
    (:func:`release_uses`), and the group reduces (or, gradient sync off, accumulates) that
    sum once per backward: the sum autograd makes when the uses share one ``.grad`` (FSDP2's,
    added in the order the uses' backwards run)."""
    if held is not None and len(held) != len(grads):
        raise LayoutMismatchError(f"hold_use: {len(grads)} gradients for {len(held)} held ones")
    return tuple(_added(held or (None,) * len(grads), grads, torch.clone))


def release_uses(
    held: Sequence[torch.Tensor | None], grads: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """The last use's full gradients added to the earlier uses' (:func:`hold_use`; ``held``
    *donated*: the sums are written into them), in the order autograd adds them: what was
    held, plus this use's."""
    if len(held) != len(grads):
        raise LayoutMismatchError(f"release_uses: {len(grads)} gradients for {len(held)} held ones")
    return _added(held, grads, lambda g: g)


def _added(
    held: Sequence[torch.Tensor | None],
    grads: Sequence[torch.Tensor | None],
    first: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor | None]:
    """Per parameter: ``grads[i]`` added into ``held[i]`` (*donated*: in place); a gradient
    with nothing held becomes ``first(grad)``; ``None`` where neither has one."""
    return [a if g is None else (first(g) if a is None else a.add_(g)) for a, g in zip(held, grads)]


@attrs.frozen(eq=False)
class PendingReduce:
    """A *handle* (not a record: no pytree, never compared) for a reduce-scatter in flight;
    :func:`finish_reduce` turns it into a new sharded state and reduction state (the one it
    started from, ``reduce_state``, with a new residual). Its output buffer (and ``input``,
    the packed reduce-scatter input, ``None`` on the pieces path) is owned by the collective
    until ``work.wait()``; then ``input`` is the caller's to free. ``present``: the parameters
    this rank had a gradient for; ``flagged``: the output ends with the summed presence flags
    (:func:`agreed_present` lands what any rank had)."""

    sharded: ShardedState
    output: torch.Tensor
    work: Work
    factors: L.DivideFactors
    present: tuple[bool, ...]
    replicate_comm: Communicator | None
    all_reduce: bool
    reduce_state: ReduceState = NO_REDUCE_STATE
    input: torch.Tensor | None = None
    flagged: bool = False


@attrs.frozen(eq=False)
class ReduceInput:
    """A *handle*: a reduction's copy-in (:func:`reduce_input`), ready for
    :func:`issue_reduce` (a caller may run the two on different streams). ``packed`` is the
    reduce-scatter input (cast, padded, pre-divided: a new buffer), or ``None`` on the pieces
    path, which sends each rank its rows straight from ``grads``. ``reduce_state``: the state
    the reduction starts from. ``flagged``: the rows carry presence flags
    (:func:`carries_presence`)."""

    sharded: ShardedState
    grads: tuple[torch.Tensor | None, ...]
    packed: torch.Tensor | None
    present: tuple[bool, ...]
    factors: L.DivideFactors
    rdtype: torch.dtype
    device: torch.device
    replicate_comm: Communicator | None
    all_reduce: bool
    compression: GradCompression | None
    reduce_state: ReduceState = NO_REDUCE_STATE
    flagged: bool = False


def begin_reduce(
    grads: Any,
    sharded: ShardedState,
    comm: Communicator,
    *,
    replicate_comm: Communicator | None = None,
    policy: ReducePolicy = EXACT,
    reduce_state: ReduceState = NO_REDUCE_STATE,
    async_op: bool = True,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
) -> PendingReduce:
    """Pack gradients, pre-divide and issue the group's one reduce-scatter
    (:func:`reduce_input` then :func:`issue_reduce`), as ``policy`` says, from
    ``reduce_state``.

    ``alloc(numel, dtype, device)`` makes the output buffer (the new sharded gradients); the
    shell injects one that advises the kernel about the fresh memory. Default: ``torch.empty``.
    """
    rin = reduce_input(
        grads,
        sharded,
        comm,
        replicate_comm=replicate_comm,
        policy=policy,
        reduce_state=reduce_state,
    )
    return issue_reduce(rin, comm, async_op=async_op, alloc=alloc)


def reduce_divide_factors(
    layout: GroupLayout, replicate_size: int, policy: ReducePolicy = EXACT
) -> L.DivideFactors:
    """How ``layout``'s gradients are divided around their reduction over its shard group and
    ``replicate_size`` replicas (FSDP2's rule, :func:`~.layout.divide_factors`, with
    ``policy``'s divide factor and sum-only setting): split into a pre- and post-divide when
    the reduce dtype has a small range. The eager reduction and the compiled step's
    reduce-scatter both ask here."""
    rdtype = layout.grad_reduce_dtype()
    return L.divide_factors(
        layout.world_size,
        replicate_size,
        overflow_risk=rdtype not in (torch.float32, torch.bfloat16, torch.float64),
        factor=policy.divide_factor,
        force_sum=policy.force_sum,
    )


def reduce_input(
    grads: Any,
    sharded: ShardedState,
    comm: Communicator,
    *,
    replicate_comm: Communicator | None = None,
    policy: ReducePolicy = EXACT,
    reduce_state: ReduceState = NO_REDUCE_STATE,
    out: torch.Tensor | None = None,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
) -> ReduceInput:
    """The first half of :func:`begin_reduce`: check, choose the path, and pack the gradients
    (cast to the reduce dtype, padded, pre-divided) unless the pieces path sends them as they
    are. No collective is issued. ``reduce_state``: what the previous reduction of this group
    handed on (:class:`ReduceState`). ``out``: where to pack (:func:`pack_grads`; a bucket's
    columns), unused on the pieces path; else ``alloc(numel, dtype, device)`` makes the packed
    buffer (default ``torch.empty``)."""
    if not isinstance(policy, ReducePolicy):
        raise StateError(
            f"policy must be a functional_fsdp.ReducePolicy, got {type(policy).__name__}"
        )
    compression = policy.compression
    if not isinstance(sharded, ShardedState):
        raise StateError(f"reduce_grad writes into a ShardedState, got {type(sharded).__name__}")
    lay = sharded.layout
    flagged = carries_presence(comm, policy, replicated=replicate_comm is not None)
    if reduce_state is not NO_REDUCE_STATE:
        if not isinstance(reduce_state, ReduceState):
            raise StateError(
                f"reduce_state must be a functional_fsdp.ReduceState, got "
                f"{type(reduce_state).__name__}"
            )
        reduce_state.check(lay, reduce_row_numel(lay, flagged))
    check_comm(comm, lay.world_size, "reduce_grad")
    glist = _grad_list(grads, lay)
    every = lands_every_trainable(comm, policy)  # else the flags say (agreed_present)
    present = tuple(
        (g is not None) or (every and s.requires_grad) for g, s in zip(glist, lay.specs)
    )
    rdtype = lay.grad_reduce_dtype()
    ar_size = replicate_comm.world_size if replicate_comm is not None else 1
    factors = reduce_divide_factors(lay, ar_size, policy)
    # Reduce where the gradients are (the compute device), also when the shards are offloaded
    # to the CPU: the caller moves the reduced shards.
    device = next((g.device for g in glist if g is not None), sharded.flat.device)
    # The path depends only on facts every rank shares (never on which gradients this rank
    # happens to have): ranks on different paths would exchange mismatched messages.
    pieces = (
        lay.world_size > 1
        and compression is None
        and uses_pieces(comm, lay.unsharded_bytes)
        and lay.dim0
        and factors.pre in (None, 1)
        and factors.premul is None
    )
    packed = (
        None
        if pieces
        else _pack_input(glist, lay, factors, device, compression, out, alloc, flagged)
    )
    return ReduceInput(
        sharded,
        tuple(glist),
        packed,
        present,
        factors,
        rdtype,
        device,
        replicate_comm,
        policy.all_reduce,
        compression,
        reduce_state,
        flagged,
    )


def issue_reduce(
    rin: ReduceInput,
    comm: Communicator,
    *,
    async_op: bool = True,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
) -> PendingReduce:
    """The second half of :func:`begin_reduce`: issue the reduce-scatter of ``rin`` (made by
    :func:`reduce_input` with the same ``comm``) into a new output buffer."""
    sharded, factors, state = rin.sharded, rin.factors, rin.reduce_state
    if rin.packed is None:
        out, work = _reduce_pieces(
            rin.grads,
            sharded,
            cast(PiecesCommunicator, comm),
            factors,
            rin.rdtype,
            rin.device,
            alloc,
            async_op,
            rin.flagged,
        )
    else:
        out, work, residual = _reduce_packed(
            rin.packed,
            sharded,
            comm,
            factors,
            alloc or empty_buffer,
            async_op,
            rin.compression,
            state.residual,
        )
        if residual is not state.residual:
            state = attrs.evolve(state, residual=residual)
    return PendingReduce(
        sharded,
        out,
        work,
        factors,
        rin.present,
        rin.replicate_comm,
        rin.all_reduce,
        state,
        None if out is rin.packed else rin.packed,  # an output is never freed as an input
        rin.flagged,
    )


def _pack_input(
    glist: Sequence[torch.Tensor | None],
    lay: GroupLayout,
    factors: L.DivideFactors,
    device: torch.device,
    compression: GradCompression | None,
    out: torch.Tensor | None = None,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None = None,
    flagged: bool = False,
) -> torch.Tensor:
    """The packed reduce-scatter input: the gradients (and presence flags when ``flagged``)
    packed (into ``out`` when given), in fp32 for a compressed reduction, pre-divided."""
    inp = pack_grads(
        glist,
        lay,
        device=device,
        out=None if compression is not None else out,
        alloc=alloc,
        flags=flagged,
    )
    if compression is not None and lay.world_size > 1 and inp.dtype != torch.float32:
        inp = inp.float()
    return factors.scale_input(inp, donate=True)


def _reduce_packed(
    inp: torch.Tensor,
    sharded: ShardedState,
    comm: Communicator,
    factors: L.DivideFactors,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor],
    async_op: bool,
    compression: GradCompression | None,
    residual: torch.Tensor | None,
) -> tuple[torch.Tensor, Work, torch.Tensor | None]:
    """Issue the reduce-scatter of the packed input (compressed on more than one rank when
    ``compression`` is set, from ``residual``): output buffer, work, new residual."""
    lay = sharded.layout
    if compression is not None and lay.world_size > 1:
        return begin_compressed_reduce(
            inp,
            residual,
            comm,
            compression,
            op=factors.op,
            async_op=async_op,
            alloc=alloc,
        )
    if lay.world_size == 1:
        # One rank: the packed input is the reduction. It becomes the output (the caller must
        # not free it as an input: issue_reduce hands it over as the output only).
        return inp, DoneWork(), residual
    out = alloc(inp.numel() // lay.world_size, inp.dtype, inp.device)
    work = collective_or_copy(
        lay.world_size,
        out,
        inp,
        lambda: comm.reduce_scatter(out, inp, op=factors.op, async_op=async_op),
    )
    return out, work, residual


def finish_reduce(
    pending: PendingReduce, *, accumulate: bool = True
) -> tuple[ShardedState, ReduceState]:
    """Wait; HSDP all-reduce (or keep the partial sum); post-divide; split per parameter;
    cast; add to existing grads. Returns the new sharded state and the :class:`ReduceState`
    to hand the next reduction."""
    pending.work.wait()
    sharded, out, factors = pending.sharded, pending.output, pending.factors
    state = pending.reduce_state
    # Only an HSDP reduction consumes (adds, then clears) the partial sum; without a replicate
    # group it is carried over as it is.
    if pending.replicate_comm is not None:
        if state.partial is not None:
            out = out + state.partial
        if not pending.all_reduce:
            return sharded, attrs.evolve(state, partial=out)
        if state.partial is not None:
            state = attrs.evolve(state, partial=None)
        if pending.replicate_comm.world_size > 1:
            pending.replicate_comm.all_reduce(out, op=factors.all_reduce_op).wait()
    out = factors.scale_output(out)
    present = agreed_present(pending.present, sharded.layout, out, pending.flagged)
    grads = split_reduced(sharded, out, present, accumulate=accumulate)
    return attrs.evolve(sharded, grads=grads), state


def split_reduced(
    sharded: ShardedState, out: torch.Tensor, present: Sequence[bool], *, accumulate: bool
) -> tuple[torch.Tensor | None, ...]:
    """The reduced packed shard ``out`` as one sharded gradient per parameter (views where the
    dtype and device allow), in each parameter's dtype on the shards' device; a parameter not
    ``present`` keeps its old gradient, the others are added to it with ``accumulate``."""
    lay = sharded.layout
    old = sharded.grads or (None,) * len(lay)
    new: list[torch.Tensor | None] = []
    # One split for all parameters (a narrow per parameter cost 3 us each on the CPU).
    sizes = lay.shard_numels
    rest = out.numel() - lay.shard_numel
    pieces = out.split_with_sizes((*sizes, rest) if rest else sizes)
    device = sharded.flat.device
    same_device = out.device == device
    for i, spec in enumerate(lay.specs):
        if not present[i]:
            new.append(old[i])
            continue
        g = pieces[i].view(lay.shard_shapes[i])
        # Sharded grads live with the shards (the CPU under offload), in the param dtype.
        if not same_device or g.dtype != spec.dtype:
            g = g.to(device=device, dtype=spec.dtype)
        prev = old[i]
        new.append(g + prev if (accumulate and prev is not None) else g)
    return tuple(new)


def accumulate_local_grads(
    new: ShardedState, current: Sequence[torch.Tensor | None], *, donate: bool = False
) -> tuple[torch.Tensor | None, ...]:
    """This rank's unpadded sharded gradients after adding ``new``'s to ``current``.

    ``current`` holds one unpadded local gradient (or ``None``) per parameter, e.g. what a
    module's ``.grad`` holds. Entry ``i`` of the result is ``new.local_grad(i)`` where
    ``current[i]`` is ``None``, ``current[i]`` where ``new`` has no gradient, else their sum:
    a new tensor, or, with ``donate=True``, ``current[i]`` accumulated in place (the caller
    gives up ``current``; the shell donates its ``.grad`` tensors so a gradient is stored once).
    """
    lay = new.layout
    if len(current) != len(lay):
        raise LayoutMismatchError(
            f"accumulate_local_grads: {len(current)} current gradients for {len(lay)} parameters"
        )
    out: list[torch.Tensor | None] = []
    for i, prev in enumerate(current):
        g = new.local_grad(i)
        if g is None or prev is None:
            out.append(prev if g is None else g)
        elif tuple(prev.shape) != tuple(g.shape):
            raise LayoutMismatchError(
                f"accumulate_local_grads: the current gradient of {lay.specs[i].fqn!r} has shape "
                f"{tuple(prev.shape)}, this rank's shard is {tuple(g.shape)}"
            )
        else:
            out.append(prev.add_(g) if donate else prev + g)
    return tuple(out)


def reduce_grad(
    grads: Any,
    sharded: ShardedState,
    comm: Communicator,
    *,
    replicate_comm: Communicator | None = None,
    policy: ReducePolicy = EXACT,
    accumulate: bool = True,
) -> ShardedState:
    """Average full gradients over ranks and keep this rank's shard.

    Packs in the reduce dtype, pre-divides, one reduce-scatter over ``comm``, all-reduce over
    ``replicate_comm`` (HSDP), post-divides, casts to each parameter's dtype and adds to
    existing grads (``accumulate``). A policy that keeps state between reductions
    (:meth:`ReducePolicy.keeps_state`: compression with error feedback, HSDP without the
    all-reduce) is refused here: run it with :func:`reduce_grad_with_state`.

    Args:
        grads: full gradients in layout order (or in the layout's pytree); ``None`` = no grad.
        sharded: the state to attach gradients to (not mutated).
        comm: the shard group.
        replicate_comm: the replicate group for HSDP, or ``None``.
        policy: how to reduce (:class:`ReducePolicy`: divide factor, sum-only, HSDP's
            all-reduce now or later, unused parameters, compression); default FSDP2's.
        accumulate: add to existing sharded grads instead of replacing them.
    """
    if isinstance(policy, ReducePolicy) and policy.keeps_state(replicate_comm is not None):
        what = (
            "compression with error feedback keeps a residual"
            if policy.compression is not None and policy.compression.error_feedback
            else "HSDP without the all-reduce (all_reduce=False) keeps a partial sum"
        )
        raise StateError(
            f"reduce_grad: {what} for the next reduction, which reduce_grad would drop; call "
            "reduce_grad_with_state(grads, sharded, reduce_state, comm, ...) and thread the "
            "ReduceState it returns (start from ReduceState())"
        )
    return reduce_grad_with_state(
        grads,
        sharded,
        NO_REDUCE_STATE,
        comm,
        replicate_comm=replicate_comm,
        policy=policy,
        accumulate=accumulate,
    )[0]


def reduce_grad_with_state(
    grads: Any,
    sharded: ShardedState,
    reduce_state: ReduceState,
    comm: Communicator,
    *,
    replicate_comm: Communicator | None = None,
    policy: ReducePolicy = EXACT,
    accumulate: bool = True,
) -> tuple[ShardedState, ReduceState]:
    """:func:`reduce_grad` for a policy that keeps state between reductions: starts from
    ``reduce_state`` (what the previous reduction of this group returned; ``ReduceState()``
    the first time) and returns the new sharded state and the :class:`ReduceState` to pass
    to the next one. With ``policy.all_reduce=False`` under HSDP the sharded gradients are
    unchanged and the reduce-scattered sum is kept in the returned state's ``partial``."""
    pending = begin_reduce(
        grads,
        sharded,
        comm,
        replicate_comm=replicate_comm,
        policy=policy,
        reduce_state=reduce_state,
        async_op=False,
    )
    return finish_reduce(pending, accumulate=accumulate)


def _reduce_pieces(
    glist: Sequence[torch.Tensor | None],
    sharded: ShardedState,
    comm: PiecesCommunicator,
    factors: L.DivideFactors,
    rdtype: torch.dtype,
    device: torch.device,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor] | None,
    async_op: bool,
    flagged: bool,
) -> tuple[torch.Tensor, Work]:
    """Send each rank its rows of each gradient straight from the gradient tensors; receive this
    rank's rows into the (padded) output regions. No packed copy of the gradients. A missing
    gradient is sent as zeros, as the packed path packs it; the presence flags (``flagged``)
    travel as one more piece, into the output's tail."""
    lay, ws = sharded.layout, sharded.layout.world_size
    numels = [L.prod(sh) for sh in lay.shard_shapes]
    out = (alloc or empty_buffer)(reduce_row_numel(lay, flagged), rdtype, device)
    sends: list[list[torch.Tensor]] = [[] for _ in range(ws)]
    outs: list[torch.Tensor] = []
    off = 0
    for i, g in enumerate(glist):
        if g is None:
            g = torch.zeros(lay.specs[i].shape, dtype=rdtype, device=device)
        else:
            g = g.to(device=device, dtype=rdtype).contiguous()
        for r in range(ws):
            start, length = lay.extent(i, r)
            sends[r].append(g.narrow(0, start, length).reshape(-1))
        mine = lay.extent(i, comm.rank)[1] * L.prod(lay.shard_shapes[i][1:])
        region_i = out.narrow(0, off, numels[i])
        if mine < numels[i]:
            region_i.narrow(0, mine, numels[i] - mine).zero_()
        outs.append(region_i.narrow(0, 0, mine))
        off += numels[i]
    if flagged:
        rows = _flag_rows(ws, tuple(g is not None for g in glist), rdtype, device)
        for r in range(ws):
            sends[r].append(rows[r])
        outs.append(out.narrow(0, off, len(glist)))
    return out, comm.reduce_scatter_pieces(outs, sends, op=factors.op, async_op=async_op)


def empty_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, as an ``alloc``: the default maker of the core's new buffers (gather
    outputs, packed gradients, reduction outputs; the shell injects one that reuses memory)."""
    return torch.empty(numel, dtype=dtype, device=device)
