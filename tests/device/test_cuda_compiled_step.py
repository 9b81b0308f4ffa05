"""The compiled training step on a GPU (skipped without one): world size 1 on NCCL.

``make_train_step(..., compile=backend)`` puts every group's all-gather and reduce-scatter in
the step's graphs as functional collectives; on the CPU the suite compiles it with ``aot_eager``
on gloo (``tests/functional/test_compiled_step.py``). Here the same step is compiled for CUDA:
``aot_eager`` (the eager step's aten ops, NCCL's collectives as graph nodes) and ``inductor``
(Triton kernels), each against the eager step from the same state and batches. The step times
are printed side by side (docs/cuda.md records them).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import torch

from functional_fsdp.testing.models import GPT, GPTConfig, synthetic_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device and FFSDP_TEST_GPU=1"
    ),
    # inductor's advice to enable TF32 (the step stays in fp32 to compare with eager)
    pytest.mark.filterwarnings("ignore::UserWarning:torch._inductor"),
    pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning"),
]

CFG = GPTConfig(vocab=512, dim=256, n_layers=4, n_heads=4, seq=128)


def _steps(device: str, compile: bool | str, steps: int = 6) -> dict[str, Any]:
    """``steps`` functional AdamW steps of the GPT sharded by block on a 1-rank mesh of
    ``device``: losses, the steady step time (median after the first, synchronized), the final
    full parameters and the compile report."""
    from torch.distributed.device_mesh import init_device_mesh

    from functional_fsdp import fully_shard
    from functional_fsdp.functional import adamw, init, make_train_step

    torch.manual_seed(0)
    mesh = init_device_mesh(device, (1,))
    model = GPT(CFG).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(1e-3, weight_decay=0.01)
    step = make_train_step(model, lambda m, b: m.loss(*b), opt, compile=compile)
    state = init(model, opt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    losses, times = [], []
    for i in range(steps):
        batch = tuple(t.to(device) for t in synthetic_batch(CFG, 8, seed=i))
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss"]))
    return {
        "losses": losses,
        "step_ms": 1e3 * statistics.median(times[1:]),
        "first_ms": 1e3 * times[0],
        "params": {n: p.full_tensor().cpu() for n, p in state.params.items()},
        "report": step.compile_report() if compile else None,  # type: ignore[attr-defined]
    }


def test_compiled_step_on_cuda_matches_the_eager_step(nccl_one_rank: None) -> None:
    """The step compiled for CUDA trains as the eager step: ``aot_eager`` to summation order
    (CUDA's embedding backward accumulates with atomics), ``inductor`` to its fusions' rounding;
    one graph each (no recompiles), the collectives in ``aot_eager``'s graphs."""
    eager = _steps("cuda", False)
    runs = {backend: _steps("cuda", backend) for backend in ("aot_eager", "inductor")}
    print(
        {"eager_ms": round(eager["step_ms"], 2)}
        | {
            f"{b}_ms": (round(r["step_ms"], 2), f"first {r['first_ms'] / 1e3:.1f} s")
            for b, r in runs.items()
        }
    )
    for backend, run in runs.items():
        report = run["report"]
        print(backend, report)
        assert report.graphs == 1 and report.recompiles == 0, (backend, report)
        tol = (
            {"rtol": 1e-5, "atol": 1e-6} if backend == "aot_eager" else {"rtol": 1e-3, "atol": 1e-3}
        )
        torch.testing.assert_close(run["losses"], eager["losses"], **tol)
        for name, p in eager["params"].items():
            torch.testing.assert_close(run["params"][name], p, **tol, msg=f"{backend}: {name}")
    aot = runs["aot_eager"]["report"]
    assert aot.forward_collectives and aot.backward_collectives, aot
