"""Gradient shards stored in the compute dtype while a step has one micro-batch.

[Note: compact gradients]
A reduce-scattered gradient shard arrives in the compute dtype (the bucket is reduced
in that dtype: see [Note: gradient flow] in infinity/runtime/grads.py). With one
micro-batch per step the fp32 accumulator only ever holds ``shard.float()``, which
the shard itself, stored as it came, gives back exactly when the update reads it. So
with bf16 or fp16 compute and the optimizer states in host memory or on NVMe, the
store keeps its gradient keys in the compute dtype (2 bytes per parameter stored,
written in backward and read in the step, instead of 4). The first time a group
receives a second gradient before ``zero_grad`` (micro-batches accumulating), the
store widens for good: it allocates fp32 keys, converts what the compact keys hold
(exact) and frees them, and from then on accumulates in fp32 as before, so sums of
micro-batches are rounded once per addition in fp32, as they always were. The
update reads a compact sub-group into its own buffer and widens it into the fp32
buffer the host Adam kernel takes (the fused kernel takes one dtype).

With DPU both sets of gradient keys (the one backward accumulates into and the one the
background step reads, see [Note: delayed parameter update] in infinity/optim/delayed.py) are
compact, and widening widens both: the store asks its owner first (``before_widen``), which
waits for the running job (it reads its set with the store's dtype) and replaces the spare set by
fp32 keys. That wait is a host wait in backward, once per run, at the first accumulation.

Not used with the states on the compute device (autograd's gradients are added there in place).
"""
from __future__ import annotations

import torch

_COMPACT = (torch.bfloat16, torch.float16)


def grad_dtype_for(dtype: torch.dtype, optimizer_kind: str) -> torch.dtype:
    """The dtype a store starts its gradient keys in (see [Note: compact gradients])."""
    if dtype in _COMPACT and optimizer_kind in ("host", "nvme"):
        return dtype
    return torch.float32


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def widen(store, allocate) -> None:
    """Move ``store``'s gradient keys to fp32 for good (a second micro-batch arrived); exact.
    ``allocate(nbytes, tag)``: a new gradient key in the store's tier."""
    if store.grad_dtype == torch.float32:
        return
    if store.before_widen is not None:
        store.before_widen()
    if store.land_grads is not None:
        store.land_grads()      # a first shard's copy into a compact key may not have run yet (a GPU's copy stream)
    store.flush()
    old_dtype, old_keys = store.grad_dtype, list(store.keys["grad"])
    # Sub-groups of groups frozen since Init hold no gradient: nothing to carry over (on NVMe their
    # keys were never written).
    filled = {piece.sub_index for gi in store.grad_written for piece in store.layout.pieces_of_group[gi]}
    new_keys = []
    for sub, (_, numel) in enumerate(store.layout.sub_ranges):
        if old_keys[sub] is None:   # dormant: gets an fp32 key when it wakes
            new_keys.append(None)
            continue
        key = allocate(numel * 4, f"grad:sub{sub}")
        if store.in_place:
            store.tier.view(key).view(torch.float32)[:numel].copy_(
                store.tier.view(old_keys[sub]).view(old_dtype)[:numel])
        elif sub in filled:
            compact = torch.empty(numel, dtype=old_dtype)
            store.io.read(store.tier, old_keys[sub], compact).wait()
            store.io.write(store.tier, key, compact.float()).wait()
        store.tier.free(old_keys[sub])
        new_keys.append(key)
    store.keys["grad"] = new_keys
    store.grad_dtype = torch.float32
