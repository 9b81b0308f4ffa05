"""Helpers of the 2-D (FSDP + tensor parallel) tests: a small transformer stack with
colwise/rowwise TP on attention and MLP, built under torch's FSDP2 or ours on a (dp, tp) mesh.

Runs inside gloo ranks (tests/_dist.py). Dimensions: TP divides every sharded dim; FSDP's dp
chunks of the MLP are uneven on purpose (hidden 86 -> 43 per TP rank -> 22 + 21 rows).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _dist import shared_mesh
from _full import full_parameters

VOCAB, DIM, HEADS, HIDDEN, SEQ, LAYERS = 48, 32, 4, 86, 8, 2
STEPS = 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM)
        self.wk = nn.Linear(DIM, DIM)
        self.wv = nn.Linear(DIM, DIM)
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = DIM // HEADS
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Under TP each rank holds its heads only (colwise outputs are local tensors).
        h = q.shape[-1] // hd
        q, k, v = (z.view(b, t, h, hd).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, h * hd))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TPModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def reference_model() -> TPModel:
    torch.manual_seed(0)
    return TPModel()


def tp_plan(sequence_parallel: bool = False) -> dict:
    """Colwise q/k/v/w1, rowwise wo/w2, rowwise embedding (Shard(0) vocab: the dp shard is
    strided), colwise head (Shard(0) too) with replicated output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict = {
        "emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(LAYERS):
        p = f"blocks.{i}."
        if sequence_parallel:
            plan["emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
            plan["norm"] = SequenceParallel()
            plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
            plan[p + "ln1"] = SequenceParallel()
            plan[p + "ln2"] = SequenceParallel()
            for n in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1"):
                plan[p + n] = ColwiseParallel(input_layouts=Shard(1))
            for n in ("attn.wo", "mlp.w2"):
                plan[p + n] = RowwiseParallel(output_layouts=Shard(1))
        else:
            for n in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1"):
                plan[p + n] = ColwiseParallel()
            for n in ("attn.wo", "mlp.w2"):
                plan[p + n] = RowwiseParallel()
    return plan


def world_mesh(shape: tuple[int, ...] = (2, 2), names: tuple[str, ...] = ("dp", "tp")):
    return shared_mesh(shape, names)


def build(which: str, mesh, *, recipe: str = "fp32", sp: bool = False) -> nn.Module:
    """The model under torch's or our ``fully_shard`` after ``parallelize_module``."""
    from torch.distributed.tensor.parallel import parallelize_module

    if which == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from functional_fsdp import MixedPrecisionPolicy, fully_shard
    tp_mesh = mesh["tp"]
    dp_mesh = mesh["dp"] if mesh.ndim == 2 else mesh["rep", "dp"]
    if recipe == "meta":
        with torch.device("meta"):
            model = TPModel()
    else:
        model = reference_model()
    parallelize_module(model, tp_mesh, tp_plan(sp))
    kw: dict = {"mesh": dp_mesh}
    if recipe == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if recipe == "raf_false":
        kw["reshard_after_forward"] = False
    if recipe == "offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if recipe == "ckpt":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    if recipe == "prefetch":
        blocks = list(model.blocks)
        for a, b in itertools.pairwise(blocks):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    if recipe == "meta":
        model.to_empty(device="cpu")
        # Initialise from the same model built on CPU (same placements: copy local shards).
        src = dict(build(which, mesh, sp=sp).named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(src[name].to_local())
    return model


def dp_rank(mesh) -> int:
    """This rank's index among all data-parallel ranks (replicas x shards under HSDP)."""
    r = mesh["dp"].get_local_rank()
    if mesh.ndim == 3:
        r += mesh["rep"].get_local_rank() * mesh["dp"].size()
    return r


def batch(step: int, rank: int, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return x, torch.roll(x, 1, dims=1)


def optimizer(params, kind: str = "adamw") -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def train(
    model: nn.Module, mesh, steps: int = STEPS, kind: str = "adamw", accumulate: bool = False
) -> list[float]:
    """Train ``steps`` steps; with ``accumulate`` each step is two micro-batches of one
    sample, the first without gradient sync."""
    opt = optimizer(model.parameters(), kind)
    losses = []
    for s in range(steps):
        x, y = batch(s, dp_rank(mesh))
        if accumulate:
            model.set_requires_gradient_sync(False)
            (model.loss(x[:1], y[:1]) / 2).backward()
            model.set_requires_gradient_sync(True)
            loss = model.loss(x[1:], y[1:]) / 2
        else:
            loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().float()  # summed in fp32: a bf16 sum of 4 losses rounds by 0.03
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    full = full_parameters(model)
    return {
        n.replace("_checkpoint_wrapped_module.", ""): p.detach().float().clone()
        for n, p in full.items()
    }


def max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def reference_train(dp: int, steps: int = STEPS, kind: str = "adamw"):
    """One plain model on the global batch (every dp rank's data)."""
    model = reference_model()
    opt = optimizer(model.parameters(), kind)
    losses = []
    for s in range(steps):
        xs, ys = zip(*(batch(s, r) for r in range(dp)))
        loss = model.loss(torch.cat(xs), torch.cat(ys))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_params(model)
