"""Each supported torch (2.11 to 2.15) behaves as FSDP2 of that torch: the version facts in
``functional_fsdp._compat`` against the running torch, and the behaviours that follow them
(reduce dtype, ``param_dtype_override_fn``, the functional optimizers' lerp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _dist import World

from functional_fsdp import _compat
from functional_fsdp.core.errors import PolicyError
from functional_fsdp.core.records import MixedPrecisionPolicy, ParamSpec
from functional_fsdp.functional.optim import _lerp_copy
from functional_fsdp.shell.engine.group_common import layout_for

STEPS = 2


def test_version_facts_match_this_torch() -> None:
    import torch.distributed.fsdp as fsdp

    assert tuple(int(p) for p in torch.__version__.split(".")[:2]) == _compat.TORCH_VERSION
    assert hasattr(fsdp, "DataParallelMeshDims") == _compat.HAS_DATA_PARALLEL_MESH_DIMS
    assert (
        hasattr(fsdp.FSDPModule, "set_reduce_scatter_max_input_buffers")
        == _compat.HAS_REDUCE_SCATTER_MAX_INPUT_BUFFERS
    )
    fields = getattr(fsdp.MixedPrecisionPolicy, "__dataclass_fields__", {})
    assert ("param_dtype_override_fn" in fields) == _compat.HAS_PARAM_DTYPE_OVERRIDE_FN
    assert hasattr(torch.UntypedStorage, "_swap_data_ptr_") == _compat.HAS_SWAP_DATA_PTR
    assert _compat.torch_at_least(2, 11) and not _compat.torch_at_least(99, 0)


def test_lerp_copy_is_foreach_lerp_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        start = [torch.randn(7, 3, generator=g).to(dtype), torch.randn(5, generator=g).to(dtype)]
        end = [torch.randn(7, 3, generator=g).to(dtype), torch.randn(5, generator=g).to(dtype)]
        before = [t.clone() for t in start]
        got = _lerp_copy(start, end, 0.1)
        want = torch._foreach_lerp(start, end, 0.1)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(torch.equal(a, b) for a, b in zip(start, before))  # inputs untouched


def _specs(*dtypes: torch.dtype) -> list[ParamSpec]:
    return [ParamSpec(f"p{i}", (4, 2), d) for i, d in enumerate(dtypes)]


def test_reduce_dtype_when_unset_follows_this_torchs_fsdp2() -> None:
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    lay = layout_for(_specs(torch.float32, torch.float32), 2, bf16)
    # FSDP2 2.15 reduces in the original dtype ("versionchanged 2.15"); before, in param_dtype.
    want = torch.float32 if _compat.FSDP2_REDUCES_IN_ORIGINAL_DTYPE else torch.bfloat16
    assert lay.grad_reduce_dtype() == want
    explicit = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert layout_for(_specs(torch.float32), 2, explicit).grad_reduce_dtype() == torch.bfloat16
    assert layout_for(_specs(torch.float32), 2, MixedPrecisionPolicy()).reduce_dtype is None


def test_coerce_keeps_param_dtype_override_fn() -> None:
    def fn(p: torch.Tensor) -> torch.dtype | None:
        return None

    if _compat.HAS_PARAM_DTYPE_OVERRIDE_FN:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

        theirs = TorchMP(param_dtype=torch.bfloat16, param_dtype_override_fn=fn)  # type: ignore[call-arg]
    else:  # an object with torch 2.15's fields, as a framework might pass
        theirs = type(
            "MixedPrecisionPolicy",
            (),
            {
                "param_dtype": torch.bfloat16,
                "reduce_dtype": None,
                "output_dtype": None,
                "cast_forward_inputs": True,
                "param_dtype_override_fn": staticmethod(fn),
            },
        )()
    ours = MixedPrecisionPolicy.coerce(theirs)
    assert ours.param_dtype_override_fn is fn and ours.param_dtype == torch.bfloat16


def test_param_dtype_override_fn_choices() -> None:
    w = nn.Parameter(torch.zeros(2))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: None)
    assert not mp.keeps_original_dtype(w)
    keep = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: p.dtype
    )
    assert keep.keeps_original_dtype(w)
    same = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.bfloat16
    )
    assert not same.keeps_original_dtype(w)
    for bad in (torch.float16, "fp32"):
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p, b=bad: b
        )
        with pytest.raises(ValueError, match="param_dtype_override_fn must return"):
            mp.keeps_original_dtype(w)
        with pytest.raises(PolicyError):
            mp.keeps_original_dtype(w)
    specs = [
        ParamSpec("w", (4, 2), torch.float32),
        ParamSpec("b", (4,), torch.float32, keep_dtype=True),
    ]
    lay = layout_for(
        specs, 2, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    assert lay.gather_dtypes == (torch.bfloat16, torch.float32)


class _Head(nn.Module):
    """A head that computes in its weight's dtype (fp32 when the override keeps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.to(self.lin.weight.dtype))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU(), _Head()
    )


def _train(which: str, override: bool) -> tuple[list[float], list[torch.Tensor]]:
    import torch.distributed as dist

    if which == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy as MP
        from torch.distributed.fsdp import fully_shard
    else:
        from functional_fsdp import MixedPrecisionPolicy as MP  # type: ignore[assignment]
        from functional_fsdp import fully_shard  # type: ignore[assignment]
    m = _mlp()
    kw: dict = {"param_dtype": torch.bfloat16}  # reduce_dtype unset: the default per version
    if override:  # the head stays fp32, in the root's group beside the bf16 LayerNorm
        keep = {id(p) for p in m[5].parameters()}
        kw["param_dtype_override_fn"] = lambda p: p.dtype if id(p) in keep else None
    mp = MP(**kw)
    for sub in (m[0], m[3]):
        fully_shard(sub, mp_policy=mp)
    fully_shard(m, mp_policy=mp)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = m(torch.randn(6, 16, generator=g)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.full_tensor().detach().clone() for p in m.parameters()]


def case_bf16_parity(override: bool) -> dict:
    ours, want = _train("ours", override), _train("torch", override)
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(ours[0], want[0])),
        "param_diff": max((a - b).abs().max().item() for a, b in zip(ours[1], want[1])),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "override",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not _compat.HAS_PARAM_DTYPE_OVERRIDE_FN,
                reason="param_dtype_override_fn is new in torch 2.15's FSDP2",
            ),
        ),
    ],
)
def test_bf16_without_reduce_dtype_matches_this_torchs_fsdp2(world2: World, override: bool) -> None:
    """bf16 compute, ``reduce_dtype`` unset (and on 2.15 an fp32 head in a bf16 group through
    ``param_dtype_override_fn``): losses and parameters bit-identical to FSDP2 of this torch."""
    for res in world2.run(case_bf16_parity, override):
        assert res["loss_diff"] == 0.0 and res["param_diff"] == 0.0, res
