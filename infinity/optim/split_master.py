"""The fp32 master weights stored as their bf16 compute copy plus a 16-bit remainder.

[Note: split master]
With bf16 compute the compute copy of a parameter is its fp32 master rounded to bf16
(round to nearest even, as ``Tensor.to`` does). The master's upper 16 bits are then
almost known: ``bits(master) = bits(copy) << 16 + r`` with a signed remainder
``r = bits(master) - (bits(copy) << 16)``. Rounding to nearest puts ``r`` in
``[-0x8000, +0x8000]``: 65537 values, one more than 16 bits hold. ``r = -0x8000``
(a tie rounded up) fits an int16; ``r = +0x8000`` (a tie rounded down: the low 16
bits exactly 0x8000 and the upper half even) does not. So each sub-group stores its
remainders as int16 in the optimizer tier, and keeps the few elements whose
remainder does not fit in an exception list in host memory: (index, fp32 bits).
The remainder is the int32 difference of the bit patterns (wrapping), so this
holds for any pattern: a NaN, whose rounding is a canonical NaN, comes back with
its payload (as an exception when the payload differs by more than 16 bits can
say). Joining adds the remainder to the copy's bits and writes the exceptions back
over it, so the master comes back bit for bit, NaNs, infinities and signed zeros
included. For random mantissas about one element in 2^17 is an exception (8 bytes
each); a model whose masters all sit on ties (a constant such as 1 + 2^-8) keeps
one per element (``SplitMasters.exceptions.count()`` says how many).

The remainder is computed from the master's own rounding, never from the stored
copy, so the invariant the store relies on is that the parameter tier always holds
the rounding of the master: every writer of a master writes its compute copy too
(``OptimizerStateStore.write_master_shard``), and the update writes the new copy
of every element it changes. This saves the separate fp32 master (4 bytes per
parameter stored, 4 read and 4 written per step), for 2 bytes of remainder.

Used when the compute dtype is bf16 and the parameters and the optimizer states are
both on NVMe (``use_split_master``), where the step is bound by the disk's bytes.
Joining and splitting cost host CPU: with torch's element-wise kernels about 3 ns
(join) and 5 ns (split; one C pass now, ``_qadam.split_bf16``: 1.5-2) per element on these 2-core
machines, against about 4 ns
for the whole fused Adam step: with the states in host memory that nearly tripled
the optimizer step (24M parameters: 95 -> 272 ms) to save 2 of 16 bytes of RAM,
so host tiers keep a separate fp32 master, as do fp16 (another exponent range),
fp32, and a device parameter tier (reading the copies back from the device would
add a transfer each step). The code path works for any host-memory or NVMe tier
(the tests run it on both). Dormant sub-groups, never stepped, rest split in every tier
of the copies, the device's included (``rest_split``).

What the room may touch: the parameter shards (``ParamShards``: reads and writes of
compute copies by element offset) and the flat layout; nothing of modules.
"""
from __future__ import annotations

import threading

import torch

from tiers.aio import aligned_empty

try:    # the C kernels (optim_csrc/qadam.c); without them split takes torch's passes
    from infinity.optim import _qadam
except ImportError:    # pragma: no cover - a checkout whose extension is not built
    _qadam = None

REMAINDER_ITEMSIZE = 2
# A low half 0x8000 read as an int16: the remainder of a tie rounded up (a tie rounded down needs +0x8000).
_TIE_UP = -(1 << 15)
# The bits of a bf16 infinity without its sign: a larger magnitude is a NaN.
_BF16_INF = 0x7F80
# Elements of a remainder widened at a time by ``join`` (16 MiB of int32).
_JOIN_CHUNK = 1 << 22


def use_split_master(dtype: torch.dtype, params_kind: str, optimizer_kind: str) -> bool:
    """Whether the masters are stored split (see [Note: split master])."""
    return dtype == torch.bfloat16 and params_kind == optimizer_kind == "nvme"


def rest_split(dtype: torch.dtype, params_kind: str, optimizer_kind: str) -> bool:
    """Whether the masters of dormant sub-groups are stored split while they sleep ([Note: dormant
    sub-groups] in infinity/optim/flat_state.py): bf16 copies in any tier, and a separate fp32 master in
    host memory or on NVMe (not already split). With the copies on the device, joining reads them back
    once, when the sub-group wakes (or a checkpoint saves it), never per step."""
    return (dtype == torch.bfloat16 and optimizer_kind in ("host", "nvme")
            and not use_split_master(dtype, params_kind, optimizer_kind))


def _host_flag(flag: torch.Tensor) -> bool:
    """The value of a 0-dim bool computed from host memory. Masters are split and joined in host
    buffers (copies on the device are read into one first), so this never waits for a device (it is
    no ``.item()`` on a device tensor)."""
    return bool(flag.numpy())


def split(master: torch.Tensor, copy: torch.Tensor, remainder: torch.Tensor):
    """Fill ``copy`` (bf16) with ``master``'s rounding and ``remainder`` (int16) with what restores it.

    Returns the exceptions: ``(index int64, bits int32)`` of the elements that copy and remainder
    do not restore, or None. Rounding to nearest makes the signed remainder the master's low 16
    bits read as an int16, except for a tie rounded down (low bits 0x8000, which as an int16
    says "rounded up") and NaNs whose rounding changed more than the low bits: so the remainder is
    the low half of each master, and only the elements whose low half is 0x8000 or whose copy is
    NaN are checked, by joining them.
    """
    if (_qadam is not None and master.dtype == torch.float32 and copy.dtype == torch.bfloat16
            and remainder.dtype == torch.int16 and master.numel() == copy.numel() == remainder.numel()
            and master.is_contiguous() and copy.is_contiguous() and remainder.is_contiguous()):
        return _split_native(master, copy, remainder)
    bits = master.view(torch.int32)
    copy.copy_(master)
    remainder.copy_(bits)                   # int32 -> int16 keeps the low 16 bits
    index = torch.nonzero(torch.eq(remainder, _TIE_UP)).flatten()
    magnitude = torch.bitwise_and(copy.view(torch.int16), 0x7FFF)
    if copy.numel() and _host_flag(torch.max(magnitude) > _BF16_INF):    # a NaN: rare, so a second look
        index = torch.unique(torch.cat([index, torch.nonzero(magnitude > _BF16_INF).flatten()]))
    if index.numel() == 0:
        return None
    joined = copy[index].float().view(torch.int32).add_(remainder[index])
    index = index[joined != bits[index]]
    if index.numel() == 0:
        return None
    return index, bits[index].clone()


_scratch = threading.local()
_INDEX_ROOM = 1 << 16      # exceptions _split_native finds room for in one call


def _split_native(master: torch.Tensor, copy: torch.Tensor, remainder: torch.Tensor):
    """``split`` in one pass of the C kernel (``_qadam.split_bf16``): copies, remainders and the exact
    exceptions together, where torch's passes (two copies, then a look for ties and NaNs, then a join
    of those) cost 0.24-0.34 s per 32Mi elements against 0.05-0.06."""
    n = master.numel()
    room = getattr(_scratch, "index", None)
    if room is None:
        room = _scratch.index = torch.empty(_INDEX_ROOM, dtype=torch.int64)
    count = _qadam.split_bf16(n, master.data_ptr(), copy.data_ptr(), remainder.data_ptr(), room.data_ptr(),
                              room.numel())
    if count == 0:
        return None
    if count <= room.numel():
        index = room[:count].clone()
    else:                                   # masters on ties (a constant): one exception per element, or near
        index = torch.empty(count, dtype=torch.int64)
        _qadam.split_bf16(n, master.data_ptr(), copy.data_ptr(), remainder.data_ptr(), index.data_ptr(), count)
    return index, master.view(torch.int32)[index].clone()


def join(copy: torch.Tensor, remainder: torch.Tensor, exceptions, master: torch.Tensor) -> torch.Tensor:
    """The exact fp32 master from its bf16 ``copy``, int16 ``remainder`` and exceptions, into ``master``.

    The remainder is widened to int32 ``_JOIN_CHUNK`` elements at a time before it is added:
    an int32 += int16 addition takes torch's slow mixed-dtype path (5x slower)."""
    master.copy_(copy)
    bits = master.view(torch.int32)
    numel = master.numel()
    wide = torch.empty(min(numel, _JOIN_CHUNK), dtype=torch.int32)
    for c0 in range(0, numel, _JOIN_CHUNK):
        c1 = min(c0 + _JOIN_CHUNK, numel)
        bits[c0:c1].add_(wide[:c1 - c0].copy_(remainder[c0:c1]))
    if exceptions is not None:
        index, values = exceptions
        bits[index] = values
    return master


class Exceptions:
    """Per sub-group, the elements whose master the copy and remainder cannot restore (host memory)."""

    def __init__(self) -> None:
        self._of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, sub: int, start: int = 0, numel: int | None = None):
        """The exceptions of ``sub`` within ``[start, start + numel)``, indices relative to ``start``."""
        found = self._of.get(sub)
        if found is None:
            return None
        index, values = found
        if start == 0 and numel is None:
            return found
        keep = torch.nonzero((index >= start) & (index < start + numel)).flatten()
        if keep.numel() == 0:
            return None
        return index[keep] - start, values[keep]

    def set(self, sub: int, found, start: int = 0, numel: int | None = None) -> None:
        """Replace the exceptions of ``sub`` within ``[start, start + numel)`` (all: numel None) by ``found``."""
        old = self._of.pop(sub, None)
        parts_i, parts_v = [], []
        if old is not None and numel is not None:
            keep = torch.nonzero((old[0] < start) | (old[0] >= start + numel)).flatten()
            parts_i.append(old[0][keep])
            parts_v.append(old[1][keep])
        if found is not None:
            parts_i.append(found[0] + start)
            parts_v.append(found[1])
        if parts_i and sum(t.numel() for t in parts_i):
            index = torch.cat(parts_i)
            order = torch.argsort(index)
            self._of[sub] = (index[order], torch.cat(parts_v)[order])

    def count(self) -> int:
        return sum(i.numel() for i, _ in self._of.values())

    def state(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Every sub-group's exceptions (what a checkpoint in place saves beside the swap files)."""
        return dict(self._of)

    def load(self, state: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Replace every exception with ``state`` (from ``state()``)."""
        self._of = {int(sub): (index, values) for sub, (index, values) in state.items()}


class CopyAccess:
    """Reads and writes of the compute copies by flat-layout piece (the parameter shards).

    Parameters
    ----------
    shards:
        ``infinity.runtime.shards.ParamShards``.
    groups:
        The parameter groups, by index (the layout's group order).
    """

    def __init__(self, shards, groups) -> None:
        self.shards, self.groups = shards, list(groups)
        self.kind = shards.kind

    def read(self, piece, dst: torch.Tensor):
        """Start reading ``piece``'s compute copy into ``dst`` (bf16, ``piece.numel`` long)."""
        group = self.groups[piece.group_index]
        return self.shards.datapath.read(self.shards.tier, group.param_key, dst,
                                         piece.group_offset * REMAINDER_ITEMSIZE)

    def write(self, piece, src: torch.Tensor):
        """Start writing ``piece``'s compute copy from ``src`` (bf16)."""
        return self.shards.write(self.groups[piece.group_index], src, piece.group_offset)


ZERO = -1
"""A sub-group's remainder key not allocated yet: all its remainders are zero (see [Note: zero remainders])."""

_ZEROS_CHUNK = 1 << 22      # int16 zeros written at a time into a key that stops being ``ZERO``


class SplitMasters:
    """The masters of one store, split (see [Note: split master]): remainder keys, exceptions, copies.

    [Note: zero remainders]
    Masters that are bf16 values (a base loaded from a bf16 checkpoint: most pretrained weights are
    published in bf16) have remainders that are all zero. A dormant sub-group's remainder key
    (``rest_split``) starts as ``ZERO``: none is allocated, reads give zeros, and writes whose
    remainders are all zero (exceptions aside: they live in host memory either way) keep it so. The
    first write with a nonzero remainder allocates the key, zero, and writes it. So a frozen bf16 base
    holds no bytes in the optimizer's tier beyond its compute copies until it trains. Dormant
    sub-groups start so, resting or (with split masters) not; one that wakes gets its key, zero, then:
    the update streams the keys of the others every step.

    Parameters
    ----------
    copies:
        :class:`CopyAccess` to the compute copies.
    layout:
        The store's ``FlatLayout``.
    tier, io:
        The optimizer tier and the data path that moves its bytes.
    keys:
        The remainder key of each sub-group (int16, in ``tier``), or ``ZERO``.
    allocate:
        ``allocate(sub, nbytes)``: a new key in ``tier`` for sub-group ``sub``'s remainders, where one
        is ``ZERO`` and a nonzero remainder arrives.
    """

    def __init__(self, copies: CopyAccess, layout, tier, io, keys: list[int], allocate=None) -> None:
        self.copies, self.layout, self.tier, self.io, self.keys = copies, layout, tier, io, keys
        self.allocate = allocate
        self.exceptions = Exceptions()

    def _read_remainder(self, sub: int, dst: torch.Tensor, offset: int = 0):
        """Start reading ``sub``'s remainders from element ``offset`` into ``dst`` (int16)."""
        if self.keys[sub] == ZERO:
            dst.zero_()
            return _DONE
        return self.io.read(self.tier, self.keys[sub], dst, offset=offset * REMAINDER_ITEMSIZE)

    def materialize(self, sub: int, key: int | None = None) -> None:
        """Give sub-group ``sub``, whose remainders are ``ZERO``, a key holding them (zeros): ``key``, or
        a new one."""
        key = self.allocate(sub, self.layout.sub_ranges[sub][1] * REMAINDER_ITEMSIZE) if key is None else key
        try:
            self.write_zeros(sub, key)
        except BaseException:
            self.tier.free(key)
            raise
        self.keys[sub] = key

    def write_zeros(self, sub: int, key: int) -> None:
        """Write zero remainders for all of sub-group ``sub`` into ``key`` (not yet its key)."""
        numel = self.layout.sub_ranges[sub][1]
        zeros = torch.zeros(min(numel, _ZEROS_CHUNK), dtype=torch.int16)
        for at in range(0, numel, zeros.numel()):
            self.io.write(self.tier, key, zeros[:min(zeros.numel(), numel - at)],
                          offset=at * REMAINDER_ITEMSIZE).wait()

    def adopt(self, sub: int) -> int:
        """Give sub-group ``sub``, whose remainders are ``ZERO``, a key whose bytes come from elsewhere (a
        checkpoint in place that has them); returns it."""
        self.keys[sub] = self.allocate(sub, self.layout.sub_ranges[sub][1] * REMAINDER_ITEMSIZE)
        return self.keys[sub]

    def free(self, sub: int) -> None:
        """Free sub-group ``sub``'s remainder key (it stops being split); its exceptions go too."""
        if self.keys[sub] != ZERO:
            self.tier.free(self.keys[sub])
        self.keys[sub] = None
        self.exceptions.set(sub, None)

    def read_copies(self, sub: int, copy: torch.Tensor) -> list:
        """Start reading sub-group ``sub``'s compute copies into ``copy`` (bf16, the sub-group long)."""
        return [self.copies.read(p, copy[p.sub_offset:p.sub_offset + p.numel])
                for p in self.layout.pieces_of_sub[sub]]

    def write_piece(self, piece, src: torch.Tensor) -> list:
        """Start storing fp32 ``src`` as ``piece``'s masters: remainder and compute copy. Returns the
        ``(future, tensor)`` pairs of the writes."""
        # Page-aligned: an NVMe tier writes them straight from here, not through its I/O pool.
        copy = aligned_empty(piece.numel * 2).view(torch.bfloat16)
        remainder = aligned_empty(piece.numel * REMAINDER_ITEMSIZE).view(torch.int16)
        found = split(src.contiguous(), copy, remainder)
        sub = piece.sub_index
        if self.keys[sub] == ZERO and _host_flag(torch.any(remainder)):
            self.materialize(sub)
        self.exceptions.set(sub, found, piece.sub_offset, piece.numel)
        writes = [(self.copies.write(piece, copy), copy)]
        if self.keys[sub] != ZERO:      # all-zero remainders of a ZERO key need no write
            writes.append((self.io.write(self.tier, self.keys[sub], remainder, piece.sub_offset * REMAINDER_ITEMSIZE),
                           remainder))
        return writes

    def read_piece(self, piece, dst: torch.Tensor) -> torch.Tensor:
        """``piece``'s fp32 masters, joined into ``dst``."""
        # Page-aligned: an NVMe tier reads straight into them, not through its I/O pool.
        copy = aligned_empty(piece.numel * 2).view(torch.bfloat16)
        remainder = aligned_empty(piece.numel * REMAINDER_ITEMSIZE).view(torch.int16)
        futures = (self.copies.read(piece, copy), self._read_remainder(piece.sub_index, remainder, piece.sub_offset))
        for fut in futures:
            fut.wait()
        return join(copy, remainder, self.exceptions.get(piece.sub_index, piece.sub_offset, piece.numel), dst)

    def read_sub(self, sub: int) -> torch.Tensor:
        """Sub-group ``sub``'s fp32 masters as a new tensor (checkpoint writes)."""
        numel = self.layout.sub_ranges[sub][1]
        copy = aligned_empty(numel * 2).view(torch.bfloat16)     # page-aligned, as in write_piece
        remainder = aligned_empty(numel * REMAINDER_ITEMSIZE).view(torch.int16)
        futures = self.read_copies(sub, copy)
        futures.append(self._read_remainder(sub, remainder))
        for fut in futures:
            fut.wait()
        return join(copy, remainder, self.exceptions.get(sub), torch.empty(numel))

    def write_sub(self, sub: int, master: torch.Tensor) -> None:
        """Set sub-group ``sub``'s fp32 masters and their compute copies (checkpoint loads)."""
        writes = []
        for piece in self.layout.pieces_of_sub[sub]:
            writes.extend(self.write_piece(piece, master[piece.sub_offset:piece.sub_offset + piece.numel]))
        for fut, _ in writes:
            fut.wait()


class MasterSource:
    """The joined masters as a read-only "tier" keyed by sub-group (checkpoint writes).

    ``read(sub, dst, offset)`` copies bytes ``[offset, offset + len(dst))`` of sub-group ``sub``'s
    fp32 masters into ``dst`` (uint8); the last sub-group joined is kept for the next read.
    """

    kind = "host"

    def __init__(self, masters: SplitMasters) -> None:
        self.masters = masters
        self._sub, self._bytes = None, None

    def read(self, sub: int, dst: torch.Tensor, offset: int = 0):
        if self._sub != sub:
            self._bytes = self.masters.read_sub(sub).view(torch.uint8)
            self._sub = sub
        dst.copy_(self._bytes[offset:offset + dst.numel()])
        return _DONE


class _Done:
    @staticmethod
    def wait():
        return None

    @staticmethod
    def done() -> bool:
        return True


_DONE = _Done()
