"""How fast this machine is right now, in one number, to set beside a suite or benchmark time.

The suite's time on the 2-core machine moved by 40 % within an hour on one tree (388 s and
555 s), more than most changes move it: the host's load changes what a core-second buys. This
runs a fixed, single-threaded piece of what the suite does (small torch ops through autograd,
a Python loop) a few times and prints the best time in milliseconds. Run it just before and
after a timing; compare timings only where it gave about the same number.

    python scripts/machine_speed.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch


def _work() -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(8))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 64)
    t0 = time.perf_counter()
    for _ in range(60):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    total = 0
    for i in range(300_000):
        total += i % 7
    assert total > 0
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _work()  # warm-up: the first call pays for lazy initialisation
    times = [_work() for _ in range(args.rounds)]
    print(
        f"machine speed: {min(times):.1f} ms (best of {args.rounds}; rounds {', '.join(f'{t:.1f}' for t in times)})"
    )


if __name__ == "__main__":
    main()
