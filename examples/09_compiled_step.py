"""The functional step compiled whole (all-gathers and reduce-scatters in the graph), on 2 CPU ranks.

    python examples/09_compiled_step.py [--steps 6] [--backend aot_eager|inductor]

``make_train_step(..., compile=backend)`` traces each micro-batch's forward and backward into
graphs in which every group's all-gather and reduce-scatter are nodes (PyTorch's functional
collectives), as SimpleFSDP does; ``reshard_after_forward`` decides whether the backward graph
gathers a group again. The script trains the same model with the eager step and the compiled
one from the same state, prints both step times and the compile report, and checks the
parameters: with ``aot_eager`` (no code generation) they are bit-identical; inductor fuses
kernels, so its results differ by float rounding. Inductor compiles for minutes on a small CPU
machine (it builds C++ kernels); ``aot_eager`` takes seconds. See docs/compiled_step.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from functional_fsdp import fully_shard, run_local
from functional_fsdp.functional import adamw, init, make_train_step
from functional_fsdp.testing.models import GPT, GPTConfig, pattern_batch

CFG = GPTConfig(vocab=256, dim=64, n_layers=2, n_heads=4, seq=32)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _train(compile: bool | str, steps: int) -> tuple[dict[str, torch.Tensor], list[float], object]:
    rank = dist.get_rank()
    model = _model()
    opt = adamw(3e-3, weight_decay=0.01)
    step = make_train_step(model, lambda m, b: m.loss(*b), opt, compile=compile)
    state = init(model, opt)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, _ = step(state, pattern_batch(CFG, 8, seed=1000 * i + rank))
        times.append(time.perf_counter() - t0)
    params = {n: p.full_tensor() for n, p in state.params.items()}
    report = step.compile_report() if compile else None  # type: ignore[attr-defined]
    return params, times, report


def _rank(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    eager, eager_t, _ = _train(False, args.steps)
    compiled, compiled_t, report = _train(args.backend, args.steps)
    if dist.get_rank() != 0:
        return
    diff = max((eager[n] - compiled[n]).abs().max().item() for n in eager)
    print(f"compile report: {report}")
    print(
        f"steady step: eager {1e3 * statistics.median(eager_t[1:]):.1f} ms, compiled "
        f"{1e3 * statistics.median(compiled_t[1:]):.1f} ms ({args.backend})"
    )
    print(f"parameters after {args.steps} steps, compiled vs eager: max |difference| {diff:.3g}")
    if args.backend == "aot_eager":
        assert diff == 0.0, "aot_eager runs the eager step's ops: the results must be equal"
        print("bit-identical: True")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--backend", default="aot_eager", help="a torch.compile backend")
    args = ap.parse_args()
    run_local(_rank, 2, args)


if __name__ == "__main__":
    main()
