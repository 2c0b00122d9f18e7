"""The optimizer: Adam/AdamW over each rank's flat fp32 master shard, states in their tier.

What the room holds, in the order an update runs: ``adam`` (the ``torch.optim``-style
front: ``AdamW``, ``Adam``, ``clip_grad_norm_``), ``checks`` (the non-finite flag, which
parameters had a gradient, the global norm for clipping), ``ranges`` (which elements
of which sub-group an update changes, and each parameter's own Adam step count),
``job`` (``StepJob``: everything one update needs, fixed at ``opt.step()``),
``scheduler`` (runs a job now, overlapped with the next forward, or one step behind with
DPU), ``background`` and ``delayed`` (the worker thread and DPU's double buffers),
``update`` (the host Adam kernel and the new compute copies), ``flat_state`` (the
flat per-sub-group master weights, moments and gradient accumulator, and the one
sub-group pipeline that streams them) and ``moments`` (m and v stored as bf16 or int8, and
the kernel that steps them).

What it may touch: the optimizer tier (through the state store), the parameter tier only
through ``infinity.runtime.shards.ParamShards`` (new compute copies, the fresh-shard
hand-off), the coordinator's ``release_all`` after an update, and the engine only
through its public lifecycle (``backward_running``, ``recover_aborted_backward``,
``attach_optimizer``).
"""
