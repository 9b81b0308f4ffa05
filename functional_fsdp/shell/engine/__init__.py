"""The runtime of a parameter group: ``group.py`` (``ParamGroup``, its phases) with its rooms
``gradients.py`` (reduction into ``.grad``) and ``lending.py`` (tied weights), ``param.py``
(``ShardedParam``), ``config.py`` (``GroupConfig``), ``gather.py`` (``GatherSlot``, every
all-gather), ``autograd.py`` (the autograd Functions), ``functional_path.py`` (per-call gathers
of caller-passed tensors), ``reproducible.py`` (the canonical-tree accumulation),
``group_common.py`` and ``memory.py``."""
