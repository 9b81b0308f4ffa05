"""The watchdog: what each rank is doing, published for the peers that wait for it.

A rank blocked in a wait of this package can only learn why its peers do not answer from the
peers themselves. Every rank of a multi-process gloo run therefore keeps one daemon thread
that publishes, twice a second, a small record to the default store (``ffsdp/watch/<rank>``):
how many collectives it has issued, the last one, how long ago it last issued or finished
one, what it waits for now (if anything), and, while a peer that waits for it asks
(``ffsdp/watch-ask/<rank>``), where its main thread is. A waiting rank reads
its peers' records (:func:`peer_trouble`, from every bounded wait: the communicators' and the
raw waits of :func:`watched_wait`) and raises, within the grace period
(``FFSDP_PEER_IDLE_GRACE``, 5 s by default), when a peer can never post what it waits for:

- the peer's program ended (its record says so: an ``atexit`` hook publishes it);
- the peer has issued no collective for the grace period and its main thread is blocked in a
  ``torch.distributed`` call outside this package (a ``barrier`` at the end of a script, a
  collective of its own): it has left the training loop;
- the peer waits, for the grace period, in a wait of another kind (the whole-matrix exchange
  of ``functional_fsdp.optim.Muon`` on one rank, an FSDP collective on the other: one rank
  skipped ``optimizer.step()``).

A long legitimate gap is told apart by where the idle peer's main thread is: evaluating,
loading data, sleeping or computing, it runs Python or torch code that is not a
``torch.distributed`` call, so it may still come back; the waiting rank keeps waiting (bounded
by ``FFSDP_COLLECTIVE_TIMEOUT``) and says once, on stderr, which peer it waits for and what that
peer is doing. Ranks that wait for different collectives of this package are found by the
position check of :mod:`.process_group` (``CollectiveMismatchError``).
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ...core.errors import CollectiveError, CollectiveMismatchError, PeerLeftError

__all__ = [
    "Activity",
    "activity",
    "idle_grace_s",
    "peer_trouble",
    "start",
    "watched_wait",
]

_PERIOD_S = 0.5
_KEY = "ffsdp/watch/"
_ASK = "ffsdp/watch-ask/"  # + rank: a counter its waiting peers add to (see _record)
_ASKED_BEATS = 3  # a rank reads its main thread's place for this many beats after an ask
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH_DIST = os.sep + os.path.join("torch", "distributed") + os.sep


def idle_grace_s() -> float:
    """How long a peer may issue nothing while blocked outside the package, or wait in a wait
    of another kind, before a waiting rank raises (``FFSDP_PEER_IDLE_GRACE``, seconds)."""
    return float(os.environ.get("FFSDP_PEER_IDLE_GRACE", "5"))


class Activity:
    """This process's collective activity (written by the communicators' hot path: plain
    attribute stores; read by the publisher thread).

    Attributes:
        issued: collectives issued so far.
        last: what the last one was: a description or a ``(describe, arg)`` pair evaluated
            only when published.
        last_t: ``time.monotonic()`` of the last issue or completed wait.
        wait: ``(what, family, since)`` of the wait in progress, else ``None``.
    """

    __slots__ = ("issued", "last", "last_t", "wait")

    def __init__(self) -> None:
        self.issued = 0
        self.last: Any = None
        self.last_t = time.monotonic()
        self.wait: tuple[Any, str, float] | None = None

    def note_issued(self, last: Any) -> None:
        """A collective was issued (``last``: what it is, see :attr:`last`)."""
        self.issued += 1
        self.last = last
        self.last_t = time.monotonic()

    def begin_wait(self, what: Any, family: str) -> None:
        """The calling thread blocks for ``what`` (a wait of ``family``)."""
        self.wait = (what, family, time.monotonic())

    def end_wait(self) -> None:
        """The wait in progress ended."""
        self.wait = None
        self.last_t = time.monotonic()


activity = Activity()

_STARTED: list[threading.Thread] = []
_EXITED = threading.Event()
_WARNED: set[tuple[int, int]] = set()  # (peer, its issued count) reported as idle


def _describe(what: Any) -> str:
    if callable(what):
        return str(what())
    if isinstance(what, tuple) and len(what) == 2 and callable(what[0]):
        return str(what[0](what[1]))
    return "nothing yet" if what is None else str(what)


def _main_thread_frames() -> list[tuple[str, int, str]]:
    """The main thread's stack, innermost first: ``(file, line, function)`` of each frame.

    Read through :func:`faulthandler.dump_traceback`, never through ``sys._current_frames()``:
    walking another thread's frames (``f_back``) creates frame objects for frames that thread
    may pop at its next bytecode, and on CPython 3.11 that corrupts the heap now and then
    (cpython#111363; the same crash in sentry-python's and ddtrace's samplers). faulthandler
    reads the frames in place, allocating nothing, with the GIL held (at most 100 frames, the
    innermost: the ones this module looks at)."""
    main = threading.main_thread().ident
    if main is None:
        return []
    fd = _dump_fd()
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    faulthandler.dump_traceback(fd, all_threads=True)
    size = os.lseek(fd, 0, os.SEEK_CUR)
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, size).decode("utf-8", "replace")
    frames: list[tuple[str, int, str]] = []
    mine = False
    for line in text.splitlines():
        head = _THREAD_LINE.match(line)
        if head is not None:
            if mine:
                break
            mine = int(head.group(1), 16) == main
            continue
        frame = _FRAME_LINE.match(line) if mine else None
        if frame is not None:
            frames.append((frame.group(1), int(frame.group(2)), frame.group(3)))
    return frames


_THREAD_LINE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME_LINE = re.compile(r'^\s+File "(.*)", line (\d+) in (\S+)')
_DUMP: list[int] = []  # the file descriptor the publisher dumps into (one per process)


def _dump_fd() -> int:
    if not _DUMP:
        try:
            fd = os.memfd_create("functional_fsdp-watchdog")
        except (AttributeError, OSError):  # not Linux: a temporary file
            fd, path = tempfile.mkstemp(prefix="functional_fsdp-watchdog-")
            os.unlink(path)
        _DUMP.append(fd)
    return _DUMP[0]


def _main_thread_place() -> tuple[str, str | None]:
    """Where the main thread is: ``(innermost frame, the torch.distributed call it is blocked
    in outside this package or None)``."""
    frames = _main_thread_frames()
    if not frames:
        return "?", None
    path0, line0, name0 = frames[0]
    inner = f"{name0} ({os.path.basename(path0)}:{line0})"
    outside = None
    in_dist = None  # the index of the innermost torch.distributed frame
    for i, (raw, line, _name) in enumerate(frames):
        path = os.path.abspath(raw)
        if path.startswith(_PACKAGE + os.sep):
            return inner, None  # inside this package (computing, or waiting: see wait)
        if _TORCH_DIST in path:
            in_dist = i if in_dist is None else in_dist
        elif in_dist is not None and outside is None:
            outside = (
                f"torch.distributed {frames[in_dist][2]} "
                f"(called at {os.path.basename(path)}:{line})"
            )
    if in_dist is not None and in_dist != 0:
        return inner, None  # in code torch.distributed called back (not blocked in it)
    return inner, outside


def _record(beat: int, exited: bool = False, asked: bool = False) -> str:
    now = time.monotonic()
    wait = activity.wait
    # Where the main thread is, only while a peer waiting for this rank asks (peer_trouble) and
    # this rank waits for nothing itself: faulthandler's dump reads every thread's frames, and
    # a thread state it cannot read kills the process (cpython#116008). Dumped twice a second
    # in every rank, always, it ran beside every training step of the process, FSDP2's too; a
    # CI run on torch 2.15 lost a rank to SIGSEGV whose fatal dump stopped at the first
    # thread's frames, that signature (not reproduced since).
    if asked and wait is None:
        inner, outside = _main_thread_place()
    else:
        inner, outside = "(not asked)", None
    return json.dumps(
        {
            "beat": beat,
            "exited": exited,
            "issued": activity.issued,
            "last": _describe(activity.last),
            "idle_s": round(now - activity.last_t, 3),
            "wait": None
            if wait is None
            else {"what": _describe(wait[0]), "family": wait[1], "for_s": round(now - wait[2], 3)},
            "where": inner,
            "outside": outside,  # None while it waits: not read then
        }
    )


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _publish_loop() -> None:
    beat = 0
    asks = 0  # the ask counter as last read
    asked_at = -_ASKED_BEATS  # the beat at which it last moved
    while not _EXITED.wait(_PERIOD_S):
        beat += 1
        try:
            if dist.is_initialized():
                store, me = _store(), dist.get_rank()
                now_asks = store.add(f"{_ASK}{me}", 0)
                if now_asks != asks:
                    asks, asked_at = now_asks, beat
                asked = beat - asked_at < _ASKED_BEATS
                store.set(f"{_KEY}{me}", _record(beat, asked=asked))
        except Exception:
            continue  # a store being replaced (recovery) or gone (exit): try again next beat


def _on_exit() -> None:
    _EXITED.set()
    try:
        if dist.is_initialized():
            _store().set(f"{_KEY}{dist.get_rank()}", _record(-1, exited=True))
    except Exception:
        pass


def start() -> None:
    """Start this process's publisher thread (once; the first multi-rank communicator)."""
    if _STARTED:
        return
    t = threading.Thread(target=_publish_loop, name="functional_fsdp-watchdog", daemon=True)
    t.start()
    _STARTED.append(t)
    atexit.register(_on_exit)


def peer_trouble(peers: list[int], family: str, waited_s: float, what: str) -> Exception | None:
    """The error to raise now, if a peer (global ranks ``peers``) can never post what this
    rank has waited ``waited_s`` seconds for (``what``, a wait of ``family``); ``None`` while
    every peer may still come (a peer that runs other code is reported once on stderr)."""
    grace = idle_grace_s()
    store = _store()
    me = dist.get_rank()
    keys = [f"{_KEY}{r}" for r in peers if r != me]
    present = [k for k in keys if store.check([k])]
    for key in present:
        peer = int(key.rsplit("/", 1)[1])
        rec = json.loads(store.get(key).decode())
        if rec["wait"] is None:
            store.add(f"{_ASK}{peer}", 1)  # where is it? (its next records say)
        since = f"since {rec['last']}" if rec["issued"] else "at all"
        if rec["exited"]:
            return PeerLeftError(
                f"rank {peer}'s program ended while rank {me} waits for {what} (its last "
                f"collective: {rec['last']}); every rank must issue the same collectives: "
                f"did rank {peer} run fewer micro-batches or steps?"
            )
        wait = rec["wait"]
        if wait is None and rec["outside"] and rec["idle_s"] >= grace and waited_s >= grace:
            return PeerLeftError(
                f"rank {peer} has issued no collective for {rec['idle_s']:.0f} s {since} and "
                f"is blocked in {rec['outside']}, outside functional_fsdp, while rank {me} "
                f"has waited {waited_s:.0f} s for {what}: rank {peer} may have left the "
                "training loop (fewer micro-batches or steps than this rank) or be running "
                "collectives of its own. Call reset_iter_state() on the root module on every "
                "rank to recover (FFSDP_PEER_IDLE_GRACE sets the grace in seconds)"
            )
        if (
            wait is not None
            and wait["family"] != family
            and wait["for_s"] >= grace
            and waited_s >= grace
        ):
            return CollectiveMismatchError(
                f"rank {me} has waited {waited_s:.0f} s for {what} while rank {peer} has "
                f"waited {wait['for_s']:.0f} s for {wait['what']}: the ranks run different "
                "collectives (e.g. an optimizer step skipped on some ranks only). Call "
                "reset_iter_state() on the root module on every rank to recover"
            )
        if wait is None and rec["idle_s"] >= grace and (peer, rec["issued"]) not in _WARNED:
            _WARNED.add((peer, rec["issued"]))
            print(
                f"functional_fsdp: rank {me} has waited {waited_s:.0f} s for {what}; rank "
                f"{peer} has issued no collective for {rec['idle_s']:.0f} s {since} and is "
                f"running {rec['where']} (evaluation or data loading on one rank is fine: "
                "waiting; FFSDP_COLLECTIVE_TIMEOUT bounds the wait)",
                file=sys.stderr,
                flush=True,
            )
    return None


def watched_wait(
    works: list,
    what: str,
    peers: list[int],
    *,
    family: str,
    on_abandon: Callable[[list], None] | None = None,
) -> None:
    """Wait for raw ``torch.distributed`` works (those no communicator numbers, e.g. the
    whole-matrix exchange) behind the watchdog: in a waiter thread, checking the peers
    (:func:`peer_trouble`) every 0.5 s after a short grace, bounded by
    ``FFSDP_COLLECTIVE_TIMEOUT``. ``peers``: the global ranks that must post their halves;
    ``on_abandon``: keeps the works (and buffers) referenced when the wait is given up."""
    from ...core.errors import CollectiveTimeoutError
    from .process_group import abort_posted, post_abort_everywhere
    from .schedule import thread_waiter

    if all(w.is_completed() for w in works):
        for w in works:
            w.wait()
        return
    done, box = thread_waiter().submit(works)
    start_t = time.monotonic()
    timeout_s = float(os.environ.get("FFSDP_COLLECTIVE_TIMEOUT", "600"))
    check_at = start_t + min(2.0, idle_grace_s()) if len(peers) > 1 else math.inf
    activity.begin_wait(what, family)
    try:
        while not done.wait(0.1):
            now = time.monotonic()
            err: Exception | None = None
            told = abort_posted()  # a peer gave up (e.g. found this mismatch first)
            if told is not None:
                err = CollectiveMismatchError(told)
            elif now >= check_at:
                err = peer_trouble(peers, family, now - start_t, what)
                check_at = now + 0.5
                if err is not None:
                    post_abort_everywhere(str(err))  # the peers' waits hear it at once
            if err is None and now - start_t > timeout_s:
                err = CollectiveTimeoutError(
                    f"rank {dist.get_rank()} waited {timeout_s:g} s for {what}; the other ranks "
                    "are stuck or run different collectives (FFSDP_COLLECTIVE_TIMEOUT sets the "
                    "limit in seconds)"
                )
            if err is not None:
                if on_abandon is not None:
                    on_abandon(works)
                thread_waiter().abandon()
                raise err
    finally:
        activity.end_wait()
    if box:
        raise CollectiveError(
            f"{what} failed on rank {dist.get_rank()}: {box[0]}; a peer process probably died "
            "or closed the connection (see its log)"
        ) from box[0]
