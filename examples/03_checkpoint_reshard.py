"""Train on 2 ranks, checkpoint with DCP, resume on 4 ranks, export a plain state dict.

Runs on CPU in well under a minute: ``python examples/03_checkpoint_reshard.py``. It spawns its
own gloo ranks on 127.0.0.1 (no torchrun needed):

1. **save** (2 ranks): train a small GPT with AdamW for ``--steps`` steps, save the sharded model
   and optimizer with ``save_checkpoint`` (``torch.distributed.checkpoint`` plus a checksum of
   every stored item; each rank writes only its shards), then keep training for ``--steps`` more steps: the uninterrupted reference.
2. **resume** (4 ranks): shard a freshly initialised model over 4 ranks, load the 2-rank
   checkpoint into it with ``load_checkpoint`` (DCP reshards 2 -> 4; every item is checked
   against its checksum and every file path against the directory), train the same ``--steps`` steps and compare the
   losses with the uninterrupted run; then gather a full state dict to rank 0 (on CPU, one
   tensor at a time) and ``torch.save`` it.
3. **export check** (this process): a plain, unsharded ``GPT`` loads that file with the ordinary
   ``nn.Module.load_state_dict`` and reproduces the sharded model's loss.

The global batch is the same at every world size (each rank takes its slice), so the resumed
losses equal the uninterrupted ones up to float rounding (gradients are averaged in a different
order on 4 ranks than on 2).

Under torchrun, run the phases yourself with the same ``--dir``::

    torchrun --nproc-per-node 2 examples/03_checkpoint_reshard.py --phase save --dir ckpt
    torchrun --nproc-per-node 4 examples/03_checkpoint_reshard.py --phase resume --dir ckpt
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from functional_fsdp import fully_shard, load_checkpoint, run_local, save_checkpoint
from functional_fsdp.testing.models import GPT, GPTConfig, pattern_batch

CFG = GPTConfig(vocab=64, dim=32, n_layers=2, n_heads=2, seq=16)
GLOBAL_BATCH = 8  # divisible by 1, 2, 4 and 8 ranks


def build(seed: int) -> GPT:
    """A GPT sharded FSDP2-style: each block, then the root."""
    torch.manual_seed(seed)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def local_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch (identical data at any world size)."""
    x, y = pattern_batch(CFG, GLOBAL_BATCH, seed=step)
    ws, rank = dist.get_world_size(), dist.get_rank()
    per = GLOBAL_BATCH // ws
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train(model: GPT, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """AdamW steps; returns the global mean loss of each step."""
    losses = []
    for step in steps:
        x, y = local_batch(step)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def save_phase(ckpt: str, steps: int) -> dict[str, Any]:
    """Train, save model + optimizer with DCP, continue uninterrupted."""
    model = build(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = train(model, opt, range(steps))
    model_sd, optim_sd = get_state_dict(model, opt)  # DTensor shards: no communication
    # dcp.save plus a CRC-32 of every stored item, verified by load_checkpoint.
    save_checkpoint({"model": model_sd, "optim": optim_sd}, ckpt)
    after = train(model, opt, range(steps, 2 * steps))
    return {"before": before, "uninterrupted": after}


def resume_phase(ckpt: str, steps: int, export: str) -> dict[str, Any]:
    """Load the checkpoint at this world size, train on, export a full state dict to rank 0."""
    model = build(seed=1234)  # other weights: the checkpoint must replace all of them
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    # dcp.load that never unpickles arbitrary objects, never reads outside the checkpoint
    # directory and verifies each item's checksum before loading it.
    load_checkpoint(state, ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = train(model, opt, range(steps, 2 * steps))
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    with torch.no_grad():
        t = model.loss(*local_batch(10_000)).detach().clone()  # a held-out batch, for the check
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        torch.save(full, export)  # plain CPU tensors, keyed like the unsharded model
    return {"resumed": resumed, "final_loss": t.item() / dist.get_world_size()}


def _run(phase: str, args: argparse.Namespace) -> dict[str, Any]:
    export = os.path.join(args.dir, "full_state_dict.pt")
    if phase == "save":
        return save_phase(os.path.join(args.dir, "dcp"), args.steps)
    return resume_phase(os.path.join(args.dir, "dcp"), args.steps, export)


def _rank(phase: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    return _run(phase, args)


def spawn(phase: str, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``phase`` on ``world_size`` local CPU gloo ranks; returns rank 0's result."""
    return run_local(_rank, world_size, phase, args)[0]


def check_export(path: str, expected_loss: float) -> float:
    """Load the exported file into a plain GPT and evaluate the same batch."""
    plain = GPT(CFG)
    plain.load_state_dict(torch.load(path, weights_only=True))  # strict: every key, every shape
    x, y = pattern_batch(CFG, GLOBAL_BATCH, seed=10_000)
    with torch.no_grad():
        loss = plain.loss(x, y).item()
    assert abs(loss - expected_loss) <= 1e-5 * max(1.0, abs(expected_loss)), (loss, expected_loss)
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps before and after the checkpoint")
    ap.add_argument("--save-world-size", type=int, default=2)
    ap.add_argument("--resume-world-size", type=int, default=4)
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--phase", choices=["all", "save", "resume"], default="all")
    args = ap.parse_args()
    tmp = None
    if args.dir is None:
        tmp = tempfile.TemporaryDirectory()
        args.dir = tmp.name
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: one phase here
        if args.phase == "all":
            raise SystemExit(
                "under torchrun pass --phase save or --phase resume (and a shared --dir)"
            )
        dist.init_process_group("gloo")
        try:
            out = _run(args.phase, args)
            if dist.get_rank() == 0:
                print(out)
        finally:
            dist.destroy_process_group()
        return
    saved = spawn("save", args.save_world_size, args)
    print(f"[{args.save_world_size} ranks] losses before the checkpoint: {_fmt(saved['before'])}")
    print(
        f"[{args.save_world_size} ranks] uninterrupted continuation:    {_fmt(saved['uninterrupted'])}"
    )
    resumed = spawn("resume", args.resume_world_size, args)
    print(
        f"[{args.resume_world_size} ranks] resumed from the checkpoint:     {_fmt(resumed['resumed'])}"
    )
    diff = max(abs(a - b) for a, b in zip(resumed["resumed"], saved["uninterrupted"]))
    print(f"max |resumed - uninterrupted| = {diff:.2e}")
    assert diff < 1e-4, "resumed training diverged from the uninterrupted run"
    loss = check_export(os.path.join(args.dir, "full_state_dict.pt"), resumed["final_loss"])
    print(
        f"plain nn.Module loaded the exported full state dict: loss {loss:.5f} (sharded: {resumed['final_loss']:.5f})"
    )
    if tmp is not None:
        tmp.cleanup()


def _fmt(losses: list[float]) -> str:
    return " ".join(f"{v:.4f}" for v in losses)


if __name__ == "__main__":
    main()
