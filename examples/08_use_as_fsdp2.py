"""Make a framework that imports FSDP2 at call time use functional_fsdp: one line.

Hugging Face Accelerate (``fsdp2_prepare_model``), torchtitan and Lightning import
``fully_shard`` / ``FSDPModule`` / ``MixedPrecisionPolicy`` from ``torch.distributed.fsdp``
inside the function that shards the model, so changing your own import does not reach them.
``functional_fsdp.use_as_fsdp2()`` swaps those names for ours while it is active (a ``with``
block, or a plain call and ``undo()``), and puts torch's back after::

    with functional_fsdp.use_as_fsdp2():
        model, optimizer = accelerator.prepare(model, optimizer)  # Accelerate's FSDP v2 path

Here a stand-in for such a framework (``framework_prepare``, below) shards a small GPT on 2
spawned gloo ranks, once with torch's FSDP2 and once under the swap; both train 3 AdamW steps
on the same data and the losses agree bit for bit. Run: ``python examples/08_use_as_fsdp2.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import functional_fsdp
from functional_fsdp.testing.models import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(vocab=64, dim=32, n_layers=2, n_heads=2, seq=8)


def framework_prepare(model: GPT) -> nn.Module:
    """What a framework does: import FSDP2 when called, shard each block, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    return fully_shard(model, mp_policy=mp)


def train(swap: bool) -> tuple[str, list[float]]:
    torch.manual_seed(0)
    model = GPT(CFG)
    if swap:
        with functional_fsdp.use_as_fsdp2():
            model = framework_prepare(model)
    else:
        model = framework_prepare(model)
    kind = "functional_fsdp" if isinstance(model, functional_fsdp.FSDPModule) else "torch FSDP2"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x, y = synthetic_batch(CFG, 2, seed=100 * step + dist.get_rank())
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return kind, losses


def rank_main() -> tuple[tuple[str, list[float]], tuple[str, list[float]]]:
    return train(swap=False), train(swap=True)


def main() -> None:
    for rank, (torch_run, ours_run) in enumerate(functional_fsdp.run_local(rank_main, 2)):
        for kind, losses in (torch_run, ours_run):
            print(f"rank {rank} {kind:16s} losses {[round(v, 6) for v in losses]}")
        assert torch_run[0] == "torch FSDP2" and ours_run[0] == "functional_fsdp"
        assert torch_run[1] == ours_run[1], "the swapped framework should train like FSDP2"
    print("the framework sharded with functional_fsdp under use_as_fsdp2(), FSDP2's losses")


if __name__ == "__main__":
    main()
