"""torchao's float8 training with its FSDP float8 all-gather, under our ``fully_shard``.

``convert_to_float8_training(..., enable_fsdp_float8_all_gather=True)`` wraps each Linear
weight in torchao's ``WeightWithDynamicFloat8CastTensor``, whose ``fsdp_pre_all_gather`` sends
float8 bytes (plus the scale in metadata) and whose ``fsdp_post_all_gather`` builds a float8
tensor: a real user of FSDP2's tensor-subclass all-gather protocol. It runs on CPU in torch 2.13
(2 gloo ranks): losses and parameters must equal torch FSDP2's with the same conversion, and
the float8 groups must send a quarter of the fp32 bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import World

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _train(impl: str, float8: bool) -> dict[str, Any]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if impl == "ours":
        from functional_fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
    )
    if float8:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)  # the root holds two float8 weights: the second decodes mid-buffer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        torch.manual_seed(100 * step + dist.get_rank())
        loss = model(torch.randn(16, 64)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out: dict[str, Any] = {
        "losses": losses,
        "params": [p.full_tensor() for p in model.parameters()],
        "local_types": [type(p.to_local()).__name__ for p in model[0].parameters()],
    }
    if impl == "ours":
        from functional_fsdp.core.codec import gather_bytes

        out["bytes"] = [gather_bytes(m._ffsdp_state.group.layout) for m in (model[0], model[2])]
    return out


def _case() -> dict[str, Any]:
    ours, theirs, fp32 = _train("ours", True), _train("fsdp2", True), _train("ours", False)
    return {
        "equal_fsdp2": ours["losses"] == theirs["losses"]
        and all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"])),
        "float8_used": ours["losses"] != fp32["losses"],
        "local_types": ours["local_types"],
        "bytes": ours["bytes"],
        "bytes_fp32": fp32["bytes"],
    }


def test_torchao_float8_all_gather_matches_fsdp2(world2: World) -> None:
    for res in world2.run(_case):
        assert res["equal_fsdp2"], res
        assert res["float8_used"], res
        assert res["local_types"][0] == "WeightWithDynamicFloat8CastTensor", res
        for f8, f32 in zip(res["bytes"], res["bytes_fp32"]):
            # the weight goes as 1-byte float8, the fp32 bias as before
            assert f8 < 0.3 * f32, res
