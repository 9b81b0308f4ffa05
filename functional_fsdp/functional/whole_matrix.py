"""Whole-matrix rules in the functional API: :func:`whole_matrix` and :func:`muon`.

An element-wise rule (Adam, SGD) gives the same numbers on a shard as on the whole tensor; a
rule over a whole matrix (Muon's orthogonalization, a Shampoo-like preconditioner, a spectral
normalization) does not. These transformations gather each 2-D leaf to one owner rank, run the
rule there on the whole matrix and give every rank its piece of the result (the engine of
:mod:`functional_fsdp.optim`, owners round-robin by size), so the result does not depend on how
the matrix is sharded: FSDP, HSDP, tensor parallel, or 2-D FSDP x TP (the owner gathers the
global matrix across dp and tp).

Where each matrix lives is decided by ``init``: from the ``DTensor`` parameters of
:func:`~.step.init` (their placements: global shape, mesh, the split mesh dims, FSDP's and TP's
placements, owner), kept in the state as static metadata, because the training step hands
``update`` the local shards as plain tensors.
A state built from plain tensors treats every leaf as a whole matrix on this rank (and refuses
a shard later, instead of computing on it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.distributed.tensor import DTensor

from .._dtensor import wrap_like
from ..core._tree import STATIC, tree_flatten, tree_unflatten
from ..core.errors import OptimizerStateError
from ..optim._whole_matrix import MatrixLayout, map_whole_matrices, matrix_layout, plan_owners
from ..optim.muon import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    EPS,
    adjust_lr,
    check_muon_hyperparams,
    newton_schulz,
)
from ._pytrees import register_everywhere
from .optim import (
    AdamWState,
    LearningRate,
    Optimizer,
    _check_lr,
    _lr_at,
    adamw,
    last_lr,
    structure_mismatch,
)
from .transforms import GradientTransformation

__all__ = ["MuonState", "WholeMatrixState", "muon", "whole_matrix"]

_Layouts = tuple[MatrixLayout | None, ...]


@register_everywhere
@attrs.frozen(eq=False)
class WholeMatrixState:
    """State of :func:`whole_matrix`: no tensors, only where each leaf's matrix lives.

    Attributes:
        layouts: per leaf of the parameters, its :class:`~functional_fsdp.optim.MatrixLayout`
            (owner included), or ``None`` for a leaf the rule does not touch (static metadata).
    """

    layouts: _Layouts = attrs.field(default=(), metadata=STATIC)


@register_everywhere
@attrs.frozen(eq=False)
class MuonState:
    """State of :func:`muon`.

    Attributes:
        count: Muon steps taken (0-d float32 tensor).
        momentum: momentum buffers of the matrix leaves, a tuple in leaf order.
        adamw: the :class:`~.optim.AdamWState` of the other leaves (a tuple in leaf order).
        layouts: per leaf, its matrix layout or ``None`` for an AdamW leaf (static metadata).
    """

    count: torch.Tensor
    momentum: tuple[torch.Tensor, ...]
    adamw: AdamWState
    layouts: _Layouts = attrs.field(default=(), metadata=STATIC)


def _plan(leaves: list[Any], chosen: list[bool], where: str) -> _Layouts:
    picked = [matrix_layout(t, f"{where}: leaf {i}") for i, t in enumerate(leaves) if chosen[i]]
    planned = iter(plan_owners(picked))
    return tuple(next(planned) if c else None for c in chosen)


def _leaves(tree: Any, layouts: _Layouts, what: str) -> list[Any]:
    leaves, _ = tree_flatten(tree)
    if len(leaves) != len(layouts):
        raise OptimizerStateError(
            f"{what} has {len(leaves)} leaves but the state was built for {len(layouts)}; "
            "build the state with init() from the same parameters"
        )
    return leaves


def _local(t: Any) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _rows(t: Any, lay: MatrixLayout, name: str) -> torch.Tensor:
    from ..optim._whole_matrix import local_rows

    return local_rows(lay, t, name)


def whole_matrix(
    fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    is_matrix: Callable[[torch.Tensor], bool] | None = None,
) -> GradientTransformation:
    """Apply ``fn`` to the whole matrix of every 2-D leaf, however it is sharded.

    ``fn(full) -> full update`` sees the whole gradient (or whatever the chain passes: momentum,
    a clipped gradient) of one matrix on one owner rank and returns the whole update; each rank
    gets its piece (rows under FSDP, a block of rows of its TP columns under rowwise 2-D FSDP x
    TP). Leaves that are not matrices pass through unchanged. Stateless rules only
    (the state holds where the matrices live); for momentum, put a transformation that keeps it
    before this one in a :func:`~.transforms.chain`.

    Args:
        fn: the rule, ``(rows, cols) tensor -> (rows, cols) tensor``. It runs on one rank per
            matrix and may overwrite its argument. The result is cast to the leaf's dtype.
        is_matrix: which leaves to treat as matrices (``leaf -> bool``, called on the
            parameters at ``init``); default: every 2-D leaf. A chosen leaf that is not 2-D
            raises :class:`~functional_fsdp.core.errors.WholeMatrixError`.

    Returns:
        A :class:`~.transforms.GradientTransformation` with state :class:`WholeMatrixState`.

    Example:
        >>> import torch
        >>> spectral = whole_matrix(lambda g: g / torch.linalg.matrix_norm(g, ord=2))
        >>> params = {"w": torch.ones(3, 2), "b": torch.ones(2)}
        >>> s = spectral.init(params)
        >>> u, s = spectral.update({"w": torch.ones(3, 2), "b": torch.ones(2)}, s, params)
        >>> round(torch.linalg.matrix_norm(u["w"], ord=2).item(), 4), u["b"].tolist()
        (1.0, [1.0, 1.0])
    """
    choose = is_matrix or (lambda t: t.ndim == 2)

    def init(params: Any) -> WholeMatrixState:
        leaves, _ = tree_flatten(params)
        return WholeMatrixState(_plan(leaves, [bool(choose(t)) for t in leaves], "whole_matrix"))

    def update(
        updates: Any, state: WholeMatrixState, params: Any = None, **extra: Any
    ) -> tuple[Any, WholeMatrixState]:
        layouts = state.layouts
        leaves, spec = tree_flatten(updates)
        _leaves(updates, layouts, "updates")
        idx = [i for i, lay in enumerate(layouts) if lay is not None]
        lays = [lay for lay in layouts if lay is not None]
        shards = [_rows(leaves[i], lay, f"whole_matrix: leaf {i}") for i, lay in zip(idx, lays)]
        rows, _ = map_whole_matrices(
            shards, lays, lambda k, full: fn(full), [s.dtype for s in shards]
        )
        out = list(leaves)
        for i, r in zip(idx, rows):
            out[i] = wrap_like(r, leaves[i])
        return tree_unflatten(spec, out), state

    return GradientTransformation(init, update)


def muon(
    lr: LearningRate = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = EPS,
    ns_steps: int = DEFAULT_NS_STEPS,
    adjust_lr_fn: str | None = None,
    *,
    adamw_lr: LearningRate = 1e-3,
    adamw_betas: tuple[float, float] = (0.9, 0.999),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 0.01,
    use_muon: Callable[[torch.Tensor], bool] | None = None,
) -> Optimizer:
    """Muon for the matrices, AdamW for the rest: ``functional_fsdp.optim.Muon`` as a
    functional :class:`~.optim.Optimizer` (returns new parameters).

    Muon half: ``torch.optim.Muon`` 's math, Newton-Schulz on each whole matrix by its owner
    rank; AdamW half: :func:`~.optim.adamw` on the other leaves. Composes like ``adamw``:
    ``chain(clip_by_global_norm(1.0), muon(0.02))``, schedules, ``inject_hyperparams(muon)``.

    Args:
        lr: Muon's learning rate, or a schedule ``count -> lr``.
        weight_decay: Muon's decoupled weight decay.
        momentum: momentum factor.
        nesterov: Nesterov momentum.
        ns_coefficients: Newton-Schulz ``(a, b, c)``.
        eps: Newton-Schulz's norm floor.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None``, ``"original"`` or ``"match_rms_adamw"``.
        adamw_lr: AdamW's learning rate (or schedule) for the other leaves.
        adamw_betas: AdamW's betas.
        adamw_eps: AdamW's eps.
        adamw_weight_decay: AdamW's decoupled weight decay.
        use_muon: which leaves get Muon (``leaf -> bool`` on the parameters at ``init``;
            default: the 2-D leaves; a chosen leaf that is not 2-D raises
            :class:`~functional_fsdp.core.errors.WholeMatrixError`). Keep embeddings and output heads
            on AdamW as the usual recipe does: ``lambda p: p.ndim == 2 and p.shape[0] != V``.

    Returns:
        An :class:`~.optim.Optimizer` with state :class:`MuonState`.
    """
    _check_muon_args(lr, momentum, weight_decay, adjust_lr_fn)
    inner = adamw(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay)
    choose = use_muon or (lambda t: t.ndim == 2)
    muon_args = _MuonArgs(
        weight_decay, momentum, nesterov, tuple(ns_coefficients), eps, ns_steps, adjust_lr_fn
    )

    def init(params: Any) -> MuonState:
        return _muon_init(params, choose, inner)

    def update(
        grads: Any, state: MuonState, params: Any, *, donate: bool = False, **extra: Any
    ) -> tuple[Any, MuonState]:
        layouts = state.layouts
        p, spec = tree_flatten(params)
        g, gspec = tree_flatten(grads)
        if gspec != spec:
            raise OptimizerStateError(structure_mismatch("grads", gspec, spec))
        _leaves(params, layouts, "params")
        count = state.count.add_(1) if donate else state.count + 1
        rate = _lr_at(lr, int(count.item()) - 1)
        mat = [i for i, lay in enumerate(layouts) if lay is not None]
        rest = [i for i, lay in enumerate(layouts) if lay is None]
        out = list(p)
        # AdamW on the other leaves: the functional adamw on their (local) tensors.
        new_rest, adamw_state = inner.update(
            tuple(g[i] for i in rest), state.adamw, tuple(p[i] for i in rest), donate=donate
        )
        for i, t in zip(rest, new_rest):
            out[i] = t
        bufs = _muon_matrices(g, p, out, state, layouts, mat, rate, donate, muon_args)
        new_state = MuonState(count, tuple(bufs), adamw_state, layouts)
        return tree_unflatten(spec, out), new_state

    return Optimizer(init, update, last_lr(lr))


@attrs.frozen
class _MuonArgs:
    weight_decay: float
    momentum: float
    nesterov: bool
    coefficients: tuple[float, ...]
    eps: float
    ns_steps: int
    adjust_lr_fn: str | None


def _muon_matrices(
    g: list[Any],
    p: list[Any],
    out: list[Any],
    state: MuonState,
    layouts: _Layouts,
    mat: list[int],
    rate: float,
    donate: bool,
    a: _MuonArgs,
) -> list[Any]:
    """The Muon half of :func:`muon`'s update: new parameters into ``out``, new buffers back."""
    momentum, weight_decay = a.momentum, a.weight_decay
    # Momentum on the local rows (torch's order of ops), Newton-Schulz on whole matrices.
    wires: list[torch.Tensor] = []
    bufs: list[Any] = []
    for k, i in enumerate(mat):
        lay = layouts[i]
        assert lay is not None
        grad = _rows(g[i], lay, f"muon: grads leaf {i}")
        buf = _local(state.momentum[k])
        buf = buf.lerp_(grad, 1 - momentum) if donate else buf.lerp(grad, 1 - momentum)
        bufs.append(wrap_like(buf, state.momentum[k]))
        upd = grad.lerp(buf, momentum) if a.nesterov else buf
        wires.append(upd.bfloat16())  # Newton-Schulz's first op: nothing lost on the wire
    lays = [lay for lay in layouts if lay is not None]
    rows, _ = map_whole_matrices(
        wires,
        lays,
        lambda k, full: newton_schulz(full, a.coefficients, a.ns_steps, a.eps),  # type: ignore[arg-type]
        [torch.bfloat16] * len(wires),
    )
    for i, lay, o in zip(mat, lays, rows):
        local = _rows(p[i], lay, f"muon: params leaf {i}")
        new = local.mul_(1 - rate * weight_decay) if donate else local * (1 - rate * weight_decay)
        new.add_(o, alpha=-adjust_lr(rate, a.adjust_lr_fn, lay.global_shape))
        # Donated: updated in place, the input leaf (a DTensor keeps its local tensor).
        out[i] = p[i] if donate else wrap_like(new, p[i])
    return bufs


def _check_muon_args(
    lr: LearningRate, momentum: float, weight_decay: float, adjust_lr_fn: str | None
) -> None:
    _check_lr(lr)
    check_muon_hyperparams(momentum, weight_decay, adjust_lr_fn)


def _muon_init(params: Any, choose: Callable[[torch.Tensor], bool], inner: Optimizer) -> MuonState:
    leaves, _ = tree_flatten(params)
    layouts = _plan(leaves, [bool(choose(t)) for t in leaves], "muon")
    mats = tuple(torch.zeros_like(t) for t, lay in zip(leaves, layouts) if lay is not None)
    rest = [t for t, lay in zip(leaves, layouts) if lay is None]
    return MuonState(torch.tensor(0.0), mats, inner.init(tuple(rest)), layouts)
