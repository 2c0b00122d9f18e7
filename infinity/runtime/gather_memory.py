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
its copy stream wait for the latest one (``reuse_event``).

With a torch that lacks the storage calls this needs (``UntypedStorage._swap_data_ptr_``
and ``torch._C._construct_storage_from_data_pointer``), it resizes storages as before.

What the room may touch: the groups' flat tensors and its own arena.
"""
from __future__ import annotations

import torch

from tiers.arena import Arena

_CAN_LEND = (hasattr(torch.UntypedStorage, "_swap_data_ptr_")
             and hasattr(torch._C, "_construct_storage_from_data_pointer"))


class GatherMemory:
    """Memory for the flat tensors of gathered groups on ``device`` (see [Note: lending memory to a group]).

    Parameters
    ----------
    device:
        The compute device.
    slab_nbytes:
        Size of each slab of the arena; it grows by slabs to the most it lent at once.
    """

    def __init__(self, device: torch.device, slab_nbytes: int = 64 << 20) -> None:
        self.device = torch.device(device)
        self.lending = _CAN_LEND
        self.arena = Arena(lambda n: torch.empty(n, dtype=torch.uint8, device=self.device), None, slab_nbytes,
                           name=f"gather-{self.device.type}")
        self._lent: dict[int, tuple] = {}      # id(flat) -> (loan, the storage holding the group's old pointer)
        self.reuse_event = None

    def attach(self, flat: torch.Tensor | None, numel: int, dtype: torch.dtype, owner: str,
               source: torch.Tensor | None = None) -> torch.Tensor:
        """The group's flat tensor with ``numel`` elements of memory behind it (made on first use).

        With ``source`` (a group's whole shard in the compute device's memory: one rank, the
        device tier) the memory is that shard's own, and nothing is copied.
        """
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if flat is None:
            flat = torch.empty(0, dtype=dtype, device=self.device)
        if source is not None:
            piece = torch._C._construct_storage_from_data_pointer(source.data_ptr(), self.device, nbytes)
            flat.untyped_storage()._swap_data_ptr_(piece)
            self._lent[id(flat)] = (None, piece)
        elif not self.lending:
            storage = flat.untyped_storage()
            if storage.nbytes() < nbytes:
                storage.resize_(nbytes)
        else:
            loan = self.arena.take(nbytes, owner)
            piece = torch._C._construct_storage_from_data_pointer(loan.tensor.data_ptr(), self.device, loan.nbytes)
            flat.untyped_storage()._swap_data_ptr_(piece)
            self._lent[id(flat)] = (loan, piece)
        if flat.numel() != numel:
            flat.set_(flat.untyped_storage(), 0, (numel,))
        return flat

    def detach(self, flat: torch.Tensor) -> None:
        """Take the memory back from a released group's flat tensor (its storage keeps zero bytes)."""
        if not self.lending:
            flat.untyped_storage().resize_(0)
            return
        loan, piece = self._lent.pop(id(flat))
        flat.untyped_storage()._swap_data_ptr_(piece)
        if loan is not None:        # else the group's stored shard: nothing to give back
            self.give_back(loan)

    def give_back(self, loan) -> None:
        """Return a slice the compute stream may still be using (its kernels enqueued, not run).

        On CUDA the next writer of any slice waits for this point of the compute stream
        (``reuse_event``); slices are then safe to fill from another stream.
        """
        if self.device.type == "cuda":
            self.reuse_event = torch.cuda.Event()
            self.reuse_event.record(torch.cuda.current_stream(self.device))
        loan.release()

    def stats(self) -> dict:
        out = self.arena.stats()
        out["lending"] = self.lending
        return out
