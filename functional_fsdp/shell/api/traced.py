"""The model's forward as one traceable function of its local shards (the compiled step's).

:class:`TracedModel` is what ``make_train_step(..., compile=...)`` compiles
(:mod:`functional_fsdp.functional.compiled`). It runs ``loss_fn`` on a *skeleton* of the model
(the same classes and submodules, the package's hooks dropped), whose FSDP modules each have one
traceable pre-forward hook instead of the eager engine's:

    when the first module of a bucket of groups starts its forward (once per call):
        flats = [pack_shards(this call's local shards of each group)]   # core/traced.py
        full = gather(*flats)        # one functional all-gather: a graph node; unpacked
        set full on the modules that hold the parameters               # full_params views

so the traced forward gathers each group where FSDP2 would, just before its module runs, and
its full parameters die after their last use. A bucket is adjacent groups that may share a
collective (:meth:`_GroupTrace.signature`), cut by the core's ``plan_buckets`` at the root's
``bucket_bytes``, as the eager path's buckets are. The attributes are removed before the trace ends
(a tensor left on a module would become a graph output and change the next call's guards).

``gather`` is an autograd function whose forward casts to the gather dtype (``param_dtype``),
all-gathers with PyTorch's traceable functional collectives and returns the full parameters,
and whose backward packs their gradients into rank rows at once (``pack_full_grads``) in the
reduce dtype and reduce-scatters them (HSDP: then all-reduces over the replicas), divided as
FSDP2 divides (the core's ``divide_factors``). With
``reshard_after_forward`` (the group's setting; the root's group keeps its parameters by
default, as FSDP2's lazy init decides) the gather and its unpacking are marked must-recompute
for AOTAutograd's partitioner, so the backward graph gathers again instead of keeping the full
parameters from the forward.

The skeleton keeps the mixed-precision policy's input and output casts as plain hooks; its
FSDP-managed parameters are not registered (``loss_fn`` reading ``module.parameters()`` sees
none of them).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ...core.coalesce import plan_buckets
from ...core.errors import UnsupportedError
from ...core.layout import DivideFactors
from ...core.records import GroupLayout
from ...core.reduction import reduce_divide_factors
from ...core.reproducible import canonical_mean
from ...core.traced import full_params, pack_full_grads, pack_shards, traceable_reason
from ..recovery.copies import model_groups
from .buckets import DEFAULT_BUCKET_BYTES
from .state import _cast_floats

__all__ = ["TracedModel"]


class _NoInPlaceNotice(logging.Filter):
    """Drops torch's notice that a checkpointed region must not mutate in place, logged once per
    process for every ``context_fn`` under ``torch.compile``: the regions here (a cast, an
    all-gather and views) have no in-place op."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_NoInPlaceNotice())

_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


@attrs.frozen
class _GroupTrace:
    """What the traced forward needs of one group: its parameters' names in layout order, the
    layout, the collectives' groups, FSDP2's divide factors and whether to re-gather in
    backward."""

    names: tuple[str, ...]
    layout: GroupLayout
    shard: Any  # (DeviceMesh, dim) of the shard group
    replicate: Any  # (DeviceMesh, dim) of the replicate group (HSDP), or None
    factors: DivideFactors
    recompute: bool
    # How the backward reduces: "scatter" (reduce-scatter, FSDP2's), "tree" (a
    # ReproduciblePolicy's canonical tree in the graph: one micro-batch per rank) or "outside"
    # (the graph hands out the full gradients; the caller reduces them in the tree).
    reduce: str = "scatter"

    def signature(self) -> tuple[Any, ...]:
        """What groups must share to travel in one collective: the process groups, the dtypes,
        the divide factors, whether the backward gathers again and how it reduces."""
        lay = self.layout
        return (
            _group_key(self.shard),
            _group_key(self.replicate),
            lay.world_size,
            lay.storage_dtype,
            lay.gather_buffer_dtype,
            lay.grad_reduce_dtype(),
            self.factors,
            self.recompute,
            self.reduce,
        )


def _group_key(group: Any) -> Any:
    """The process group a ``(mesh, dim)`` names (meshes built per ``fully_shard`` call are
    distinct objects over one group)."""
    return None if group is None else group[0].get_group(group[1]).group_name


def _bucket_gather(
    members: list[_GroupTrace],
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``fn(*flats) -> full parameters`` of a bucket of groups sharing a :meth:`signature`: one
    all-gather of their packed shards side by side (an autograd function whose backward is one
    reduce-scatter, in the reduce dtype, divided as FSDP2 divides, then HSDP's all-reduce) and
    each member's unpacking views, every member's parameters in one flat tuple. With
    ``recompute``, the whole region is recomputed in backward rather than kept."""
    first = members[0]
    lay, shard, replicate, df = first.layout, first.shard, first.replicate, first.factors
    gather_dtype = lay.gather_buffer_dtype
    reduce_dtype = lay.grad_reduce_dtype()
    storage_dtype = lay.storage_dtype
    ws, ar_size = lay.world_size, _size(replicate)
    totals = [m.layout.gather.total for m in members]

    layouts = [m.layout for m in members]
    counts = [len(lay_m) for lay_m in layouts]

    class _Gather(torch.autograd.Function):
        """Forward: one all-gather of the bucket's packed shards, unpacked into every member's
        full parameters. Backward: their gradients packed into rank rows at once
        (``pack_full_grads``), one reduce-scatter (HSDP: then one all-reduce)."""

        @staticmethod
        def forward(ctx: Any, flat: torch.Tensor, *sinks: torch.Tensor) -> tuple[torch.Tensor, ...]:
            del sinks  # "outside": what the full gradients are handed out as (see backward)
            gathered = funcol.wait_tensor(_all_gather(flat.to(gather_dtype), 0, shard))
            rows = gathered.view(ws, sum(totals))
            out: list[torch.Tensor] = []
            start = 0
            for m_lay, total in zip(layouts, totals):
                out.extend(full_params(rows.narrow(1, start, total), m_lay))
                start += total
            return tuple(out)

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
            if first.reduce == "outside":  # as the gradients of the sinks, unreduced
                return (None, *grads)
            parts, k = [], 0
            for m_lay, n in zip(layouts, counts):
                parts.append(pack_full_grads(grads[k : k + n], m_lay, reduce_dtype))
                k += n
            g = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
            if first.reduce == "tree":
                return _tree_reduce(g, shard, replicate).to(storage_dtype)
            g = df.scale_input(g)
            g = funcol.wait_tensor(_reduce_scatter(g.reshape(-1), "sum", 0, shard))
            if df.op == "avg":
                g = g / ws
            if replicate is not None:
                g = funcol.wait_tensor(funcol.all_reduce(g, "sum", replicate))
                if df.all_reduce_op == "avg":
                    g = g / ar_size
            return df.scale_output(g).to(storage_dtype)

    def gathered(*flats: torch.Tensor, sinks: tuple[torch.Tensor, ...] = ()) -> Any:
        return _Gather.apply(torch.cat(flats) if len(flats) > 1 else flats[0], *sinks)

    if not first.recompute:
        return gathered

    def regathered(*flats: torch.Tensor, sinks: tuple[torch.Tensor, ...] = ()) -> Any:
        return checkpoint(
            gathered,
            *flats,
            sinks=sinks,
            use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, _must_recompute),
        )

    return regathered


def _tree_reduce(rows: torch.Tensor, shard: Any, replicate: Any) -> torch.Tensor:
    """A ReproduciblePolicy's reduction of one micro-batch's packed gradient rows (one
    micro-batch per rank: this rank's leaf is its subtree), as the eager engine's
    (:func:`~functional_fsdp.core.reproducible.finish_tree_reduce`): one all-to-all gives this
    rank every rank's row of its shard, added pairwise in rank order; under HSDP the replicas'
    sums are all-gathered and added pairwise in replica order; then the exact power-of-two
    average (the core's :func:`~functional_fsdp.core.reproducible.canonical_mean`, here with
    functional collectives)."""
    ws, total = rows.shape
    pieces = rows.reshape(-1)
    if ws > 1:
        pieces = funcol.wait_tensor(funcol.all_to_all_single(pieces, None, None, shard))
    return canonical_mean(
        pieces.view(ws, total),
        _size(replicate),
        lambda out: funcol.wait_tensor(_all_gather(out, 0, replicate)),
    )


def _buckets(traces: list[_GroupTrace], bucket_bytes: int | None) -> list[list[int]]:
    """Adjacent groups of one signature cut by the core's :func:`plan_buckets` (the eager
    path's rule), as lists of group indices."""
    size = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    out: list[list[int]] = []
    run: list[int] = []

    def close() -> None:
        if run:
            nbytes = [
                traces[i].layout.gather.total
                * traces[i].layout.world_size
                * traces[i].layout.gather_buffer_dtype.itemsize
                for i in run
            ]
            cut = plan_buckets([str(i) for i in run], nbytes, [True] * len(run), size)
            out.extend([int(n) for n in bucket.groups] for bucket in cut)
            run.clear()

    for i, t in enumerate(traces):
        if run and traces[run[-1]].signature() != t.signature():
            close()
        run.append(i)
    close()
    return out


def _must_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, op, args, kwargs
    return CheckpointPolicy.MUST_RECOMPUTE


def _size(group: Any) -> int:
    return 1 if group is None else group[0].size(group[1])


def _group_traces(model: nn.Module, where: str, reduce: str = "scatter") -> list[_GroupTrace]:
    """Every group of ``model`` as a :class:`_GroupTrace`, or a named error for what the trace
    does not cover (raised before any collective; ``where`` names the caller). ``reduce``: how
    the backward reduces (:attr:`_GroupTrace.reduce`)."""
    names = {id(p): n for n, p in model.named_parameters()}
    root = getattr(model, "_ffsdp_state", None)
    traces = []
    for g, path in model_groups(model):
        why = traceable_reason(g.layout)
        if why is None and g.tp is not None:
            why = "it is sharded with tensor parallelism (a 2-D mesh)"
        if why is None and g.config.reproducible is not None and reduce == "scatter":
            why = (
                "its gradients are reduced in a ReproduciblePolicy's canonical tree, which "
                "compile_backward does not write as graph nodes (make_train_step does)"
            )
        if why is None and g.config.grad_compression is not None:
            why = "its gradients are compressed (grad_compression)"
        if why is None and g.offload:
            why = "its parameters are offloaded to the CPU (OffloadPolicy)"
        if why is not None:
            raise UnsupportedError(
                f"{where}(compile=...): group {path} cannot be traced: {why}; make the "
                "step without compile (the eager functional step supports it)"
            )
        params = [getattr(m, attr) for m, attr in (h[0] for h in g.holders)]
        hsdp = g.mesh.ndim == 2
        df = reduce_divide_factors(g.layout, g.mesh.size(0) if hsdp else 1, g.reduce_policy())
        traces.append(
            _GroupTrace(
                tuple(names[id(p)] for p in params),
                g.layout,
                (g.mesh, 1 if hsdp else 0),
                (g.mesh, 0) if hsdp else None,
                df,
                _regathers(g, root),
                reduce,
            )
        )
    return traces


def _regathers(group: Any, root: Any) -> bool:
    """Whether the backward gathers ``group`` again: its ``reshard_after_forward`` (an int
    sub-group counts as resharding: the trace gathers from the whole shard group), except the
    root's group by default, which FSDP2 keeps after forward (as the eager path's lazy init
    does)."""
    if root is not None and group is root.group and root.user_reshard_after_forward is None:
        return False
    return group.config.reshard_after_forward is not False


# ------------------------------------------------------------------------------ the skeleton


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


#: What a skeleton module keeps of its own: everything else is the original's, read again
#: before every call (:func:`_refresh`).
_OWN = frozenset({"_parameters", "_buffers", "_modules", "_ffsdp_state", *_HOOK_DICTS})


def _refresh(pairs: list[tuple[nn.Module, nn.Module]]) -> None:
    """Each skeleton module takes its original's attributes and buffers as they are now: a
    setting changed after the step was built (``model.train()``/``eval()``, a flag the
    forward reads, a buffer reassigned) reaches the traced forward, as it reaches the module's
    own (torch.compile's guards on them recompile where they change the graph)."""
    for orig, new in pairs:
        d = new.__dict__
        for k, v in orig.__dict__.items():
            if k not in _OWN:
                d[k] = v
        if new._buffers.keys() != orig._buffers.keys() or any(
            new._buffers[k] is not b for k, b in orig._buffers.items()
        ):
            new._buffers = dict(orig._buffers)


def _skeleton(model: nn.Module, gathered: set[int]) -> tuple[nn.Module, dict[int, nn.Module]]:
    """A hook-free stand-in for ``model``: the same classes (FSDP's subclasses undone) and
    attributes, buffers shared, the package's forward hooks dropped and the mixed-precision
    casts kept as plain hooks. Parameters whose id is in ``gathered`` are left out (the traced
    forward sets them, gathered, as plain attributes); any other is a meta tensor of its full
    shape (ties kept). Also returns each original module's copy, by id."""
    placeholders: dict[int, nn.Parameter] = {}
    done: dict[int, nn.Module] = {}

    def meta(p: torch.Tensor) -> nn.Parameter:
        if id(p) not in placeholders:
            shape = p.shape  # a DTensor's is the full shape
            placeholders[id(p)] = nn.Parameter(
                torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
            )
        return placeholders[id(p)]

    def copy(m: nn.Module) -> nn.Module:
        if id(m) in done:
            return done[id(m)]
        cls = type(m)
        state = getattr(m, "_ffsdp_state", None)
        if state is not None:
            cls = next(c for c in cls.__mro__[1:] if "FSDP" not in c.__name__ and c is not object)
        new = cls.__new__(cls)
        new.__dict__.update(m.__dict__)
        new.__dict__.pop("_ffsdp_state", None)
        new._parameters = {
            k: None if p is None else meta(p)
            for k, p in m._parameters.items()
            if p is None or id(p) not in gathered
        }
        new._buffers = dict(m._buffers)
        for d in _HOOK_DICTS:
            hooks = getattr(m, d, None)
            if hooks is not None:
                setattr(
                    new,
                    d,
                    hooks.__class__(
                        (k, h)
                        for k, h in hooks.items()
                        if not getattr(h, "__module__", "").startswith("functional_fsdp.")
                    )
                    if not isinstance(hooks, set)
                    else set(),
                )
        done[id(m)] = new
        new._modules = {k: None if c is None else copy(c) for k, c in m._modules.items()}
        if state is not None:
            _keep_casts(new, state.mp_policy)
        return new

    return copy(model), done


def _keep_casts(module: nn.Module, policy: Any) -> None:
    """The mixed-precision policy's input and output casts of one FSDP module, as hooks."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        dtype = policy.param_dtype
        module.register_forward_pre_hook(
            lambda m, args, kwargs: _cast_floats((args, kwargs), dtype), with_kwargs=True
        )
    if policy.output_dtype is not None:
        out_dtype = policy.output_dtype
        module.register_forward_hook(lambda m, args, out: _cast_floats(out, out_dtype))


class TracedModel:
    """``model``'s forward through ``loss_fn`` as one function of this rank's local shards,
    for ``torch.compile`` (see the module docstring).

    Args:
        model: the root module sharded with ``fully_shard``.
        loss_fn: ``loss_fn(module, batch)``, called with the skeleton.
        reduce: how the backward reduces: ``"scatter"`` (FSDP2's reduce-scatter), ``"tree"``
            (a ReproduciblePolicy's canonical tree, in the graph: one micro-batch per rank) or
            ``"outside"`` (no reduction in the graph: each parameter's full gradient is the
            gradient of its *sink*, an input of :meth:`forward`, for the caller to reduce).
        where: the caller, named in errors.

    Raises:
        UnsupportedError: a group the trace does not cover (tensor parallelism, an all-gather
            codec, a shard dim other than 0, mixed dtypes in a group, compression, offload, a
            group's ``ReproduciblePolicy`` without ``tree``); raised before any collective.

    Attributes:
        order: the parameters' names (``named_parameters``) in :meth:`forward`'s input order.
        groups: the model's groups (``model_groups`` order: their parameters are :attr:`order`'s
            consecutive runs).
        layouts: each group's layout, in that order.
        buckets: the groups (indices in ``model_groups`` order) that share one all-gather and
            one reduce-scatter: adjacent groups of one :meth:`_GroupTrace.signature`, up to the
            root's ``bucket_bytes`` of unsharded parameters (``set_bucket_bytes``; 0: one
            collective per group), as the eager path's buckets.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Any,
        *,
        reduce: str = "scatter",
        where: str = "make_train_step",
    ) -> None:
        traces = _group_traces(model, where, reduce)
        self.layouts = [t.layout for t in traces]
        self.order = [n for t in traces for n in t.names]
        # The global ranks of the model's meshes (the ranks whose graphs must agree), and the
        # (mesh, dim)s that reach all of them (a flag reduced over each reaches every rank).
        meshes = [g for t in traces for g in (t.shard, t.replicate) if g]
        self.ranks = sorted({int(r) for mesh, _ in meshes for r in mesh.mesh.flatten()})
        self.mesh_dims = list({_group_key(g): g for g in meshes}.values())
        self.groups = groups = [g for g, _ in model_groups(model)]
        holders = [g.holders for g in groups]
        gathered = {id(getattr(m, a)) for hs in holders for h in hs for m, a in h}
        skeleton, copies = _skeleton(model, gathered)
        self._skeleton, self._loss_fn = skeleton, loss_fn
        self._pairs = [(m, copies[id(m)]) for m in model.modules()]
        # Filled by forward(): this call's local shards, and which buckets it has gathered.
        self._box: dict[str, Any] = {}
        starts = [0]
        for t in traces:
            starts.append(starts[-1] + len(t.names))
        # Each group's parameters' holders in the skeleton, in layout order, as (index into
        # _holding, attribute): a module reached by one path only, so dynamo's guards need not
        # check that two paths reach one object (52 such guards a compile of a 2-block model).
        holding = list({id(m): m for hs in holders for h in hs for m, _ in h}.values())
        self._holding = [copies[id(m)] for m in holding]
        index = {id(m): k for k, m in enumerate(holding)}
        self._targets = [
            tuple(tuple((index[id(m)], a) for m, a in h) for h in holders[i])
            for i in range(len(groups))
        ]
        self.buckets = _buckets(
            traces, getattr(getattr(model, "_ffsdp_state", None), "bucket_bytes", None)
        )
        for b, members in enumerate(self.buckets):
            hook = self._hook(
                b,
                _bucket_gather([traces[i] for i in members]),
                [(starts[i], traces[i].layout) for i in members],
                [t for i in members for t in self._targets[i]],
            )
            for i in members:
                for m in model.modules():
                    state = getattr(m, "_ffsdp_state", None)
                    if state is not None and state.group is groups[i]:
                        copies[id(m)].register_forward_pre_hook(hook)

    def _hook(self, *bound: Any) -> Callable[[nn.Module, Any], None]:
        """``_gather`` with its bucket's arguments bound, as a plain function. It is appended
        to the module's hooks, not prepended: torch 2.11's dynamo built guards that read the
        wrong hook (a cast hook's dtype, a function's ``.args``) after a prepend."""

        def hook(module: nn.Module, args: Any) -> None:
            self._gather(*bound, module, args)  # type: ignore[call-arg]

        return hook

    def _gather(
        self,
        b: int,
        gather: Callable[..., tuple[torch.Tensor, ...]],
        shards: list[tuple[int, GroupLayout]],
        targets: list[Any],
        module: nn.Module,
        args: Any,
    ) -> None:
        """Bucket ``b``'s pre-forward in the trace (the first of its groups' modules to run):
        gather its groups' full parameters from this call's shards, once per call, and set
        them on the modules that hold them."""
        del module, args
        done = self._box["done"]
        if b in done:
            return
        done.add(b)
        locals_ = self._box["locals"]
        flats = [pack_shards(locals_[start : start + len(lay)], lay) for start, lay in shards]
        sinks = self._box["sinks"]
        if sinks:
            mine = tuple(sinks[start + k] for start, lay in shards for k in range(len(lay)))
            full = gather(*flats, sinks=mine)
        else:
            full = gather(*flats)
        for holders, v in zip(targets, full):
            for k, attr in holders:
                setattr(self._holding[k], attr, v)

    def refresh(self) -> None:
        """Give the skeleton its originals' attributes and buffers as they are now (see
        :func:`_refresh`). The caller calls it before each call of :meth:`forward`, outside
        the compiled function: dynamo then guards on the skeleton's attributes alone, and
        torch 2.11's dynamo cannot trace the copy (``module.__dict__.items()``)."""
        _refresh(self._pairs)

    def forward(
        self, locals_: list[torch.Tensor], batch: Any, sinks: list[torch.Tensor] | None = None
    ) -> Any:
        """``loss_fn(skeleton, batch)``, each group's full parameters gathered from ``locals_``
        (this rank's unpadded shards, in :attr:`order`) when its module's forward begins.
        ``sinks`` (``reduce="outside"`` only): one tensor per parameter, in :attr:`order`,
        whose gradient is that parameter's full gradient (any values: they are not read). The
        skeleton's settings are those of the last :meth:`refresh`."""
        self._box["locals"] = locals_
        self._box["sinks"] = sinks or []
        self._box["done"] = set()
        out = self._loss_fn(self._skeleton, batch)
        # Leave nothing behind: an attribute or entry still set when the trace ends would make
        # its tensor a graph output (kept alive) and change the next call's guards.
        for targets in self._targets:
            for holders in targets:
                for k, attr in holders:
                    if attr in self._holding[k].__dict__:
                        delattr(self._holding[k], attr)
        self._box.clear()
        return out
