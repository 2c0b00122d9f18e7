"""Device memory for gathered groups: lent from an arena to each group's own storage, never allocated per fetch.

[Note: lending memory to a group]
Autograd keeps what forward saved for backward, often a view of a parameter
(``F.linear`` saves ``weight.t()``), and so the storage of the group's flat tensor:
the storage's identity must outlive a release, its memory must not (else the whole
model would stay gathered from forward to backward). Resizing the storage to zero
bytes on release and back on gather does that, but allocates and frees module-sized
blocks on every fetch: on the CPU each one is page-faulted afresh (or the heap
grows towards the model's size), on a GPU it is the caching allocator's churn.

So a group's storage *borrows* memory: gathering takes a slice of a device arena
(tiers/arena.py: slabs allocated once, reused best-fit) and swaps the slice's data
pointer into the group's storage; releasing swaps it back and returns the slice.
The storage object, which saved views hold, never changes; the bytes it points at
are refilled before the module's backward, through ``.data`` so that autograd's
version counters do not see the refill as an in-place edit. A released storage has
zero bytes, as before.

On CUDA a released slice may still be read by kernels the compute stream has not run
yet, so each release records an event there, and whoever fills a slice next makes
its copy stream wait for the latest one (``reuse_event``). Memory fresh from the
caching allocator is such memory too: the allocator hands the compute stream blocks it
freed with kernels still queued to read or write them (stream order makes that safe
on that stream alone), so a new slab, and a storage resized for a gather (below),
record the event as well.

With a torch that lacks the storage calls this needs (``UntypedStorage._swap_data_ptr_``
and ``torch._C._construct_storage_from_data_pointer``), it resizes storages as before
(``stats()["lending"]`` is False; its byte counters then count the resized storages, and a
``partition.gather_buffer_bytes``, which only an arena can hold to, warns that it has no
effect). That was the case on the lent H100 (torch 2.11): there the resized memory's upload
did not wait for the compute stream, and an ``offload-host`` run in bf16 lost the race now
and then, its losses 0.01-0.1% off from the third step, different from run to run, and exact
with ``CUDA_LAUNCH_BLOCKING=1`` or with the host waiting for every gradient download (which
kept it in step with the GPU).

[Note: long-lived and short-lived gathers]
Most gathered groups live for one module's forward or backward; groups kept gathered for the
whole step (stages 1 and 2, and groups below ``partition.persistence_threshold``) live from
their gather after an update to the next update. Were both lent from one arena, every kept
group would pin a hole among the recycled slices, and the short-lived ones would have to fit
around the holes: the arena would grow with the pattern, not with what is gathered at once.
So the kept groups borrow from an arena of their own, one slab of exactly their bytes
(``keep_apart``, at the end of ``infinity.Init``), and the short-lived ones from the recycled
arena: ``partition.gather_buffer_bytes`` when set (one buffer, allocated at the first gather,
never grown), else slabs of 64 MiB up to the most lent at once. A gather that finds a bounded
buffer full gets memory of its own for that use: counted (``overflows``), warned about once,
never refused (``infinity.gathered`` of a whole model may need more than any step does).

What the room may touch: the groups' flat tensors and its own arena.
"""
from __future__ import annotations

import warnings

import torch

from infinity.errors import EngineError
from tiers.arena import Arena

_CAN_LEND = (hasattr(torch.UntypedStorage, "_swap_data_ptr_")
             and hasattr(torch._C, "_construct_storage_from_data_pointer"))


class GatherMemory:
    """Memory for the flat tensors of gathered groups on ``device`` (see [Note: lending memory to a group]).

    Parameters
    ----------
    device:
        The compute device.
    mark:
        ``DataPath.mark``: an event at the compute stream's work enqueued so far (``DONE`` on the CPU),
        which the next fill of gathered memory waits for.
    capacity:
        ``partition.gather_buffer_bytes``: the recycled arena's one buffer; 0 grows it by slabs
        of ``slab_nbytes`` to the most it lent at once (see [Note: long-lived and short-lived gathers]).
    """

    def __init__(self, device: torch.device, mark, capacity: int = 0, slab_nbytes: int = 64 << 20) -> None:
        self.device = torch.device(device)
        self._mark = mark
        self.lending = _CAN_LEND
        # As the config says it (the arena rounds its buffer up to whole pages): what messages name.
        self._asked = f"partition.gather_buffer_bytes = {capacity}"
        # Without lending no arena lends anything: a bounded one would only hold prefetching back.
        bound = capacity if self.lending else 0
        self.arena = Arena(self._allocate, bound or None, slab_nbytes, name=f"gather-{self.device.type}")
        self.kept = Arena(self._allocate, None, slab_nbytes, name=f"gather-kept-{self.device.type}")
        self._lent: dict[int, tuple] = {}      # id(flat) -> (loan, the storage holding the group's old pointer)
        self.reuse_event = None
        self.overflows = 0
        self.overflow_bytes = 0
        self.reserve = 0        # room gathers ahead leave free for a gather on demand (size_for)
        self._resized = 0       # without lending: bytes in storages resized for gathers, and their peak
        self._resized_peak = 0
        if capacity and not self.lending:
            warnings.warn(f"partition.gather_buffer_bytes = {capacity} has no effect with this torch "
                          f"({torch.__version__}): a bounded gather buffer lends its memory to the groups' "
                          "storages (UntypedStorage._swap_data_ptr_, torch 2.13), so each gathered group gets "
                          "memory of its own (infinity.stats(model)['gather_memory'] counts it)",
                          RuntimeWarning, stacklevel=5)     # the user's Init (-> Engine -> Coordinator)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        memory = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._mark_reuse()      # fresh from the allocator: see [Note: lending memory to a group]
        return memory

    def _mark_reuse(self) -> None:
        """The next fill of gathered memory waits for the compute stream's work enqueued so far."""
        self.reuse_event = self._mark()

    def size_for(self, groups, in_place: bool = False) -> None:
        """The groups are final: the kept ones' arena becomes one slab of exactly their bytes (made at the
        first of their gathers), and a ``gather_buffer_bytes`` that cannot hold the largest of the
        others is refused, naming it (unless ``in_place``: gathered groups are their stored shards)."""
        def rounded(g) -> int:
            return -(-g.full_nbytes // 4096) * 4096
        self.kept.slab_nbytes = max(4096, sum(rounded(g) for g in groups if g.persistent))
        short = [g for g in groups if not g.persistent]
        largest = max(short, key=rounded, default=None)
        self.reserve = rounded(largest) if largest is not None else 0
        if self.arena.capacity and largest is not None and rounded(largest) > self.arena.capacity and not in_place:
            raise EngineError(f"{self._asked} cannot hold group "
                              f"{largest.name!r} gathered ({largest.full_nbytes} bytes); set it to at least "
                              f"{rounded(largest)} (more lets prefetched groups wait in it too), or 0 to let it grow")

    def has_room(self, nbytes: int) -> bool:
        """Whether a gather ahead of ``nbytes`` would find room now and leave room for the largest group
        gathered on demand: always, when the arena grows; else by the bytes left in its one buffer (a
        fragmented buffer may still refuse it)."""
        capacity = self.arena.capacity
        return not capacity or capacity - self.arena.bytes_in_use - self.reserve >= -(-nbytes // 4096) * 4096

    def _take(self, nbytes: int, owner: str, kept: bool):
        """A slice for a gather: from the kept arena, or the recycled one, or (full) memory of its own."""
        loan = (self.kept if kept else self.arena).take(nbytes, owner)
        if loan is not None:
            return loan
        self.overflows += 1
        self.overflow_bytes += nbytes
        if self.overflows == 1:
            warnings.warn(f"{self._asked} is full ({self.arena.bytes_in_use} "
                          f"bytes lent) and {owner} needs {nbytes} more: it gets memory of its own for this use "
                          "(counted in infinity.stats(model)['gather_memory']['overflows']); raise the key, or set "
                          "0 to let the buffer grow", RuntimeWarning, stacklevel=4)
        return _OwnMemory(self._allocate(nbytes), owner)

    def attach(self, flat: torch.Tensor | None, numel: int, dtype: torch.dtype, owner: str,
               source: torch.Tensor | None = None, kept: bool = False) -> torch.Tensor:
        """The group's flat tensor with ``numel`` elements of memory behind it (made on first use).

        With ``source`` (a group's whole shard in the compute device's memory: one rank, the
        device tier) the memory is that shard's own, and nothing is copied. ``kept``: the group
        stays gathered for the whole step (see [Note: long-lived and short-lived gathers]).
        """
        nbytes = numel * dtype.itemsize
        if flat is None:
            flat = torch.empty(0, dtype=dtype, device=self.device)
        if source is not None and not self.lending:
            # The flat tensor takes the shard's storage itself (a release gives it an empty one back):
            # the identity of its storage changes, which only matters to a group released and gathered
            # again, and a group gathered in place stays gathered (see [Note: in-use counts]).
            flat.set_(source.untyped_storage(), source.storage_offset(), (numel,))
            self._lent[id(flat)] = (None, None)
        elif source is not None:
            piece = torch._C._construct_storage_from_data_pointer(source.data_ptr(), self.device, nbytes)
            flat.untyped_storage()._swap_data_ptr_(piece)
            self._lent[id(flat)] = (None, piece)
        elif not self.lending:
            storage = flat.untyped_storage()
            held = storage.nbytes()
            if held < nbytes:
                storage.resize_(nbytes)
                self._mark_reuse()      # fresh from the allocator, as a new slab
                self._resized += nbytes - held
                self._resized_peak = max(self._resized_peak, self._resized)
        else:
            loan = self._take(nbytes, owner, kept)
            piece = torch._C._construct_storage_from_data_pointer(loan.tensor.data_ptr(), self.device, loan.nbytes)
            flat.untyped_storage()._swap_data_ptr_(piece)
            self._lent[id(flat)] = (loan, piece)
        if flat.numel() != numel:
            flat.set_(flat.untyped_storage(), 0, (numel,))
        return flat

    def detach(self, flat: torch.Tensor) -> None:
        """Take the memory back from a released group's flat tensor (its storage keeps zero bytes)."""
        if not self.lending:
            if self._lent.pop(id(flat), False) is False:
                self._resized -= flat.untyped_storage().nbytes()
                flat.untyped_storage().resize_(0)
            else:
                flat.set_()     # the storage was the group's stored shard: it keeps its memory
            return
        loan, piece = self._lent.pop(id(flat))
        flat.untyped_storage()._swap_data_ptr_(piece)
        if loan is not None:        # else the group's stored shard: nothing to give back
            self.give_back(loan)

    def give_away(self, flat: torch.Tensor) -> None:
        """``flat``'s storage keeps its bytes, in memory of its own, for the tensors outside the engine that share
        it; the memory lent to it comes back, and its group takes a new flat tensor at its next gather
        ([Note: tensors that outlive a block] in infinity/runtime/gathered.py)."""
        entry = self._lent.pop(id(flat), False)
        if not self.lending:
            if entry is False:      # resized for the group: its memory is theirs now (a stored shard keeps its own)
                self._resized -= flat.untyped_storage().nbytes()
            return
        loan, _ = entry
        storage = flat.untyped_storage()
        own = torch.empty(storage.nbytes(), dtype=torch.uint8, device=self.device)
        own.copy_(torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage))
        storage._swap_data_ptr_(own.untyped_storage())     # theirs owns the copy; ``own`` the loan's pointer
        if loan is not None:
            self.give_back(loan)

    def give_back(self, loan) -> None:
        """Return a slice the compute stream may still be using (its kernels enqueued, not run).

        On CUDA the next writer of any slice waits for this point of the compute stream
        (``reuse_event``); slices are then safe to fill from another stream.
        """
        self._mark_reuse()
        loan.release()

    def stats(self) -> dict:
        """The recycled arena's counters, the kept arena's (``kept``), and the gathers that overflowed.

        Without lending the arenas stay empty: ``nbytes``, ``bytes_in_use`` and ``peak_bytes`` then count
        the storages resized for gathers, kept groups' included.
        """
        out = self.arena.stats()
        if not self.lending:
            out.update(nbytes=self._resized, bytes_in_use=self._resized, peak_bytes=self._resized_peak,
                       allocated=self._resized_peak > 0)
        out.update(lending=self.lending, kept=self.kept.stats(), overflows=self.overflows,
                   overflow_bytes=self.overflow_bytes)
        return out


class _OwnMemory:
    """Memory of a gather's own, where a bounded buffer was full: freed with its last reference."""

    __slots__ = ("tensor", "nbytes", "owner")

    def __init__(self, tensor: torch.Tensor, owner: str) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.owner = owner

    def release(self) -> None:
        self.tensor = None
