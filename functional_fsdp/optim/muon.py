"""Muon for sharded parameters: each 2-D matrix is orthogonalized whole, by one owner rank.

``torch.optim.Muon`` runs its Newton-Schulz iteration on whatever tensor it is given. On an FSDP
parameter that is a row-sharded ``DTensor``, and the result is not the single-process one
(measured on 2 gloo ranks, a 64->48->32 MLP, lr 0.02: the parameters differ from one process by
0.0026 after one step whose largest change is 0.0066). :class:`Muon` takes the same arguments
and computes torch's math on whole matrices: the momentum is updated on the local pieces, the
pieces go to the matrix's owner (:mod:`._whole_matrix`), the owner runs Newton-Schulz, and each
rank gets its piece of the orthogonalized update back. That holds for FSDP and HSDP (row
pieces), tensor parallel and 2-D FSDP x TP (``fully_shard`` over ``dp`` after
``parallelize_module`` on ``tp``: the owner gathers the global matrix across dp and tp in one
hop). Parameters that are not 2-D are stepped with AdamW (element-wise, on the local shards),
as the usual Muon recipe does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as _torch_adamw

from ..core.errors import HyperparameterError, WholeMatrixError
from ._whole_matrix import (
    ExchangeStats,
    MatrixLayout,
    map_whole_matrices,
    matrix_layout,
    plan_owners,
)

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "EPS",
    "Muon",
    "adjust_lr",
    "newton_schulz",
]

# torch.optim.Muon's constants (torch 2.13, from Keller Jordan's Muon).
EPS = 1e-7
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def newton_schulz(
    matrix: torch.Tensor,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = EPS,
) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalization of ``torch.optim.Muon`` (same ops, same
    order, bfloat16), on a whole 2-D matrix.

    Args:
        matrix: the whole matrix (any float dtype; it is cast to bfloat16 first, so passing it
            in bfloat16 gives the same result).
        ns_coefficients: ``(a, b, c)`` of the polynomial.
        ns_steps: iterations (< 100).
        eps: lower bound of the Frobenius norm the matrix is divided by.

    Returns:
        A bfloat16 matrix of the same shape, approximately ``U V^T`` of ``matrix = U S V^T``.

    Example:
        >>> import torch
        >>> q = newton_schulz(torch.eye(3) * 5)  # singular values 5 -> about 0.68, not 1
        >>> round(q[0, 0].item(), 2), bool((q.float() - q[0, 0].float() * torch.eye(3)).any())
        (0.68, False)
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if matrix.ndim != 2:
        raise WholeMatrixError(f"newton_schulz needs a 2-D matrix, got {tuple(matrix.shape)}")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    # Out of place (torch divides in place): a bfloat16 input is never modified.
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """``torch.optim.Muon`` 's learning-rate adjustment for a matrix of ``shape`` (the global
    shape, not a shard's).

    Args:
        lr: the learning rate.
        adjust_lr_fn: ``None`` / ``"original"`` (``sqrt(max(1, rows / cols))``) or
            ``"match_rms_adamw"`` (``0.2 * sqrt(max(rows, cols))``).
        shape: the matrix's shape.
    """
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for FSDP-sharded parameters (and plain ones), plus AdamW for the
    parameters that are not matrices.

    Takes ``torch.optim.Muon`` 's arguments with the same defaults and math (momentum, Nesterov,
    Newton-Schulz coefficients, steps and eps, ``adjust_lr_fn`` on the global shape, decoupled
    weight decay). Each 2-D parameter is orthogonalized as a whole matrix by one owner rank: a
    plain tensor, or a ``DTensor`` as ``fully_shard`` makes it (``Shard(0)``; HSDP's
    ``(Replicate(), Shard(0))``), as tensor parallel makes it (``Shard(0)`` / ``Shard(1)``), or
    both (2-D FSDP x TP: ``(Shard(0), Shard(1))`` or ``(_StridedShard(0), Shard(0))`` on
    ``(dp, tp)``, with HSDP's replicate dim in front or not). Owners are assigned round-robin
    by size, largest first, over the ranks the matrix is split over (``dp x tp`` of them under
    2-D), so each rank does about ``1/N`` of the Newton-Schulz work; the other ranks do not
    compute the matrix (replicas, HSDP's or a ``Replicate()`` tp dim's, each compute it once).
    The pieces travel in bfloat16 (Newton-Schulz starts by casting to bfloat16), the gathers of
    the next matrix overlap the current one's iteration. A placement the engine cannot gather
    (``Partial``, a strided shard that is not FSDP's) raises
    :class:`~functional_fsdp.core.errors.WholeMatrixError` at construction.

    Param groups may set ``use_muon``: ``None`` (default) routes 2-D parameters to Muon and the
    rest (biases, norms) to AdamW; ``False`` sends the group to AdamW (embeddings and output
    heads, as in Keller Jordan's recipe); ``True`` insists on Muon, and a parameter that is not
    2-D raises :class:`~functional_fsdp.core.errors.WholeMatrixError`. AdamW uses the ``adamw_*``
    hyper-parameters (``torch.optim.AdamW`` 's defaults) and is ``torch.optim.AdamW`` 's own
    functional kernel on the local shards; its state has AdamW's keys (``step``, ``exp_avg``,
    ``exp_avg_sq``), Muon's has ``momentum_buffer``, as ``DTensor`` s like the parameters, so
    ``state_dict()`` and distributed checkpoints work as for torch's optimizers.

    Every rank of the mesh must step together with the same parameters having gradients (as
    with any FSDP optimizer): the exchange is point-to-point between the ranks of each matrix
    (over the default process group when a matrix is split over several mesh dims).

    Args:
        params: parameters or param groups.
        lr: Muon's learning rate.
        weight_decay: Muon's decoupled weight decay.
        momentum: momentum factor.
        nesterov: Nesterov momentum.
        ns_coefficients: Newton-Schulz ``(a, b, c)``.
        eps: Newton-Schulz's norm floor.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None``, ``"original"`` or ``"match_rms_adamw"``.
        adamw_lr: AdamW's learning rate for the other parameters.
        adamw_betas: AdamW's betas.
        adamw_eps: AdamW's eps.
        adamw_weight_decay: AdamW's decoupled weight decay.

    Example:
        >>> import torch
        >>> from functional_fsdp.optim import Muon
        >>> model = torch.nn.Linear(4, 3)
        >>> opt = Muon(model.parameters(), lr=0.02)  # weight: Muon, bias: AdamW
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
    ) -> None:
        _check_hyperparams(lr, momentum, weight_decay, adjust_lr_fn, adamw_lr, adamw_betas)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "use_muon": None,
            "adamw_lr": adamw_lr,
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        }
        super().__init__(params, defaults)
        # ``id(param) -> layout``: checked now, so a bad placement fails at construction and
        # never inside the exchange.
        self._layouts: dict[int, MatrixLayout] = {}
        self._plans: dict[tuple[int, ...], tuple[MatrixLayout, ...]] = {}
        self.last_exchange = ExchangeStats()
        for gi, group in enumerate(self.param_groups):
            self._check_group(gi, group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (checked as at construction)."""
        super().add_param_group(param_group)
        if hasattr(self, "_layouts"):
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])

    def _check_group(self, gi: int, group: dict[str, Any]) -> None:
        use = group["use_muon"]
        if use not in (None, True, False):
            raise ValueError(f"param group {gi}: use_muon must be None, True or False, got {use!r}")
        _check_hyperparams(
            group["lr"],
            group["momentum"],
            group["weight_decay"],
            group["adjust_lr_fn"],
            group["adamw_lr"],
            group["adamw_betas"],
        )
        for pi, p in enumerate(group["params"]):
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            if self._is_muon(group, p):
                self._layouts[id(p)] = matrix_layout(p, f"param group {gi}, parameter {pi}")
            elif use is True:
                raise WholeMatrixError(
                    f"param group {gi}, parameter {pi}: use_muon=True needs 2-D parameters, got "
                    f"shape {tuple(p.shape)}; put it in a group with use_muon=False (AdamW) or "
                    "leave use_muon unset to route non-2-D parameters to AdamW"
                )

    @staticmethod
    def _is_muon(group: dict[str, Any], p: torch.Tensor) -> bool:
        return group["use_muon"] is not False and p.ndim == 2

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of Muon (2-D parameters) and AdamW (the others).

        Args:
            closure: re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        frozen = self._initialising_state()
        matrices: list[tuple[dict[str, Any], torch.Tensor]] = []
        for group in self.param_groups:
            others: list[torch.Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                (matrices if self._is_muon(group, p) else others).append((group, p))  # type: ignore[arg-type]
            if others:
                self._adamw(group, [p for _, p in others], 0.0 if frozen else group["adamw_lr"])
        if matrices:
            self._muon(matrices)
        return loss

    def _initialising_state(self) -> bool:
        """Whether this step only initialises the state: no state yet, every group's ``lr`` 0
        and every gradient zero. That is how ``torch.distributed.checkpoint``'s
        ``get_state_dict`` / ``set_state_dict`` build a fresh optimizer's state (they zero
        ``lr``, which they know, and step on zero gradients); the AdamW part then steps with
        learning rate 0 too, so its weight decay leaves the parameters untouched, as torch's
        own optimizers do. (A real step like it moves only by that one weight decay.)"""
        if self.state or any(g["lr"] != 0 for g in self.param_groups):
            return False
        return all(
            not bool(_local(p.grad).any())
            for g in self.param_groups
            for p in g["params"]
            if p.grad is not None
        )

    def _adamw(self, group: dict[str, Any], params: list[torch.Tensor], lr: float) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                # torch.optim.AdamW's state: a float32 step and DTensor moments like p.
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        beta1, beta2 = group["adamw_betas"]
        # AdamW is element-wise: torch's own kernel on the local shards gives the same numbers
        # as torch.optim.AdamW on the DTensors, without DTensor dispatch per op.
        _torch_adamw(
            [_local(p) for p in params],
            [_local(p.grad) for p in params],  # type: ignore[arg-type]
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=group["adamw_weight_decay"],
            eps=group["adamw_eps"],
            maximize=False,
        )

    def _plan(self, params: list[torch.Tensor]) -> tuple[MatrixLayout, ...]:
        key = tuple(id(p) for p in params)
        if key not in self._plans:
            self._plans[key] = plan_owners([self._layouts[id(p)] for p in params])
        return self._plans[key]

    def _muon(self, matrices: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        wires: list[torch.Tensor] = []
        for group, p in matrices:
            state = self.state[p]
            full_grad = p.grad
            assert full_grad is not None
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    full_grad, memory_format=torch.preserve_format
                )
            grad = _local(full_grad)
            buf = _local(state["momentum_buffer"])
            m = group["momentum"]
            buf.lerp_(grad, 1 - m)
            update = grad.lerp(buf, m) if group["nesterov"] else buf
            # Newton-Schulz's first op is the cast to bfloat16: sending bfloat16 loses nothing.
            wires.append(update.bfloat16())
        layouts = self._plan([p for _, p in matrices])

        def orthogonalize(i: int, full: torch.Tensor) -> torch.Tensor:
            group = matrices[i][0]
            return newton_schulz(full, group["ns_coefficients"], group["ns_steps"], group["eps"])

        rows, self.last_exchange = map_whole_matrices(
            wires, layouts, orthogonalize, [torch.bfloat16] * len(wires)
        )
        for (group, p), lay, o in zip(matrices, layouts, rows):
            lr = group["lr"]
            local = _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(o, alpha=-adjust_lr(lr, group["adjust_lr_fn"], lay.global_shape))


def check_muon_hyperparams(momentum: float, weight_decay: float, adjust_lr_fn: str | None) -> None:
    """The Newton-Schulz step's settings, checked as torch.optim.Muon checks them (for this
    optimizer and ``functional.muon`` alike); ``HyperparameterError`` is a ``ValueError``."""
    if not momentum >= 0.0:
        raise HyperparameterError(f"momentum should be >= 0 but is: {momentum}")
    if not weight_decay >= 0.0:
        raise HyperparameterError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn not in _ADJUST_LR_FNS:
        raise HyperparameterError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


def _check_hyperparams(
    lr: float,
    momentum: float,
    weight_decay: float,
    adjust_lr_fn: str | None,
    adamw_lr: float,
    adamw_betas: Iterable[float],
) -> None:
    if isinstance(lr, torch.Tensor):
        raise ValueError("functional_fsdp.optim.Muon takes a float lr")
    if not lr >= 0.0:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    check_muon_hyperparams(momentum, weight_decay, adjust_lr_fn)
    if not adamw_lr >= 0.0:
        raise ValueError(f"adamw_lr should be >= 0 but is: {adamw_lr}")
    b1, b2 = adamw_betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"adamw_betas must be in [0, 1), got {tuple(adamw_betas)}")
