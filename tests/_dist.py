"""A real multi-process gloo world for tests: spawned once per test module, many cases inside.

``World(n).run(fn, *args)`` runs the module-level function ``fn(*args)`` on every rank (with the
default process group initialised on 127.0.0.1 at a free port) and returns the per-rank results.
A case that fails on any rank tears the world down (so no rank can hang in a collective) and the
next case starts a fresh one. Every wait is bounded.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

CASE_TIMEOUT_S = float(os.environ.get("FFSDP_TEST_CASE_TIMEOUT", "180"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, inbox: Any, outbox: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
    )
    try:
        while True:
            item = inbox.get()
            if item is None:
                break
            fn, args = item
            try:
                outbox.put((rank, True, fn(*args)))
            except BaseException:
                outbox.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankError(AssertionError):
    """A case failed on one or more ranks; the message holds their tracebacks."""


class World:
    """A lazily (re)started world of ``world_size`` gloo ranks."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self._inboxes[r], self._outbox),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = CASE_TIMEOUT_S) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return results by rank, or raise :class:`RankError`."""
        if not self._procs:
            self._start()
        for q in self._inboxes:
            q.put((fn, args))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        try:
            while len(results) + len(failures) < self.world_size:
                rank, ok, value = self._outbox.get(timeout=timeout)
                (results if ok else failures)[rank] = value
                if failures:
                    break
        except queue.Empty:
            self.close(force=True)
            raise RankError(
                f"{fn.__name__}: timed out after {timeout}s; ranks done: {sorted(results)}"
            ) from None
        if failures:
            self.close(force=True)
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise RankError(f"{fn.__name__} failed:\n{text}")
        return [results[r] for r in range(self.world_size)]

    def close(self, *, force: bool = False) -> None:
        """Stop every rank (terminate them when ``force`` or when they do not exit in time)."""
        if not self._procs:
            return
        if not force:
            for q in self._inboxes:
                q.put(None)
            for p in self._procs:
                p.join(timeout=20)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs = []
