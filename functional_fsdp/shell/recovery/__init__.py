"""Surviving a lost rank, the shell's part: the neighbour copies kept after each step
(``copies.py``) and rebuilding the model on the survivors from them (``rebuild.py``).

(The pure part, which ranks hold which copies and how the survivors re-shard from them, is
:mod:`functional_fsdp.core.recovery`.)
"""
