"""State in and out of sharded modules: DCP checkpoints (``checkpoint.py``, with checksummed,
path-checked files in ``checkpoint_files.py``), ``summon_full_params`` (``summon.py``) and
re-adopting parameters replaced by ``load_state_dict(assign=True)`` (``reload.py``)."""
