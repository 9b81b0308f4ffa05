"""The stream-ordering simulator on small programs: what it accepts and the races it catches."""

from __future__ import annotations

import pytest
import torch

from functional_fsdp.shell.device.runtime import CPURuntime
from functional_fsdp.testing.streams import StreamOrderError, StreamSimulator


def test_an_ordered_gather_compute_free_program_passes() -> None:
    sim = StreamSimulator()
    copy_in, ag = sim.side_stream("copy_in"), sim.side_stream("all_gather")
    shard, inp, out = torch.ones(4), torch.empty(4), torch.empty(8)
    sim.wait_stream(copy_in, sim.compute)  # the shard was written on compute (optimizer)
    sim.access(copy_in, "copy-in", reads=[shard], writes=[inp])
    sim.wait_event(ag, sim.record(copy_in))
    sim.access(ag, "all-gather", reads=[inp], writes=[out])
    gathered = sim.record(ag)
    sim.wait_event(sim.compute, gathered)
    sim.access(sim.compute, "forward", reads=[out])
    sim.free_after(inp, [gathered])
    sim.free_after(out, [sim.record(sim.compute)])
    assert sim.violations == [] and sim.operations == 3
    assert out.untyped_storage().size() == 0


def test_a_missing_wait_is_a_read_before_the_producer() -> None:
    sim = StreamSimulator()
    out = torch.empty(8)
    sim.access(sim.side_stream("all_gather"), "all-gather", writes=[out])
    with pytest.raises(StreamOrderError, match="forward on stream compute reads a buffer written"):
        sim.access(sim.compute, "forward", reads=[out])


def test_an_event_recorded_before_the_write_does_not_order_it() -> None:
    sim = StreamSimulator()
    ag, out = sim.side_stream("all_gather"), torch.empty(8)
    early = sim.record(ag)
    sim.access(ag, "all-gather", writes=[out])
    sim.wait_event(sim.compute, early)
    with pytest.raises(StreamOrderError, match="without waiting"):
        sim.access(sim.compute, "forward", reads=[out])


def test_a_write_while_another_stream_reads_is_caught() -> None:
    sim = StreamSimulator()
    ag, buf = sim.side_stream("all_gather"), torch.empty(8)
    sim.access(sim.compute, "forward", reads=[buf])
    with pytest.raises(StreamOrderError, match="may still use"):
        sim.access(ag, "next all-gather", writes=[buf])
    sim2 = StreamSimulator()
    sim2.access(sim2.compute, "forward", reads=[buf])
    sim2.wait_event(sim2.side_stream("all_gather"), sim2.record(sim2.compute))
    sim2.access(sim2.side_stream("all_gather"), "next all-gather", writes=[buf])  # ordered


def test_a_free_before_the_last_consumer_is_caught() -> None:
    sim = StreamSimulator()
    rs, grad = sim.side_stream("reduce_scatter"), torch.empty(8)
    sim.wait_stream(rs, sim.compute)
    sim.access(rs, "reduce-scatter", reads=[grad])
    with pytest.raises(StreamOrderError, match="freed while reduce-scatter"):
        sim.free_after(grad, [sim.record(sim.compute)])  # the compute event does not cover rs


def test_a_free_after_the_host_waited_is_fine_and_reuse_needs_an_allocation() -> None:
    sim = StreamSimulator()
    rs, grad = sim.side_stream("reduce_scatter"), torch.empty(8)
    sim.access(rs, "reduce-scatter", reads=[grad])
    sim.host_wait(sim.record(rs))
    sim.free_after(grad, [])
    with pytest.raises(StreamOrderError, match="freed buffer"):
        sim.access(sim.compute, "backward", writes=[grad])
    sim.allocated(sim.compute, grad)
    sim.access(sim.compute, "backward", writes=[grad])


def test_lenient_mode_collects_every_violation() -> None:
    sim = StreamSimulator(strict=False)
    out = torch.empty(2)
    sim.access(sim.side_stream("all_gather"), "all-gather", writes=[out])
    sim.access(sim.compute, "forward", reads=[out])
    sim.access(sim.compute, "forward again", reads=[out])
    assert [v.kind for v in sim.violations] == ["read-before-write"] * 2


def test_the_cpu_runtime_frees_at_once_and_checks_nothing() -> None:
    rt = CPURuntime()
    buf = torch.empty(8)
    rt.access(rt.side_stream("all_gather"), "all-gather", writes=[buf])
    rt.access(rt.compute, "forward", reads=[buf])
    rt.free_after(buf, [rt.record(rt.compute)])
    assert buf.untyped_storage().size() == 0


def test_a_storage_that_dies_takes_its_history_along() -> None:
    """Memory freed by Python may come back at the same address: a new buffer there starts
    with no history (no false report against the dead buffer's readers)."""
    import gc

    sim = StreamSimulator()
    t = torch.empty(1024)
    sim.access(sim.side_stream("all_gather"), "all-gather", writes=[t])
    key = t.untyped_storage()._cdata
    assert key in sim._buffers
    del t
    gc.collect()
    assert key not in sim._buffers


def test_a_collective_is_covered_only_by_events_after_its_wait() -> None:
    """On a device a collective's stream covers it only after ``work.wait()``: an event
    recorded before the wait proves nothing about its output or its input."""
    for record_first in (True, False):
        sim = StreamSimulator(strict=False)
        ag = sim.side_stream("all_gather")
        src, out = torch.ones(4), torch.empty(8)
        sim.access(ag, "all-gather", reads=[src], writes=[out], in_flight=True)
        early = sim.record(ag)
        sim.complete(ag, [src, out])
        event = early if record_first else sim.record(ag)
        sim.wait_event(sim.compute, event)
        sim.access(sim.compute, "copy-out", reads=[out])
        sim.free_after(src, [event])
        kinds = [v.kind for v in sim.violations]
        assert kinds == (["read-before-write", "free-while-in-use"] if record_first else [])


def test_memory_allocated_on_one_stream_is_written_by_another_only_after_a_wait() -> None:
    """A freed buffer grown again on compute belongs to compute first: another stream writing
    into it must wait for compute (a re-grown buffer used to start with no history)."""
    for wait in (False, True):
        sim = StreamSimulator(strict=False)
        ag = sim.side_stream("all_gather")
        buf = torch.empty(16)
        sim.access(sim.compute, "forward", reads=[buf])
        sim.free_after(buf, [sim.record(sim.compute)])
        sim.regrow(buf)
        sim.allocated(sim.compute, buf)
        if wait:
            sim.wait_stream(ag, sim.compute)
        sim.access(ag, "all-gather", writes=[buf])
        assert [v.kind for v in sim.violations] == ([] if wait else ["write-while-in-use"])
