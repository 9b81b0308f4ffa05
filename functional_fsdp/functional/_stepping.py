"""Forward and backward of the training step over micro-batches (gradients of local shards)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointError

from ..core.errors import StepInputError, UnsupportedError
from ..core.reproducible import ReproduciblePolicy
from ..shell import DeferredReductions, TreeReductions

__all__ = [
    "Accumulated",
    "accumulate_grads",
    "add_micro_grads",
    "detached",
    "dp_size",
    "tree_grads",
]


@attrs.frozen(eq=False)
class Accumulated:
    """What the backward passes of one step produced.

    Attributes:
        grads: local shards of the summed gradients, in the trainable parameters' order.
        loss_sum: this rank's losses summed over the micro-batches (0-d float32).
        aux: ``loss_fn`` 's aux outputs (detached), one per micro-batch (empty without aux).
    """

    grads: list[torch.Tensor]
    loss_sum: torch.Tensor
    aux: list[Any]


class _LossCaller(nn.Module):
    """``forward(batch) = loss_fn(module, batch)``, so ``functional_call`` can run a loss."""

    def __init__(self, module: nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Any:
        return self.loss_fn(self.module, batch)


def _local(t: Any) -> Any:
    return t._local_tensor if isinstance(t, DTensor) else t


def _leaf(t: Any, requires_grad: bool) -> Any:
    """A new autograd leaf sharing ``t``'s data (a ``DTensor`` stays a ``DTensor``)."""
    if isinstance(t, DTensor):
        return DTensor(t._local_tensor, t._spec, requires_grad=requires_grad)
    return t.detach().requires_grad_(requires_grad)


def split_batch(batch: Any, k: int) -> list[Any]:
    """``batch`` as ``k`` micro-batches: every tensor split on dim 0 (evenly)."""
    if k == 1:
        return [batch]
    leaves, spec = pytree.tree_flatten(batch)
    parts: list[Any] = []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            if t.dim() == 0 or t.shape[0] % k != 0:
                raise StepInputError(
                    f"grad_accum={k}: every tensor of the batch must split evenly on dim 0, got "
                    f"shape {tuple(t.shape)}"
                )
            parts.append(t.chunk(k, dim=0))
        else:
            parts.append([t] * k)
    return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(k)]


def _loss_and_aux(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise StepInputError(
                f"has_aux=True: loss_fn must return a pair (loss, aux), got {type(out).__name__}"
            )
        loss, aux = out
    else:
        if isinstance(out, tuple):
            raise StepInputError(
                "loss_fn returned a tuple; if it is (loss, aux), make the step with has_aux=True"
            )
        loss, aux = out, None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise StepInputError(f"loss_fn must return a scalar tensor, got {shape}")
    return loss, aux


def _unsupported_checkpointing(err: Exception) -> UnsupportedError | None:
    text = str(err)
    # torch's own refusal of a reentrant checkpoint under torch.autograd.grad names
    # use_reentrant=False as the fix, which the functional step does not support either.
    reentrant = "use_reentrant=True" in text and ".grad()" in text
    if isinstance(err, CheckpointError) or "mixed torch.Tensor and DTensor" in text or reentrant:
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        return UnsupportedError(
            "the functional step does not support activation checkpointing "
            "(torch.utils.checkpoint / checkpoint_wrapper inside the model), the usual cause of "
            f"this backward failure ({first[:120]}): the recompute runs after functional_call "
            "has put the module's own parameters back. Train with the module API "
            "(loss.backward() + a torch optimizer) or drop the checkpointing"
        )
    return None


def _backward(
    model: nn.Module,
    loss: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    deferred: Any,
    tree: TreeReductions | None,
) -> tuple[torch.Tensor | None, ...]:
    try:
        grads = torch.autograd.grad(loss, list(inputs), allow_unused=True)
    except (RuntimeError, CheckpointError) as e:
        unsupported = _unsupported_checkpointing(e)
        if unsupported is None:
            raise
        model.reset_iter_state()  # type: ignore[operator]
        raise unsupported from e
    finally:
        deferred.wait()
    if tree is not None:
        tree.end_backward()  # a group's uses in this micro-batch make one leaf
    return grads


def detached(aux: Any) -> Any:
    """A micro-batch's aux output with every tensor detached (kept in the metrics)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), aux)


def add_micro_grads(
    acc: list[torch.Tensor] | None,
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """``acc`` plus one micro-batch's gradients as local shards (zeros where a parameter got
    none): ``acc`` summed in place, or the first micro-batch's shards when ``acc`` is ``None``."""
    locals_ = [
        _local(g) if g is not None else torch.zeros_like(_local(x)) for g, x in zip(grads, inputs)
    ]
    if acc is None:
        return locals_
    torch._foreach_add_(acc, locals_)
    return acc


def dp_size(params: Iterable[Any]) -> int:
    """The data-parallel world size of ``params`` (their first DTensor's mesh; 1 without)."""
    mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
    return 1 if mesh is None else mesh.size()


def tree_grads(tree: TreeReductions, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Reduce every group of ``tree`` once; the local gradients of ``inputs`` (zeros where a
    parameter got none)."""
    reduced = tree.finish()
    got = [reduced.get(id(x)) for x in inputs]
    return [g if g is not None else torch.zeros_like(_local(x)) for g, x in zip(got, inputs)]


def accumulate_grads(
    model: nn.Module,
    loss_fn: Any,
    params: dict[str, Any],
    trainable: Sequence[str],
    batch: Any,
    grad_accum: int,
    has_aux: bool,
    reproducible: ReproduciblePolicy | None = None,
) -> Accumulated:
    """Run forward and backward per micro-batch on ``params``; sum the local gradient shards
    (with ``reproducible``: in the canonical tree, reduced once after the last micro-batch)."""
    trainable_set = set(trainable)
    subs = {n: _leaf(t, n in trainable_set) for n, t in params.items()}
    inputs = [subs[n] for n in trainable]
    feed = {"module." + n: t for n, t in subs.items()}
    caller = _LossCaller(model, loss_fn)
    # Reductions overlap the rest of backward; their results are read after wait().
    deferred = DeferredReductions()
    tree = None if reproducible is None else TreeReductions(reproducible)
    if tree is not None:
        tree.tag(list(subs.values()))
    else:
        deferred.tag(inputs)
    acc: list[torch.Tensor] | None = None
    loss_sum = torch.zeros(())
    auxes: list[Any] = []
    for micro in split_batch(batch, grad_accum):
        loss, aux = _loss_and_aux(torch.func.functional_call(caller, feed, (micro,)), has_aux)
        loss_sum = loss_sum + loss.detach().float()
        if has_aux:
            auxes.append(detached(aux))
        grads = _backward(
            model, loss / grad_accum if grad_accum > 1 else loss, inputs, deferred, tree
        )
        del loss, aux  # drop the graph (and the packed shards its gathers kept) now
        if tree is not None:
            continue  # the gradients are in the tree
        acc = add_micro_grads(acc, grads, inputs)
    if tree is not None:
        acc = tree_grads(tree, inputs)
    assert acc is not None
    return Accumulated(acc, loss_sum, auxes)
