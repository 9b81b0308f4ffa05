"""Imported by the test ranks' fork server (``_dist.PRELOAD``): one small ``aot_eager``
compile, so every rank forked from the server starts with what a process's first compile
loads (about 600 modules: AOTAutograd, the partitioners' networkx, inductor's pattern
matcher, jinja2) and sets up once. A rank's first compile took 2.5 s of CPU where later ones
of the same function took 0.15 s; the server pays it once for each worker instead of every
rank that compiles (the compiled-step worlds, ``examples/09``'s ranks, the FSDP2 compile
parity). It leaves no thread behind to break the server's forks, and no compiled code (the
cache is reset). Unlike the package's own server (``shell/processes.py``), this one runs torch
operations: a few on 4x4 tensors, with one OpenMP thread (``tests/conftest.py`` sets
``OMP_NUM_THREADS=1`` before the server starts), so no OpenMP pool exists to be forked."""

from __future__ import annotations

import os

import torch

IMPORTED_IN = os.getpid()  # the server's, in a rank forked from it (test_launch.py checks)


def _warm() -> None:
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w).relu().sum()

    w = torch.randn(4, 4, requires_grad=True)
    try:
        torch.compile(f, backend="aot_eager", fullgraph=True)(torch.randn(4, 4), w).backward()
    except Exception:  # a warm-up only: a torch that cannot compile fails in the tests that do
        pass
    finally:
        torch._dynamo.reset()


_warm()
