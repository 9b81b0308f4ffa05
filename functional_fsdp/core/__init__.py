"""The pure core: records, layouts and the transitions between them (no ``torch.distributed``,
no ``torch.cuda``, no shell). ``layout`` (integer math), ``records`` (frozen pytrees),
``transitions`` (shard, unshard, reshard, writeback), ``reduction`` (reduce_grad),
``reproducible`` (the canonical-tree reduction), ``compression``, ``codec`` (all-gather
codecs), ``tensor_parallel`` (2-D math), ``comm`` (the communicator protocol), ``errors``."""
