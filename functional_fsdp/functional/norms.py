"""Global gradient norms over shards, through injected communicators.

A sharded gradient's 2-norm is ``sqrt(sum over ranks of the local sums of squares)``: each rank
squares its shard locally and one all-reduce over the shard group adds them up (what
``torch.nn.utils.clip_grad_norm_`` computes on ``DTensor`` gradients). The all-reduce goes
through a :class:`~functional_fsdp.core.comm.Communicator`: one built from the ``DTensor`` 's mesh
(:class:`~functional_fsdp.shell.comm.process_group.ProcessGroupComm` over the shard dim's process group), or
one the caller passes (e.g. a simulated world's). A ``DTensor`` sharded over several mesh dims
(2-D FSDP + TP: ``(_StridedShard(0), Shard(0))`` on ``(dp, tp)``) is summed over each in turn, so
the norm covers the full mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..core._tree import tree_leaves
from ..core.comm import Communicator
from ..core.errors import ReproducibilityError, StepInputError
from ..core.reproducible import canonical_norm, gather_row_sums, row_square_sums

__all__ = ["canonical_global_norm", "clip_grad_norm_", "global_norm"]

_Key = tuple[Any, tuple[int, ...]]
_Comms = tuple[Communicator, ...]


def _local(t: Any) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _is_shard(p: Any) -> bool:
    # FSDP2's dp placement under TP is _StridedShard, which is not a Shard subclass.
    return isinstance(p, (Shard, _StridedShard))


def _shard_key(t: Any) -> _Key | None:
    """``(mesh, sharded mesh dims)`` of a sharded ``DTensor``: every dim it is split over (dp
    and, under 2-D FSDP + TP, tp); ``None`` for anything unsharded."""
    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh
    dims = tuple(d for d, p in enumerate(t.placements) if _is_shard(p) and mesh.size(d) > 1)
    return (mesh, dims) if dims else None


def _comm_for(key: _Key | None, comms: dict[Any, Communicator]) -> _Comms:
    """One communicator per sharded mesh dim of ``key`` (cached per ``(mesh, dim)``)."""
    if key is None:
        return ()
    mesh, dims = key
    out = []
    for dim in dims:
        if (mesh, dim) not in comms:
            from ..shell import ProcessGroupComm  # the optimizer half stays shell-free

            comms[(mesh, dim)] = ProcessGroupComm.for_mesh(mesh, dim)
        out.append(comms[(mesh, dim)])
    return tuple(out)


def norm_by_groups(
    locals_: Sequence[torch.Tensor],
    groups: Sequence[tuple[_Comms | Communicator | None, Sequence[int]]],
    *,
    extra: torch.Tensor | None = None,
    extra_comm: Communicator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global norm of local shards grouped by communicators (one per mesh dim the group is
    sharded over, summed in turn; none: not reduced).

    ``extra`` (a 0-d float tensor, e.g. a loss) is summed over ``extra_comm`` in the same
    all-reduce as the squares of the group whose first communicator it is, saving a collective.
    Returns ``(norm, summed extra)``.
    """
    norms = torch._foreach_norm(list(locals_)) if locals_ else []
    by_comms = [(_as_comms(c), idx) for c, idx in groups]
    if len(by_comms) == 1 and not by_comms[0][0] and extra is None and norms:
        # Unsharded: exactly clip_grad_norm_'s arithmetic (the norm of the norms).
        return torch.linalg.vector_norm(torch.stack(list(norms))), None
    per_tensor = []
    for comms, idx in by_comms:
        # clip_grad_norm_ on DTensors reduces each tensor's norm (its local norm ** 2 summed
        # over ranks, then ** 0.5) and takes the norm of those: the same ops, bit for bit, with
        # one all-reduce of the vector of squares per group and sharded mesh dim.
        local = torch.stack([norms[i].float() for i in idx])
        if not comms:
            per_tensor.append(local)
            continue
        sq = local**2.0
        for k, comm in enumerate(comms):
            if k == 0 and extra is not None and comm is extra_comm:
                buf = torch.cat([sq, extra.float().reshape(1)])
                comm.all_reduce(buf)
                sq, extra, extra_comm = buf[:-1], buf[-1], None
            else:
                comm.all_reduce(sq)
        per_tensor.append(sq**0.5)
    if extra is not None and extra_comm is not None:
        extra = extra.float().clone()
        extra_comm.all_reduce(extra)
    if not per_tensor:
        return torch.zeros((), dtype=torch.float32), extra
    return torch.linalg.vector_norm(torch.cat(per_tensor)), extra


def _as_comms(c: _Comms | Communicator | None) -> _Comms:
    if c is None:
        return ()
    return c if isinstance(c, tuple) else (c,)


def global_norm(tree: Any, *, comm: Communicator | None = None) -> torch.Tensor:
    """The 2-norm of all the tensors of ``tree`` together, across shards.

    Sharded ``DTensor`` leaves (``Shard`` placement) contribute their local shards, summed over
    their mesh's shard group with one all-reduce per group; plain tensors are local to this
    rank, or, with ``comm``, this rank's shards of tensors sharded over ``comm`` 's ranks.
    Every rank of a group must call it (it is a collective there).

    Args:
        tree: a pytree of tensors (a dict of gradients, a record, a list).
        comm: the communicator plain-tensor leaves are sharded over (``None``: not sharded).

    Returns:
        A 0-d float32 tensor, the same on every rank.

    Example:
        >>> import torch
        >>> from functional_fsdp.functional import global_norm
        >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])})
        tensor(5.)
    """
    leaves = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    comms: dict[Any, Communicator] = {}
    keys: list[Any] = []
    groups: list[tuple[_Comms, list[int]]] = []
    for i, t in enumerate(leaves):
        key = _shard_key(t)
        c = _comm_for(key, comms) if key is not None else _as_comms(comm)
        gkey = key if key is not None else ("plain", id(comm))
        if gkey not in keys:
            keys.append(gkey)
            groups.append((c, []))
        groups[keys.index(gkey)][1].append(i)
    norm, _ = norm_by_groups([_local(t) for t in leaves], groups)
    return norm


class StepNorms:
    """The training step's reductions: the gradient norm and the global mean loss.

    Built once per step function from the trainable parameters (``DTensor`` s): one
    communicator per shard group, plus the data-parallel groups the loss is averaged over (every
    dim of the parameters' mesh). The loss rides in the gradient norm's all-reduce.

    Args:
        params: the trainable parameters, in the order the step keeps gradients.
        names: their names.
    """

    def __init__(
        self, params: Sequence[Any], names: Sequence[str], *, canonical: bool = False
    ) -> None:
        self.names = list(names)
        # ReproduciblePolicy: the norm of canonical_global_norm (the same bits on every world
        # size), over the gradients as DTensors with the parameters' specs.
        self._specs = (
            [p._spec if isinstance(p, DTensor) else None for p in params] if canonical else None
        )
        comms: dict[Any, Communicator] = {}
        keys: list[Any] = []
        self.groups: list[tuple[_Comms, list[int]]] = []
        for i, p in enumerate(params):
            key = _shard_key(p)
            if key not in keys:
                keys.append(key)
                self.groups.append((_comm_for(key, comms), []))
            self.groups[keys.index(key)][1].append(i)
        mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
        self.loss_comms: list[Communicator] = []
        self.dp_size = 1
        if mesh is not None:
            for dim in range(mesh.ndim):
                if mesh.size(dim) > 1:
                    self.loss_comms.extend(_comm_for((mesh, (dim,)), comms))
                    self.dp_size *= mesh.size(dim)
        self._cache: tuple[list[int], torch.Tensor] | None = None

    def norm_and_loss(
        self, grads: Sequence[torch.Tensor], loss_sum: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(global grad norm, loss summed over the data-parallel ranks / their count)``."""
        first = self.loss_comms[0] if self.loss_comms else None
        if self._specs is not None:
            norm = self._canonical(grads)
            loss = loss_sum.float().clone()
            for c in self.loss_comms:
                c.all_reduce(loss)
            self._cache = ([id(g) for g in grads], norm)
            return norm, loss / self.dp_size
        norm, summed = norm_by_groups(grads, self.groups, extra=loss_sum, extra_comm=first)
        assert summed is not None
        for c in self.loss_comms[1:]:
            c.all_reduce(summed)
        self._cache = ([id(g) for g in grads], norm)
        return norm, summed / self.dp_size

    def norm_fn(self, tree: Any) -> torch.Tensor:
        """``global_norm_fn`` for :func:`~.transforms.clip_by_global_norm` inside the step.

        ``tree`` is ``{name: local shard}`` of the trainable parameters; the norm of the very
        gradients :meth:`norm_and_loss` saw is reused (no second all-reduce).
        """
        if not isinstance(tree, dict) or set(tree) != set(self.names):
            raise StepInputError(
                "the training step's global_norm_fn takes {name: local shard} of the trainable "
                f"parameters, got {type(tree).__name__}"
            )
        locals_ = [tree[n] for n in self.names]
        if self._cache is not None and self._cache[0] == [id(t) for t in locals_]:
            return self._cache[1]
        if self._specs is not None:
            return self._canonical(locals_)
        return norm_by_groups(locals_, self.groups)[0]

    def _canonical(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        assert self._specs is not None
        return canonical_global_norm(
            [
                t if spec is None else DTensor(t, spec, requires_grad=False)
                for t, spec in zip(locals_, self._specs)
            ]
        )


# ------------------------------------------------------------------------------ reproducible


def _row_comm(t: Any, comms: dict[Any, Communicator]) -> Communicator | None:
    """The communicator ``t`` 's dim-0 rows are sharded over (``None``: all rows are here)."""
    key = _shard_key(t)
    if key is None:
        return None
    mesh, dims = key
    placements = t.placements
    if len(dims) != 1 or not (
        isinstance(placements[dims[0]], Shard) and placements[dims[0]].dim == 0
    ):
        raise ReproducibilityError(
            f"a reproducible norm sums per dim-0 row; a tensor placed {tuple(placements)} on a "
            f"{mesh.ndim}-D mesh splits its rows otherwise (only Shard(0) over one mesh dim, "
            "with Replicate elsewhere, is supported: 1-D FSDP and HSDP)"
        )
    return _comm_for(key, comms)[0]


def canonical_global_norm(tensors: Any) -> torch.Tensor:
    """The 2-norm of all the tensors of ``tensors`` together, with bits that do not depend on
    how they are sharded: each rank sums the squares of each of its dim-0 rows, one all-gather
    per shard group collects every row, and one fixed pairwise tree adds all rows of all tensors
    (in the order given). The same on 1, 2, 4, ... ranks (see ``docs/reproducibility.md``); a
    collective on every rank of the tensors' shard groups.

    Args:
        tensors: a pytree of tensors: sharded ``DTensor`` s (``Shard(0)``, 1-D FSDP or HSDP) or
            plain tensors held whole by this rank.
    """
    leaves = [t for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)]
    comms: dict[Any, Communicator] = {}
    by_comm: dict[int, tuple[Communicator, list[int]]] = {}
    rows = [row_square_sums(_local(t)) for t in leaves]
    for i, t in enumerate(leaves):
        comm = _row_comm(t, comms)
        if comm is not None:
            by_comm.setdefault(id(comm), (comm, []))[1].append(i)
    for comm, idx in by_comm.values():
        full = gather_row_sums([rows[i] for i in idx], [leaves[i].shape[0] for i in idx], comm)
        for i, r in zip(idx, full):
            rows[i] = r
    return canonical_norm(rows)


def clip_grad_norm_(
    parameters: Any, max_norm: float, *, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) for sharded parameters whose norm has the
    same bits on every world size: the norm is :func:`canonical_global_norm` of the gradients,
    and every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))`` in place, as torch
    does. Returns the total norm (a plain 0-d float32 tensor, the same on every rank).

    Args:
        parameters: an iterable of parameters (or one tensor) whose ``.grad`` to clip.
        max_norm: the largest norm allowed.
        error_if_nonfinite: raise when the total norm is ``nan`` or ``inf``.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    total = canonical_global_norm(grads)
    if error_if_nonfinite and not torch.isfinite(total):
        raise StepInputError(
            f"the total norm of the gradients is {total.item()}, so they cannot be clipped; "
            "pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    locals_ = [_local(g) for g in grads]
    for dtype in {t.dtype for t in locals_}:
        same = [t for t in locals_ if t.dtype == dtype]
        torch._foreach_mul_(same, coef.to(dtype=dtype, device=same[0].device))
    return total
