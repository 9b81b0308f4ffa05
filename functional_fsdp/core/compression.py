"""Compressed gradient reduction, beyond FSDP2: a lower-precision reduce-scatter with error
feedback kept in the pure state.

FSDP2 reduce-scatters gradients in the reduce dtype (fp32 or bf16) and sums them on the wire.
A :class:`GradCompression` policy instead sends each peer its rows of the gradient in a narrow
format, the way DeepSpeed ZeRO++'s quantized gradients (qgZ) do:

1. pack the group's gradients in fp32 as ``(ws, S)`` rows (row ``r`` is rank ``r``'s shard),
   add the residual of the previous reduction (error feedback);
2. encode every peer's row: ``int8`` or ``float8_e4m3fn`` with one fp32 scale (absmax) per
   block of ``block_size`` elements, or a plain cast to ``bfloat16``/``float16``;
3. one all-to-all: row ``r`` goes to rank ``r`` (this rank's own row never leaves it and stays
   exact);
4. decode the received rows and sum them with the own row in fp32, in rank order.

Error feedback: what encoding dropped (``x - decode(encode(x))``) becomes the residual, added
to the next reduction's input, so the error does not accumulate over steps (the residual is
:attr:`~functional_fsdp.core.reduction.ReduceState.residual`: a value threaded beside the
sharded state, never hidden in the shell). It costs one fp32 buffer of the group's unsharded
gradient size per rank.

A non-finite gradient stays non-finite: a block holding ``inf``/``nan`` decodes as ``nan`` (a
gradient scaler still sees it), and that block's residual restarts at zero.

Pure: no ``torch.distributed``; the exchange is the injected communicator's ``all_to_all``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from .comm import Communicator, ThenWork, Work
from .errors import PolicyError
from .records import GroupLayout

__all__ = ["GradCompression", "begin_compressed_reduce", "decode_sum", "encode_rows", "wire_bytes"]

_SCALED = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_CAST = (torch.bfloat16, torch.float16)


def _check_dtype(_inst: object, _attr: object, value: torch.dtype) -> None:
    if value not in _SCALED and value not in _CAST:
        raise PolicyError(
            f"GradCompression(dtype={value}) is not supported; use torch.int8 or "
            "torch.float8_e4m3fn (block-scaled) or torch.bfloat16 / torch.float16 (cast)"
        )


def _check_block(_inst: object, _attr: object, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PolicyError(f"GradCompression(block_size={value!r}) must be a positive int")


@attrs.frozen
class GradCompression:
    """Opt-in lossy gradient reduction (``FSDPModule.set_gradient_compression``,
    ``ReducePolicy(compression=...)`` with :func:`~functional_fsdp.core.reduction.reduce_grad_with_state`).

    Attributes:
        dtype: the wire format of the gradient rows: ``torch.int8`` (default) or
            ``torch.float8_e4m3fn`` with an fp32 absmax scale per block, or ``torch.bfloat16``
            / ``torch.float16`` (a cast, no scales).
        block_size: elements per scale for the scaled formats (default 256: 1.016 bytes per
            element for int8, 3.94x fewer than fp32).
        error_feedback: keep what encoding dropped and add it to the next reduction (default).
            Costs one fp32 buffer of the group's unsharded gradient size per rank.
    """

    dtype: torch.dtype = attrs.field(default=torch.int8, validator=_check_dtype)
    block_size: int = attrs.field(default=256, validator=_check_block)
    error_feedback: bool = True

    @property
    def scaled(self) -> bool:
        """Whether the format carries a scale per block (int8, float8)."""
        return self.dtype in _SCALED

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_size) if self.scaled else 0

    def row_bytes(self, numel: int) -> int:
        """Bytes of one encoded row of ``numel`` elements: the fp32 scales, then the payload
        (``numel`` elements of :attr:`dtype`), padded to a multiple of 4."""
        raw = 4 * self._blocks(numel) + numel * self.dtype.itemsize
        return -(-raw // 4) * 4


def wire_bytes(layout: GroupLayout, policy: GradCompression | None) -> int:
    """Bytes this rank sends per reduction of ``layout``'s group: the ``ws - 1`` rows it sends
    its peers, encoded by ``policy`` (``None``: rows in the reduce dtype, as FSDP2's, and one
    presence flag per parameter: ``reduction.carries_presence``)."""
    ws = layout.world_size
    numel = layout.shard_numel
    if policy is None:
        return (ws - 1) * (numel + len(layout)) * layout.grad_reduce_dtype().itemsize
    return (ws - 1) * policy.row_bytes(numel)


def _blocked(t: torch.Tensor, nb: int, bs: int) -> torch.Tensor:
    """``t`` (``(n, numel)``) as ``(n, nb, bs)`` blocks, zero-padded (a view when it fits)."""
    n, numel = t.shape
    if numel == nb * bs and t.is_contiguous():
        return t.view(n, nb, bs)
    padded = t.new_zeros(n, nb * bs)
    padded[:, :numel] = t
    return padded.view(n, nb, bs)


def _fields(wire: torch.Tensor, numel: int, policy: GradCompression) -> tuple:
    """Views of the scales (fp32 ``(n, nb)``) and the payload (``(n, numel)`` of the wire
    dtype) in encoded rows ``wire`` (uint8 ``(n, m)``)."""
    nb = policy._blocks(numel)
    if numel == 0:  # a group of empty shards: nothing on the wire (a 0-wide byte view of
        # a 0-wide buffer has a stride a dtype view rejects)
        n = wire.shape[0]
        return wire.new_empty((n, 0), dtype=torch.float32), wire.new_empty(
            (n, 0), dtype=policy.dtype
        )
    scales = wire[:, : 4 * nb].view(torch.float32)
    payload = wire[:, 4 * nb : 4 * nb + numel * policy.dtype.itemsize].view(policy.dtype)
    return scales, payload


def encode_rows(
    x: torch.Tensor,
    policy: GradCompression,
    *,
    out: torch.Tensor | None = None,
    err: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode fp32 rows ``x`` of shape ``(n, S)`` into ``out`` (uint8
    ``(n, policy.row_bytes(S))``, allocated when ``None``): the wire rows and the encoding
    error ``x - decode(wire)`` (fp32 ``(n, S)``, written into ``err`` when given; zero in
    blocks that are not finite)."""
    n, numel = x.shape
    if out is None:
        out = torch.zeros(n, policy.row_bytes(numel), dtype=torch.uint8, device=x.device)
    if err is None:
        err = torch.empty_like(x)
    scales, payload = _fields(out, numel, policy)
    if not policy.scaled:
        payload.copy_(x)
        torch.sub(x, payload.float(), out=err)
        return out, err.nan_to_num_(0.0, 0.0, 0.0)
    nb, bs = scales.shape[1], policy.block_size
    blocks = _blocked(x, nb, bs)
    t = torch.abs(blocks)
    scale = t.amax(dim=-1).div_(_SCALED[policy.dtype])
    finite = torch.isfinite(scale)
    # A block with inf/nan decodes as nan (as an fp32 sum would stay non-finite).
    scales.copy_(torch.where(finite, scale, torch.full_like(scale, float("nan"))))
    inv = torch.where(finite & (scale > 0), 1.0 / scale, torch.zeros_like(scale))
    torch.mul(blocks, inv.unsqueeze(-1), out=t)
    if policy.dtype == torch.int8:
        fits = err.is_contiguous() and numel == nb * bs
        q = err.view(n, nb, bs) if fits else torch.empty_like(t)
        torch.round(t, out=q).clamp_(-127, 127)
        payload.copy_(q.view(n, -1)[:, :numel])
        e = torch.sub(t, q, out=q)
    else:
        payload.copy_(t.view(n, -1)[:, :numel])
        e = t.sub_(_blocked(payload.float(), nb, bs))
    e = e.mul_(scale.unsqueeze(-1)).view(n, -1)[:, :numel]
    if e.data_ptr() != err.data_ptr():
        err.copy_(e)
    return out, err.nan_to_num_(0.0, 0.0, 0.0)


def _decode(wire: torch.Tensor, numel: int, policy: GradCompression) -> torch.Tensor:
    """fp32 ``(n, numel)`` rows decoded from ``wire``."""
    scales, payload = _fields(wire, numel, policy)
    if not policy.scaled:
        return payload.float()
    nb, bs = scales.shape[1], policy.block_size
    values = _blocked(payload.float(), nb, bs).mul_(scales.unsqueeze(-1))
    return values.view(wire.shape[0], -1)[:, :numel]


def decode_sum(
    received: torch.Tensor,
    own: torch.Tensor,
    rank: int,
    policy: GradCompression,
    out: torch.Tensor,
    *,
    op: str = "sum",
) -> None:
    """Decode the rows ``received`` (``(ws, m)`` uint8; row ``r`` from rank ``r``, this rank's
    own row unused) and write their sum with the exact ``own`` row, in rank order, to ``out``;
    ``op="avg"`` divides by the world size."""
    ws, numel = received.shape[0], own.numel()
    for r in range(ws):
        part = own if r == rank else _decode(received[r : r + 1], numel, policy)[0]
        if r == 0:
            out.copy_(part)
        else:
            out.add_(part)
    if op == "avg":
        out.div_(ws)


def begin_compressed_reduce(
    inp: torch.Tensor,
    residual: torch.Tensor | None,
    comm: Communicator,
    policy: GradCompression,
    *,
    op: str,
    async_op: bool,
    alloc: Callable[[int, torch.dtype, torch.device], torch.Tensor],
) -> tuple[torch.Tensor, Work, torch.Tensor | None]:
    """Issue the compressed reduce-scatter of the packed fp32 input ``inp`` (``ws * S``).

    Returns the output buffer (this rank's fp32 shard, valid after ``wait()``), the work, and
    the new residual (``None`` without error feedback).
    """
    ws, rank = comm.world_size, comm.rank
    x = inp.view(ws, -1)
    wire = torch.empty(ws, policy.row_bytes(x.shape[1]), dtype=torch.uint8, device=inp.device)
    new_residual = torch.zeros_like(x) if policy.error_feedback else None
    # The peers' rows, in at most two contiguous runs (this rank's own row is never sent: it
    # stays exact and its residual stays zero). ``inp`` is this reduction's own packed buffer:
    # the residual is added to it in place.
    for lo, hi in ((0, rank), (rank + 1, ws)):
        if lo == hi:
            continue
        rows = x[lo:hi] if residual is None else x[lo:hi].add_(residual.view(ws, -1)[lo:hi])
        encode_rows(
            rows,
            policy,
            out=wire[lo:hi],
            err=None if new_residual is None else new_residual[lo:hi],
        )
    own = x[rank].clone()
    received = torch.empty_like(wire)
    out = alloc(x.shape[1], torch.float32, inp.device)
    work = comm.all_to_all(received.view(-1), wire.view(-1), async_op=async_op)
    return (
        out,
        ThenWork(work, lambda: decode_sum(received, own, rank, policy, out, op=op)),
        None if new_residual is None else new_residual.view(-1),
    )
