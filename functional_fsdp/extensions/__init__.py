"""Tensor subclasses that plug into FSDP2's all-gather extension protocol.

:class:`Int8RowwiseWeight` keeps a floating-point weight and all-gathers it as int8 rows plus
one fp32 scale per row (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``); it works with
``functional_fsdp.fully_shard`` and with torch's FSDP2 alike. See ``docs/extensions.md``.
"""

from __future__ import annotations

from .int8 import Int8RowwiseWeight

__all__ = ["Int8RowwiseWeight"]
