"""``shell/engine/dtensors.py``: a local tensor wrapped as a ``DTensor`` with a known spec, the
fast way outside tracing and torch's own constructor while dynamo or export traces."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from functional_fsdp.shell.engine.dtensors import shard_like, wrap, wrap_like


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "while-tracing"])
def test_wrap_makes_the_dtensor_torchs_constructor_makes(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch, compiling: bool
) -> None:
    mesh = init_device_mesh("cpu", (1,))
    p = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    local = torch.randn(4, 3)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    got = wrap(local, p._spec)
    want = DTensor(local, p._spec, requires_grad=False)
    assert type(got) is DTensor and got._local_tensor is local and got._spec is p._spec
    assert got.shape == want.shape and got.stride() == want.stride()
    assert not got.requires_grad
    half = shard_like(local.to(torch.bfloat16), p)  # its own dtype, the same layout
    assert half.dtype == torch.bfloat16 and half.placements == p.placements


def test_wrap_like_keeps_a_plain_tensor_plain_and_an_unchanged_dtensor_itself(
    one_rank: Any,
) -> None:
    mesh = init_device_mesh("cpu", (1,))
    p = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    plain = torch.randn(2)
    assert wrap_like(plain, torch.zeros(2)) is plain
    assert wrap_like(p._local_tensor, p) is p
    new = torch.randn(4, 3)
    got = wrap_like(new, p)
    assert isinstance(got, DTensor) and got._local_tensor is new and got._spec is p._spec
