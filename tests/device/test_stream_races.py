"""Races nobody planted: each is a mechanical edit of the engine's stream program
(``shell/engine/ordering.py``), applied to a copy of its source, and must be caught by the
stream-ordering simulator; the unedited source passes.

A race here is one a GPU would show rarely and silently (stale parameters, a step on an
unfinished ``.grad``): a missing ``wait_stream`` / ``wait_event``, an event recorded before the
collective's ``work.wait()``, a free after too few events or after the wrong one, a wait on the
wrong event, work on the wrong stream; across the gather, the copy-out, the reduce-scatter, the
HSDP all-reduce, coalesced buckets, CPU offload, the reproducible all-to-all and the optimizer
step. None is one of the four bugs ``tests/device/test_streams_engine.py`` plants by replacing a whole
function. The edited source is executed as a module of its own and its functions replace the
live ones for one run (the engine calls them as ``ordering.<name>``): the same effect as
editing the file, without a process per race.

Each race runs, on 2 gloo ranks, the training programs that take its path (two steps, so the
optimizer's writes meet the next forward), on a simulator that collects violations.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _dist import World
from _fully_shard_helpers import _build, _train

from functional_fsdp.shell.engine import ordering

pytestmark = pytest.mark.multiprocess

# name -> (the source text replaced, its replacement, the programs that take the path)
# The reductions' wait on the reduce-scatter stream and its report to a checking runtime.
_RS_WAIT = (
    "    with rt.use(rs):\n"
    "        for pending in {id(p.work): p for p in pendings}.values():  # a bucket's: one\n"
    "            pending.work.wait()\n"
    "    if rt.checks:\n        for p in pendings:\n"
    "            rt.complete(rs, [p.input, _reduced(p)])\n"
)

RACES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "copy-in does not wait for the optimizer's writes": (
        "    rt.wait_stream(ci, rt.compute)\n    staged = None\n",
        "    staged = None\n",
        ("alone",),
    ),
    "all-gather does not wait for its copy-in": (
        '            rt.access(ci, "all-gather copy-in", reads=[own], writes=made)\n'
        "    rt.wait_stream(ag, ci)\n",
        '            rt.access(ci, "all-gather copy-in", reads=[own], writes=made)\n',
        ("alone",),
    ),
    "gathered event recorded before the all-gather's wait": (
        '    ag = rt.side_stream("all_gather")\n    with rt.use(ag):\n        pending.work.wait()\n'
        "    if rt.checks:\n"
        "        rt.complete(ag, bucket.buffers if bucket is not None else _gather_buffers(pending))\n"
        "    gathered = rt.record(ag)\n",
        '    ag = rt.side_stream("all_gather")\n    gathered = rt.record(ag)\n'
        "    with rt.use(ag):\n        pending.work.wait()\n"
        "    if rt.checks:\n"
        "        rt.complete(ag, bucket.buffers if bucket is not None else _gather_buffers(pending))\n",
        ("alone", "buckets"),
    ),
    "compute waits on the copy-in stream, not the gathered event": (
        "    rt.wait_event(rt.compute, gathered)\n",
        '    rt.wait_stream(rt.compute, rt.side_stream("copy_in"))\n',
        ("alone",),
    ),
    "all-gather output freed after the gathered event, not the copy-out's": (
        "        rt.free_after(pending.output, [copied])\n",
        "        rt.free_after(pending.output, [gathered])\n",
        ("alone",),
    ),
    "copy-out's event recorded on the all-gather stream": (
        "    copied = rt.record(s)\n",
        '    copied = rt.record(rt.side_stream("all_gather"))\n',
        ("alone",),
    ),
    "copy-in buffer freed with no event": (
        "            rt.free_after(t, [gathered])\n",
        "            rt.free_after(t, [])\n",
        ("mp",),
    ),
    "unsharded buffer freed after an all-gather event, not compute's": (
        "    return [rt.record(rt.compute)]\n",
        '    return [rt.record(rt.side_stream("all_gather"))]\n',
        ("alone",),
    ),
    "bucket copy-in does not wait for the optimizer's writes": (
        '    ci, ag = rt.side_stream("copy_in"), rt.side_stream("all_gather")\n'
        "    rt.wait_stream(ci, rt.compute)\n    rt.wait_stream(ag, ci)\n",
        '    ci, ag = rt.side_stream("copy_in"), rt.side_stream("all_gather")\n'
        "    rt.wait_stream(ag, ci)\n",
        ("buckets",),
    ),
    "bucket rows freed with no event": (
        "        events = [] if made else consumers_done(rt)\n",
        "        events = []\n",
        ("buckets",),
    ),
    "reduced event recorded before the reduce-scatter's wait": (
        _RS_WAIT + "    reduced = rt.record(rs)\n",
        "    reduced = rt.record(rs)\n" + _RS_WAIT,
        ("alone",),
    ),
    "reduce-scatter input freed with no event": (
        "        rt.free_after(t, [reduced])\n",
        "        rt.free_after(t, [])\n",
        ("alone", "buckets"),
    ),
    "HSDP all-reduce does not wait for the reduce-scatter": (
        '        post = rt.side_stream("all_reduce")\n        rt.wait_stream(post, rs)\n',
        '        post = rt.side_stream("all_reduce")\n',
        ("hsdp",),
    ),
    "compute does not wait for the post-reduce stream": (
        "    rt.wait_event(rt.compute, rt.record(post))\n    return landed\n",
        "    return landed\n",
        ("alone",),
    ),
    "compute waits on the reduce-scatter stream under HSDP, not the all-reduce": (
        "    rt.wait_event(rt.compute, rt.record(post))\n    return landed\n",
        "    rt.wait_event(rt.compute, rt.record(rs))\n    return landed\n",
        ("hsdp",),
    ),
    "unsharded buffer freed ignoring the events it was given": (
        "        if t.untyped_storage().size() != 0:\n            rt.free_after(t, events)\n",
        "        if t.untyped_storage().size() != 0:\n            rt.free_after(t, [])\n",
        ("alone",),
    ),
    "offload: the host step does not wait for the gradients": (
        "    rt.host_wait(rt.record(rt.compute))\n",
        "",
        ("offload",),
    ),
    "reduction copy-in on the reduce-scatter stream": (
        "    c = rt.compute\n    present = [g for g in grads if g is not None] if rt.checks else []\n"
        "    if rt.checks:  # backward made the gradients on compute\n"
        '        rt.access(c, "backward (the gradients)", writes=present)\n',
        "    present = [g for g in grads if g is not None] if rt.checks else []\n"
        "    if rt.checks:  # backward made the gradients on compute\n"
        '        rt.access(rt.compute, "backward (the gradients)", writes=present)\n'
        '    c = rt.side_stream("reduce_scatter")\n',
        ("alone",),
    ),
    "the reproducible all-to-all does not wait for compute": (
        '        rt.access(rt.compute, "the canonical tree\'s sum", writes=[subtree])\n'
        "    reduce_after_compute(rt)\n",
        '        rt.access(rt.compute, "the canonical tree\'s sum", writes=[subtree])\n',
        ("reproducible",),
    ),
    "bucket reduce-scatter's input freed with no event (coalesced)": (
        '    reduce_after_compute(rt)\n    rs = rt.side_stream("reduce_scatter")\n'
        "    with rt.use(rs):\n        pendings = issue_reduce_coalesced(rins, comm, alloc=alloc)\n",
        '    rs = rt.side_stream("reduce_scatter")\n'
        "    with rt.use(rs):\n        pendings = issue_reduce_coalesced(rins, comm, alloc=alloc)\n",
        ("buckets",),
    ),
    "a bucket's one wait reports only its first member's buffers complete": (
        "        rt.complete(ag, bucket.buffers if bucket is not None else _gather_buffers(pending))\n",
        "        rt.complete(ag, _gather_buffers(pending))\n",
        ("buckets",),
    ),
    "a bucket member lands before the bucket's one wait": (
        "    if bucket is not None and bucket.gathered is not None:\n        return bucket.gathered\n",
        '    if bucket is not None:\n        return rt.record(rt.side_stream("all_gather"))\n',
        ("buckets",),
    ),
    "offload: the staged copy freed with no event": (
        "    for t in (pending.input, staged):\n        if t is not None:\n"
        "            rt.free_after(t, [gathered])\n",
        "    for t in (pending.input, staged):\n        if t is not None:\n"
        "            rt.free_after(t, [] if t is staged else [gathered])\n",
        ("offload",),
    ),
}

ALL_PROGRAMS = ("alone", "buckets", "hsdp", "offload", "mp", "reproducible")
SOURCE = inspect.getsource(ordering)


def _mutated(race: str) -> types.ModuleType:
    """``ordering``'s source with ``race``'s edit, executed as a module of its own."""
    old, new, _ = RACES[race]
    assert SOURCE.count(old) == 1, f"{race}: the edit's text must occur once in ordering.py"
    module = types.ModuleType(ordering.__name__)
    module.__package__ = ordering.__package__
    module.__file__ = ordering.__file__
    exec(compile(SOURCE.replace(old, new), f"<{race}>", "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def _applied(race: str | None) -> Iterator[None]:
    """The live ``ordering`` runs ``race``'s edited functions (``None``: the source as is)."""
    if race is None:
        yield
        return
    module = _mutated(race)
    saved = {}
    for name, fn in vars(module).items():
        if isinstance(fn, types.FunctionType) and fn.__module__ == ordering.__name__:
            saved[name] = getattr(ordering, name, None)
            setattr(ordering, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ordering, name, fn)


def _program(kind: str) -> Any:
    """A small GPT sharded for ``kind``: one collective per group (``alone``), buckets,
    HSDP, CPU offload, bf16 parameters (``mp``: the copy-in casts into a buffer of its own,
    one collective per group), or the reproducible policy."""
    if kind == "reproducible":
        from _fully_shard_helpers import CFG

        from functional_fsdp import ReproduciblePolicy, fully_shard
        from functional_fsdp.testing.models import GPT

        torch.manual_seed(0)
        model = GPT(CFG)
        policy = ReproduciblePolicy(virtual_world_size=torch.distributed.get_world_size())
        for b in model.blocks:
            fully_shard(b, reproducible=policy)
        fully_shard(model, reproducible=policy)
        return model
    model = _build("ours", {"alone": "default", "buckets": "default"}.get(kind, kind))
    if kind in ("alone", "mp"):
        model.set_bucket_bytes(0)
    return model


def case_races(races: list[str | None]) -> dict[str, list[str]]:
    """Per race (``None``: the unedited source), the violations its programs showed."""
    from functional_fsdp.testing.streams import StreamSimulator, use_runtime

    found: dict[str, list[str]] = {}
    for race in races:
        programs = (
            RACES[race][2]
            if race is not None
            else ("alone", "buckets", "hsdp", "offload", "reproducible")
        )
        seen: list[str] = []
        with _applied(race):
            for kind in programs:
                model = _program(kind)
                sim = use_runtime(model, StreamSimulator(strict=False))
                _train(model, kind if kind in ("offload", "mp") else "default", steps=2)
                seen += [f"{kind}: {v.kind}: {v.message}" for v in sim.violations]  # type: ignore[attr-defined]
        found[str(race)] = seen
    return found


def test_every_edit_applies_to_the_source_once() -> None:
    assert len(RACES) >= 20
    for race in RACES:
        _mutated(race)  # raises when the text is not found exactly once


def test_each_race_is_caught_and_the_unedited_engine_passes(world2: World) -> None:
    races: list[str | None] = [None, *RACES]
    for found in world2.run(case_races, races):
        assert found.pop("None") == [], "the unedited engine must pass"
        missed = [race for race, seen in found.items() if not seen]
        assert not missed, f"races the simulator missed: {missed}"
