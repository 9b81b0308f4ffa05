"""The tests' one-collective gather of full values (``tests/_full.py``) equals DTensor's own
``full_tensor()`` for every placement the comparisons meet: the parity tests compare what it
returns, so a misplaced piece on both sides would go unseen there."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _case() -> dict[str, Any]:
    from _dist import shared_mesh
    from _full import _is_block, full_list, full_tensors
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    line, square = shared_mesh((4,)), shared_mesh((2, 2), ("dp", "tp"))
    tensors: dict[str, Any] = {}
    for shape in [(7, 3), (1, 5), (3,), (10, 6), (5, 2, 3)]:  # uneven, empty pieces, 1-3 dims
        for dtype in (torch.float32, torch.bfloat16, torch.int64):  # unaligned byte offsets
            x = torch.randn(shape).to(dtype)
            key = f"{shape}-{dtype}"
            tensors[f"line-{key}"] = distribute_tensor(x, line, [Shard(0)])
            tensors[f"rs-{key}"] = distribute_tensor(x, square, [Replicate(), Shard(0)])
            tensors[f"ss-{key}"] = distribute_tensor(x, square, [Shard(0), Shard(0)])
            if len(shape) > 1:
                tensors[f"s1s0-{key}"] = distribute_tensor(x, square, [Shard(1), Shard(0)])
                tensors[f"s0s-1-{key}"] = distribute_tensor(x, square, [Shard(0), Shard(-1)])
            tensors[f"plain-{key}"] = x
    tensors["sub-mesh"] = distribute_tensor(torch.randn(9, 2), square["dp"], [Shard(0)])
    want = {k: t.full_tensor() if hasattr(t, "full_tensor") else t for k, t in tensors.items()}
    got = full_tensors(tensors)
    listed = full_list(tensors.values())
    return {
        "wrong": [k for k in want if not torch.equal(got[k], want[k])],
        "dtypes": [k for k in want if got[k].dtype != want[k].dtype],
        "list": all(torch.equal(a, b) for a, b in zip(listed, want.values())),
        "order": list(got) == list(tensors),
        "gathered_at_once": sum(_is_block(t) for t in tensors.values()),
    }


def test_full_tensors_equals_full_tensor_for_every_placement(world4: Any) -> None:
    for r in world4.run(_case):
        assert r["wrong"] == [] and r["dtypes"] == []
        assert r["list"] and r["order"]
        assert r["gathered_at_once"] == 69  # all but the plain tensors and the sub-mesh's
