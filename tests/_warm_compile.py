"""Imported by the test ranks' fork server (``_dist.PRELOAD``): the modules a process's first
``aot_eager`` compile loads (about 580: AOTAutograd, the partitioners' networkx, inductor's
pattern matcher, torch.export), so every rank forked from the server starts with them. A rank's
first compile took 1.8 s of CPU where one after these imports takes 0.2 s; the server pays the
imports once for each worker instead of every rank that compiles (the compiled-step worlds,
``examples/09``'s ranks, the FSDP2 compile parity).

Imports only, no compile: tracing a graph for training starts autograd's engine, which in a
CUDA build of torch (2.15's default wheel, even on a machine without a GPU) starts 8 device
threads (``pt_autograd_*``) in the server; a rank forked from it then refuses every backward
("autograd's threading in combination with fork-based multiprocessing") or hangs. An import
starts no thread (checked on 2.13's CPU build and 2.15's CUDA build)."""

from __future__ import annotations

import contextlib
import importlib
import os

IMPORTED_IN = os.getpid()  # the server's, in a rank forked from it (test_launch.py checks)

_FIRST_COMPILE = (
    "torch._dynamo.backends.common",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "torch._inductor.pattern_matcher",
    "torch._inductor.debug",
    "functorch.compile",
    "networkx",
    "torch.export",
    "torch.distributed.tensor.experimental",
)

for _name in _FIRST_COMPILE:
    # A torch without one of them: the tests that compile say what is wrong.
    with contextlib.suppress(ImportError):
        importlib.import_module(_name)
