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
    ``allocate(nbytes, tag, sub)``: a new gradient key in sub-group ``sub``'s tier.

    All or nothing: each sub-group's fp32 key takes the place of its compact key once written, and when
    one fails (the disk full, an I/O error, an interrupt) the ones already widened are narrowed back
    (exact: they hold what the compact keys held) before the error leaves, so the store keeps its compact
    keys and values, and the step can be redone after ``zero_grad()``."""
    if store.grad_dtype == torch.float32:
        return
    undo = store.before_widen() if store.before_widen is not None else None
    try:
        if store.land_grads is not None:
            store.land_grads()      # a first shard's copy into a compact key may not have run yet (a GPU's copy stream)
        store.flush()
        old_dtype, keys = store.grad_dtype, store.keys["grad"]
        # Sub-groups of groups frozen since Init hold no gradient: nothing to carry over (on NVMe their
        # keys were never written).
        filled = {piece.sub_index for gi in store.grad_written for piece in store.layout.pieces_of_group[gi]}
        widened = []
        try:
            for sub, (_, numel) in enumerate(store.layout.sub_ranges):
                if keys[sub] is not None:   # else dormant: gets an fp32 key when it wakes
                    keys[sub] = _recast(store, sub, keys[sub], numel, old_dtype, torch.float32, sub in filled,
                                        allocate)
                    widened.append(sub)
        except BaseException:
            for sub in widened:     # the fp32 key is freed first: narrowing back needs no room beyond it
                keys[sub] = _narrow(store, sub, keys[sub], store.layout.sub_ranges[sub][1], old_dtype, sub in filled,
                                    allocate)
            raise
    except BaseException:
        if undo is not None:
            undo()
        raise
    store.grad_dtype = torch.float32


def _recast(store, sub: int, key, numel: int, dtype: torch.dtype, to: torch.dtype, filled: bool, allocate):
    """A new key holding sub-group ``sub``'s ``numel`` gradient values of ``key`` (in ``dtype``) in ``to``; ``key``
    is freed once it is written (a failure frees the new key and leaves ``key`` as it was)."""
    tier = store.sub_tiers[sub]
    new = allocate(numel * itemsize(to), f"grad:sub{sub}", sub)
    try:
        if store.in_place_of(sub):
            tier.view(new).view(to)[:numel].copy_(tier.view(key).view(dtype)[:numel])
        elif filled:
            values = torch.empty(numel, dtype=dtype)
            store.io.read(tier, key, values).wait()
            store.io.write(tier, new, values.to(to)).wait()
    except BaseException:
        tier.free(new)
        raise
    tier.free(key)
    return new


def _narrow(store, sub: int, key, numel: int, to: torch.dtype, filled: bool, allocate):
    """``_recast`` of an fp32 key back to ``to`` (exact: it was widened from it), reading it and freeing it
    before the new key is allocated."""
    tier = store.sub_tiers[sub]
    values = torch.empty(numel, dtype=torch.float32)
    if store.in_place_of(sub):
        values.copy_(tier.view(key).view(torch.float32)[:numel])
    elif filled:
        store.io.read(tier, key, values).wait()
    tier.free(key)
    new = allocate(numel * itemsize(to), f"grad:sub{sub}", sub)
    if store.in_place_of(sub):
        tier.view(new).view(to)[:numel].copy_(values)
    elif filled:
        store.io.write(tier, new, values.to(to)).wait()
    return new
