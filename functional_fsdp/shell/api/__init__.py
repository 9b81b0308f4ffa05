"""What a user calls: ``fully_shard`` (``fully_shard.py``), the ``FSDPModule`` methods
(``module.py``), the per-module hook state and root logic (``state.py``), the functional-call
entry (``functional_call.py``), tensor-subclass codecs at sharding time (``codecs.py``),
``copy.deepcopy`` (``deepcopy.py``), finishing a backward outside autograd for pipeline
schedules (``finalization.py``) and ``use_as_fsdp2`` (``as_fsdp2.py``)."""
