"""2-D parallelism: tensor parallel (TP) inside each data-parallel (dp) replica, FSDP across.

Runs on CPU from one command: ``python examples/04_fsdp_tp.py`` spawns 4 gloo ranks on
127.0.0.1 laid out as 2 dp x 2 tp (4 ranks on a 2-core machine is for correctness, not speed).
Under torchrun: ``torchrun --nproc-per-node 4 examples/04_fsdp_tp.py``.

The recipe is FSDP2's, with one import changed:

1. ``world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``;
2. ``parallelize_module(model, world["tp"], plan)``: q/k/v and the first MLP layer colwise,
   the attention output and second MLP layer rowwise (each layer's matmuls split over the 2
   TP ranks, one all-reduce per block half);
3. ``fully_shard(block, mesh=world["dp"])`` per block, then the root: each TP-local tensor is
   sharded over the 2 dp ranks. Parameters become ``DTensor`` s on the full mesh with FSDP2's
   placements, e.g. ``(_StridedShard(dim=0, sf=2), Shard(dim=0))`` for a colwise weight.

It trains a few steps with AdamW, checks the losses against one plain model trained on the
global batch (every dp rank's data), and prints the parameters' placements. ``--bench`` also
times the same steps under torch's FSDP2 + TP in the same run and prints the ratio.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import functional_fsdp
from functional_fsdp import run_local

DP, TP = 2, 2


class Block(nn.Module):
    """Pre-norm attention + MLP; under TP each rank computes its own heads and MLP columns."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim) for _ in range(4))
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        hd = self.dim // self.heads
        n = q.shape[-1] // hd  # heads on this TP rank
        q, k, v = (z.view(b, t, n, hd).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, n * hd))
        return x + self.w2(F.gelu(self.w1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def tp_plan(layers: int) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for i in range(layers):
        for n in ("wq", "wk", "wv", "w1"):
            plan[f"blocks.{i}.{n}"] = ColwiseParallel()
        for n in ("wo", "w2"):
            plan[f"blocks.{i}.{n}"] = RowwiseParallel()
    return plan


def build(args: argparse.Namespace, world: Any, impl: str = "ours") -> nn.Module:
    torch.manual_seed(0)
    model = Model(args.vocab, args.dim, args.heads, args.layers)
    parallelize_module(model, world["tp"], tp_plan(args.layers))
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = functional_fsdp.fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=world["dp"])
    fully_shard(model, mesh=world["dp"])
    return model


def batch(args: argparse.Namespace, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return x, torch.roll(x, 1, dims=1)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))


def train(model: nn.Module, args: argparse.Namespace, world: Any) -> tuple[list[float], float]:
    """Losses (averaged over ranks) and the mean step time after the first step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    dp_rank = world["dp"].get_local_rank()
    losses, times = [], []
    for step in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = loss_of(model, *batch(args, step, dp_rank), args.vocab)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses, sum(times[1:]) / max(1, len(times) - 1)


def reference(args: argparse.Namespace) -> list[float]:
    """One plain model on the global batch: what 2-D training must reproduce."""
    torch.manual_seed(0)
    model = Model(args.vocab, args.dim, args.heads, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(args.steps):
        xs, ys = zip(*(batch(args, step, r) for r in range(DP)))
        loss = loss_of(model, torch.cat(xs), torch.cat(ys), args.vocab)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = build(args, world)
    show = ("emb.weight", "blocks.0.ln1.weight", "blocks.0.wq.weight", "blocks.0.wq.bias")
    show += ("blocks.0.wo.weight", "blocks.0.wo.bias")
    placements = {n: str(p.placements) for n, p in model.named_parameters() if n in show}
    ours, t_ours = train(model, args, world)
    out: dict[str, Any] = {"ours": ours, "t_ours": t_ours, "placements": placements}
    if args.bench:
        out["torch"], out["t_torch"] = train(build(args, world, "torch"), args, world)
        # Alternate ours, torch, ours, torch and keep each one's best round.
        out["t_ours"] = min(t_ours, train(build(args, world), args, world)[1])
        out["t_torch"] = min(out["t_torch"], train(build(args, world, "torch"), args, world)[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--bench", action="store_true", help="also time torch FSDP2 + TP")
    args = ap.parse_args()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        res = _rank(args)
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    else:
        res = run_local(_rank, DP * TP, args)[0]
    for name, pl in res["placements"].items():
        print(f"  {name:28s} {pl}")
    ref = reference(args)
    for step, (a, b) in enumerate(zip(res["ours"], ref)):
        print(f"step {step}: 2-D loss {a:.6f}   single-process loss {b:.6f}")
    diff = max(abs(a - b) for a, b in zip(res["ours"], ref))
    print(f"max loss difference vs single process: {diff:.2e}")
    assert diff < 1e-4, "2-D training diverged from the single-process reference"
    if args.bench:
        drift = max(abs(a - b) for a, b in zip(res["ours"], res["torch"]))
        print(f"max loss difference vs torch FSDP2 + TP: {drift:.2e}")
        print(
            f"step time: ours {1e3 * res['t_ours']:.1f} ms, FSDP2 {1e3 * res['t_torch']:.1f} ms, "
            f"ratio ours/FSDP2 {res['t_ours'] / res['t_torch']:.3f}"
        )


if __name__ == "__main__":
    main()
