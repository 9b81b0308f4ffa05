"""All-gather weights as int8: a tensor-subclass all-gather hook, under our FSDP and FSDP2.

Runs on CPU from one command: ``python examples/06_int8_all_gather.py`` spawns 2 gloo ranks
(``--float8``: torchao's float8 training and its float8 all-gather instead of int8).

Every ``nn.Linear`` weight of a small GPT is wrapped in
:class:`functional_fsdp.extensions.Int8RowwiseWeight`, a tensor subclass that implements
FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: each rank sends its rows as int8
plus one fp32 scale per row, and the gathered weight is dequantized to the compute dtype. The
optimizer still steps the full-precision shards. The script trains the same steps three ways
(fp32 all-gather, int8 under ``functional_fsdp.fully_shard``, int8 under torch's FSDP2) and
prints the losses, whether ours equals FSDP2 bit for bit, the all-gather bytes per step and
the median step time of each run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn as nn

from functional_fsdp import run_local
from functional_fsdp.core.codec import gather_bytes
from functional_fsdp.extensions import Int8RowwiseWeight
from functional_fsdp.testing.models import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(vocab=256, dim=64, n_layers=2, n_heads=4, seq=32)


def build(impl: str, kind: str) -> nn.Module:
    """The GPT with its Linear weights wrapped for the ``kind`` all-gather (``fp32``, ``int8``
    or ``float8``), sharded per block then root under ``impl`` (``ours`` or ``fsdp2``)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    if kind == "int8":
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight = nn.Parameter(Int8RowwiseWeight(m.weight.data))
    elif kind == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        # emulate: these ranks run on CPU, which has no float8 matmul (torch's CPU _scaled_mm
        # took 22 ms for each of this model's small products, 0.75 s a step); torchao's
        # emulation multiplies the float8-rounded values in fp32 (15 ms a step). The all-gather,
        # what this example shows, sends the same float8 bytes either way.
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        convert_to_float8_training(model, config=config)
    if impl == "ours":
        from functional_fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def train(model: nn.Module, steps: int) -> tuple[list[float], float]:
    """AdamW steps on per-rank synthetic batches; the losses and the median step time (ms)."""
    rank = torch.distributed.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, times = [], []
    for step in range(steps):
        x, y = synthetic_batch(CFG, 4, seed=100 * step + rank)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss = model.loss(x, y)  # type: ignore[operator]
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, 1e3 * statistics.median(times[1:] or times)


def bytes_per_step(model: nn.Module) -> int:
    """All-gather bytes this rank sends per step: every group once in forward, the blocks again
    in backward (the root keeps its parameters between forward and backward)."""
    total = 0
    for m in model.modules():
        state = getattr(m, "_ffsdp_state", None)
        if state is not None and state.group is not None:
            times = 1 if m is model else 2
            total += times * gather_bytes(state.group.layout)
    return total


def _rank(steps: int, kind: str) -> dict[str, Any]:
    fp32, ours, theirs = build("ours", "fp32"), build("ours", kind), build("fsdp2", kind)
    out: dict[str, Any] = {}
    for name, model in (("fp32", fp32), (kind, ours), (f"{kind}_fsdp2", theirs)):
        out[name], out[f"{name}_ms"] = train(model, steps)
    out["bytes_fp32"], out["bytes_narrow"] = bytes_per_step(fp32), bytes_per_step(ours)
    out["params_equal_fsdp2"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())  # type: ignore[attr-defined]
        for a, b in zip(ours.parameters(), theirs.parameters())
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--float8", action="store_true", help="torchao float8 training instead of int8 weights"
    )
    args = ap.parse_args()
    kind = "float8" if args.float8 else "int8"
    if kind == "float8":
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise SystemExit("--float8 needs torchao: pip install torchao") from None
    res = run_local(_rank, 2, args.steps, kind)[0]
    for name in ("fp32", kind, f"{kind}_fsdp2"):
        print(
            f"{name:>12} losses: "
            + " ".join(f"{v:.4f}" for v in res[name])
            + f"   median step {res[name + '_ms']:.1f} ms"
        )
    same = res[kind] == res[f"{kind}_fsdp2"] and res["params_equal_fsdp2"]
    print(f"{kind} under functional_fsdp == {kind} under torch FSDP2, bit for bit: {same}")
    b32, b8 = res["bytes_fp32"], res["bytes_narrow"]
    print(
        f"all-gather bytes per rank per step: fp32 {b32 / 2**10:.1f} KiB, {kind} "
        f"{b8 / 2**10:.1f} KiB ({b32 / b8:.2f}x fewer)"
    )


if __name__ == "__main__":
    main()
