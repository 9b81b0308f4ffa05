"""The huge-page advisor is advice only: values, sizes and small tensors are untouched."""

from __future__ import annotations

import torch

from functional_fsdp.shell.memory import huge_page_advisor


def test_advice_keeps_values_and_sizes() -> None:
    advise = huge_page_advisor()
    big = torch.empty(3 * (1 << 20), dtype=torch.float32)  # 12 MiB: has 2 MiB-aligned pages
    advise(big)
    big.copy_(torch.arange(big.numel(), dtype=torch.float32))
    assert torch.equal(big[:5], torch.arange(5, dtype=torch.float32))
    assert big.untyped_storage().nbytes() == 12 * (1 << 20)


def test_small_and_empty_tensors_are_skipped() -> None:
    advise = huge_page_advisor()
    small = torch.ones(10)
    advise(small)
    advise(torch.empty(0))
    assert torch.equal(small, torch.ones(10))


def test_resized_storage_can_be_advised_again() -> None:
    advise = huge_page_advisor()
    buf = torch.empty(2 * (1 << 20))
    advise(buf)
    buf.untyped_storage().resize_(0)
    buf.untyped_storage().resize_(8 * (1 << 20))
    advise(buf)
    buf.fill_(2.0)
    assert buf.sum().item() == 2.0 * buf.numel()
