"""Tensor-parallel ``DTensor`` parameters under ``fully_shard`` (2-D FSDP x TP):
``tensor_parallel.py``."""
