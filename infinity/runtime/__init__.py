"""The engine of one model: construction, the forward/backward lifecycle, parameter availability.

What the room holds, in the order a parameter meets it: ``init`` (``infinity.Init``:
construction intercepted, each module partitioned as it is built), ``construction``
(flatten, shard and store a module's parameters; orphaned and tied groups),
``tier_set`` (the tiers one rank uses), ``shards`` (each rank's shards in the parameter
tier, the only door to it), ``engine`` (the lifecycle the hooks delegate to), ``hooks``
(every hook, installed in one place), ``coordinator`` (the one owner of a group's
availability: fetch, gather, release), ``gather_memory`` (the reused device memory
gathered groups borrow), ``datapath`` (every host<->device copy, tier transfer and host
wait, and the ledger of each step), ``foreign`` (parameters used by a module
that does not own them), ``grads`` (gradients reduce-scattered into the optimizer's
flat space), ``gathered`` (``infinity.gathered``), ``device`` and ``ranks`` (the compute
device and the data-parallel ranks).

What it may touch: the tiers (through ``TierSet``), the parameter groups, the optimizer
state store (``infinity.optim.flat_state``), the prefetcher and the tiling policy. It
does not step the optimizer: ``infinity.optim`` does, and registers itself with the engine.
"""
