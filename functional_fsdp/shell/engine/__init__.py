"""The runtime of a parameter group: ``group.py`` (``ParamGroup``, its phases) with its rooms
``gradients.py`` (reduction into ``.grad``) and ``lending.py`` (tied weights), ``param.py``
(``ShardedParam``), ``config.py`` (``GroupConfig``), ``gather.py`` (``GatherSlot``, every
all-gather), ``autograd.py`` (the autograd Functions), ``functional_path.py`` (per-call gathers
of caller-passed tensors), ``reproducible.py`` (the canonical-tree accumulation),
``abandoned.py`` (work a failed step left in flight, kept until it lands), ``group_common.py``
and ``memory.py``."""
