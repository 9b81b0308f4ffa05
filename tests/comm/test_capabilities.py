"""Communicators declare what they can do (``CommCapabilities``); the engine reads the flags."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from functional_fsdp.core.comm import (
    PLAIN_COMM,
    CommCapabilities,
    capabilities,
    scoped_view,
)
from functional_fsdp.shell.comm.custom import CustomCollectiveComm, base_comm, unwrap
from functional_fsdp.shell.comm.process_group import ProcessGroupComm
from functional_fsdp.shell.comm.scoped import ScopedComm
from functional_fsdp.shell.engine.coalesced import bucket_comm
from functional_fsdp.testing import SimulatedWorld


def _base() -> Any:
    """A process group's communicator with no process group behind it (nothing here runs a
    collective): what a scoped view reads of its base."""
    base = ProcessGroupComm.__new__(ProcessGroupComm)
    base._p2p, base._pieces_min_bytes, base._rank, base._world_size = False, 0, 0, 2
    return base


class _User:
    """A user's FSDP2 collective object (allocate and call); never called here."""

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        raise AssertionError("not called")

    def __call__(self, **kwargs: Any) -> Any:
        raise AssertionError("not called")


def test_a_plain_communicator_declares_nothing() -> None:
    comm = SimulatedWorld(2).comm(0)
    assert capabilities(comm) is PLAIN_COMM
    assert capabilities(None) == CommCapabilities()
    assert scoped_view(comm) is None
    assert base_comm(comm) is None
    # An unrelated ``base`` attribute is not a process group's communicator.
    assert base_comm(SimpleNamespace(base=object())) is None


def test_a_scoped_view_declares_scoped_and_names_its_base() -> None:
    base = _base()
    view = ScopedComm(base, 3, name="blocks.0")
    assert capabilities(view) == CommCapabilities(scoped=True)
    assert scoped_view(view) is view
    assert base_comm(view) is base
    assert capabilities(view.for_summon()).scoped
    bucket = view.for_bucket(["blocks.0", "blocks.1"])
    assert capabilities(bucket).scoped and bucket.name != view.name


def test_custom_collectives_declare_which_collective_is_the_users() -> None:
    base = _base()
    view = ScopedComm(base, 3, name="blocks.0")
    gather = CustomCollectiveComm(view, all_gather=_User())
    scatter = CustomCollectiveComm(view, reduce_scatter=_User())
    assert capabilities(gather) == CommCapabilities(custom_all_gather=True)
    assert capabilities(scatter) == CommCapabilities(custom_reduce_scatter=True)
    assert capabilities(gather).custom and capabilities(scatter).custom
    assert not capabilities(view).custom
    # A custom wrapper is not scoped (its collectives are the user's), runs on the view's base
    # and unwraps to the view.
    assert scoped_view(gather) is None
    assert base_comm(gather) is base and unwrap(gather) is view


def test_a_bucket_of_scoped_members_gets_a_view_of_its_own() -> None:
    base = _base()
    a, b = ScopedComm(base, 3, name="blocks.0"), ScopedComm(base, 4, name="blocks.1")
    members: Any = [SimpleNamespace(comm=a, name="x"), SimpleNamespace(comm=b, name="y")]
    shared = bucket_comm(members)
    assert shared is not a and capabilities(shared).scoped
    assert "blocks.0" in str(shared.name) and "blocks.1" in str(shared.name)
    # One member, or a communicator that is not scoped: the group's own.
    assert bucket_comm(members[:1]) is a
    plain: Any = [SimpleNamespace(comm=SimulatedWorld(2).comm(0), name=n) for n in "xy"]
    assert bucket_comm(plain) is plain[0].comm
