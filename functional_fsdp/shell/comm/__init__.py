"""Communicators over real process groups: ``process_group.py`` (``ProcessGroupComm``, bounded
waits), ``scoped.py`` (a group's tagged view of it, resync after a fault), ``schedule.py``
(collective kinds and positions for mismatch messages), ``custom.py`` (FSDP2's custom
collective and all-reduce hook extension points), ``graph_agreement.py`` (the ranks compare
their compiled graphs' collectives before any runs)."""
