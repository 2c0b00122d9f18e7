"""The one pass over the sub-groups that every update runs: stored states in memory, streamed ones from NVMe.

[Note: pipelined sub-groups]
``OptimizerStateStore.sub_groups`` is the one pass over the sub-groups that every
update runs. On the host (or device) tier it yields the stored states themselves.
With the states on NVMe it keeps two sets of sub-group buffers: while the caller
steps sub-group i in one set, sub-group i+1 is being read into the other, and
sub-group i-1's write-back is still in flight. The host holds at most two
sub-groups of states, whatever the model size. Sub-groups an update does not
change are neither read nor written, except in the first pass, which writes every
sub-group's (zero) moments so that their keys hold data (dormant ones have none).
With the states split over tiers ([Note: optimizer states over tiers] in infinity/optim/tier_split.py)
one pass visits the sub-groups in memory, then the streamed ones, in order (the tiers hold consecutive runs
of sub-groups, fastest first, so the pass still goes up the sub-groups, and a next forward gets the first
groups first); the first two streamed sub-groups' reads are issued before the first step, so that they land
while the sub-groups in memory are stepped.

What the room may touch: the store's keys, buffers and tiers; nothing of the engine.
"""
from __future__ import annotations

from typing import Sequence

import torch

from infinity.optim import split_master
from infinity.optim.moments import MomentFormat
from tiers.base import wait_quietly

STATES = ("master", "exp_avg", "exp_avg_sq", "grad")
MOMENTS = ("exp_avg", "exp_avg_sq")


def stored_len(fmt: MomentFormat, state: str, numel: int) -> int:
    """Length, in the elements of its buffer's dtype, of one state of a sub-group of ``numel``."""
    return fmt.stored_nbytes(state, numel) // torch.empty((), dtype=fmt.stored_dtype(state)).element_size()


def sub_groups(store, grad_keys: Sequence[int], changed: Sequence[bool], grads: dict | None = None,
               compact: bool = False, streamed: bool = True):
    """Yield ``(sub, {state: tensor}, writes)`` for each sub-group of ``store`` an update must visit (fp32
    tensors; compressed moments as their raw bytes; with ``compact``, a compact gradient as it is stored,
    in the compute dtype, for a kernel that widens it itself).

    ``grad_keys`` are the gradient keys of the update (DPU's may be the second set);
    ``changed[sub]`` says whether the update changes anything in ``sub``. ``grads``: the
    gradients of the changed sub-groups in host memory instead of ``grad_keys`` (streamed
    stores; each is dropped once stepped). The caller may
    change the tensors in place and append ``(future, tensor)`` pairs of its own transfers
    to ``writes``; each is waited before the buffers it reads are reused and at the end.
    Master weights and moments are written back after the caller returns from a sub-group.
    A failed pass waits for every transfer it issued before its error travels on, so
    none outlives it (into buffers or keys the next pass, a fetch or a load uses).

    ``streamed`` False: a pass over sub-groups in memory only (a split store's device share), which leaves
    the streamed ones, their first pass included, to the pass over the rest: it would stream every one of
    them once more, inside ``opt.step()``.
    """
    in_place = _in_place(store, grad_keys, [sub for sub, c in enumerate(changed) if c and store.in_place_of(sub)],
                         compact)
    if not (store.streamed_subs and streamed):
        yield from in_place
        return
    stream = _streamed(store, grad_keys, changed, grads, compact)
    try:
        for sub, st, writes in stream:
            if sub is None:     # the first streamed reads are in flight: step the sub-groups in memory meanwhile
                yield from in_place
                in_place = None
                continue
            yield sub, st, writes
        if in_place is not None:
            yield from in_place
    finally:    # a pass closed early (its caller failed): each waits for what it issued, and neither outlives it
        stream.close()
        if in_place is not None:
            in_place.close()


def _in_place(store, grad_keys, subs: list[int], compact: bool = False):
    writes: list = []
    marks: list[int] = []
    try:
        for sub in subs:
            _retire(writes, marks)
            tier = store.sub_tiers[sub]
            st = {s: store.view(s, sub) for s in MOMENTS}
            numel = store.layout.sub_ranges[sub][1]
            st["grad"] = tier.view(grad_keys[sub]).view(store.grad_dtype)[:numel]
            if store.grad_dtype != torch.float32 and not compact:
                st["grad"] = store.scratch["grad"][:numel].copy_(st["grad"])
            if store.split is None:
                st["master"] = store.view("master", sub)
                yield sub, st, writes
                continue
            bufs = store.scratch
            remainder = tier.view(store.keys["remainder"][sub]).view(torch.int16)[:numel]
            for fut in store.split.read_copies(sub, bufs["copy"]):
                fut.wait()
            st["master"] = split_master.join(bufs["copy"][:numel], remainder, store.split.exceptions.get(sub),
                                             bufs["master"][:numel])
            yield sub, st, writes
            for fut, _ in writes:   # the caller's writes may read the joined masters
                fut.wait()
            store.split.exceptions.set(sub, split_master.split(st["master"], bufs["copy"][:numel], remainder))
    except BaseException:
        wait_quietly(f for f, _ in writes)
        raise
    for fut, _ in writes:
        fut.wait()


def _retire(writes: list, marks: list[int], depth: int = 2) -> None:
    """Before a sub-group is stepped, keep the caller's transfers of at most the ``depth`` sub-groups before
    it in flight: wait for older ones and let their sources go (a device share's new compute copies are
    tensors of their own, one per piece; held to the end of the pass, they would cost the whole share's
    copies in device memory at once)."""
    marks.append(len(writes))
    if len(marks) <= depth:
        return
    cut = marks[-depth - 1]
    for fut, _ in writes[:cut]:
        fut.wait()
    del writes[:cut]
    marks[:] = [m - cut for m in marks[-depth:]]


def _streamed(store, grad_keys, changed: Sequence[bool], grads: dict | None = None, compact: bool = False):
    io, layout, bufs = store.io, store.layout, store.slots
    moments_known = store.moments_initialized
    subs = [sub for sub in store.streamed_subs
            if changed[sub] or not (moments_known or sub in store.dormant)]
    reads: list[list] = [[], []]
    writes: list[list] = [[], []]

    def issue_reads(i: int) -> None:
        sub, slot = subs[i], i % 2
        tier = store.sub_tiers[sub]
        for fut, _ in writes[slot]:
            fut.wait()
        writes[slot] = []
        numel = layout.sub_ranges[sub][1]
        reads[slot] = []
        for s in STATES:
            buf = bufs[slot][s][:stored_len(store.moment_format, s, numel)]
            if s in MOMENTS and not moments_known:
                buf.zero_()
            elif s == "grad" and (not changed[sub] or grads is not None):
                continue
            elif s == "grad" and store.grad_dtype != torch.float32:
                reads[slot].append(io.read(tier, grad_keys[sub], bufs[slot]["grad_compact"][:numel]))
            elif s == "master" and store.split is not None:
                reads[slot].extend(store.split.read_copies(sub, bufs[slot]["copy"]))
                reads[slot].append(io.read(tier, store.keys["remainder"][sub], bufs[slot]["remainder"][:numel]))
            else:
                key = grad_keys[sub] if s == "grad" else store.keys[s][sub]
                reads[slot].append(io.read(tier, key, buf))

    try:
        for i in range(min(2, len(subs))):     # both sets of buffers are free: fill both
            issue_reads(i)
        if subs:
            yield None, None, None      # the first reads are issued (``sub_groups`` steps those in memory now)
        for i, sub in enumerate(subs):
            slot = i % 2
            tier = store.sub_tiers[sub]
            for fut in reads[slot]:
                fut.wait()
            if 0 < i < len(subs) - 1:
                issue_reads(i + 1)
            numel = layout.sub_ranges[sub][1]
            st = {s: bufs[slot][s][:stored_len(store.moment_format, s, numel)] for s in STATES}
            if grads is not None and changed[sub]:
                st["grad"].copy_(grads.pop(sub))    # KeyError: a changed sub-group without a held gradient
            elif store.grad_dtype != torch.float32 and changed[sub]:
                if compact:
                    st["grad"] = bufs[slot]["grad_compact"][:numel]
                else:
                    st["grad"].copy_(bufs[slot]["grad_compact"][:numel])
            if store.split is not None:
                copy, remainder = bufs[slot]["copy"][:numel], bufs[slot]["remainder"][:numel]
                split_master.join(copy, remainder, store.split.exceptions.get(sub), st["master"])
            yield sub, st, writes[slot]
            if store.split is not None:
                store.split.exceptions.set(sub, split_master.split(st["master"], copy, remainder))
                writes[slot].append((io.write(tier, store.keys["remainder"][sub], remainder), remainder))
            for s in MOMENTS if store.split is not None else ("master", *MOMENTS):
                writes[slot].append((io.write(tier, store.keys[s][sub], st[s]), st[s]))
    except BaseException:
        wait_quietly([f for slot in reads for f in slot] + [f for slot in writes for f, _ in slot])
        raise
    for slot in range(2):
        for fut, _ in writes[slot]:
            fut.wait()
    store.moments_initialized = True
