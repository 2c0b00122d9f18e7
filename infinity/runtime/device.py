"""The compute device: where gathered parameters live and the model computes.

[Note: device abstraction]
Everything device-specific (CUDA streams for copies, events, memory queries)
sits behind ``ComputeDevice`` so the engine reads the same on a GPU and on the
CPU. On CUDA, host<->device copies of shards run on a side stream and the
compute stream waits on an event recorded after them; on the CPU the copies are
plain ``copy_`` calls and the event is a no-op.
"""
from __future__ import annotations

import contextlib
import os

import psutil
import torch

from infinity.config.sections import resolve_device


class _NullEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


def _launched_device() -> int:
    """The current CUDA device, checked against the launcher's ``LOCAL_RANK``: a script that forgot
    ``torch.cuda.set_device(local_rank)`` would put every rank of a node on cuda:0 (NCCL then fails with
    "duplicate GPU", far from the cause). One visible device per process (``CUDA_VISIBLE_DEVICES`` set per
    rank) is fine."""
    current = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit() and int(local) < torch.cuda.device_count() and int(local) != current:
        raise RuntimeError(
            f"infinity: this process is LOCAL_RANK={local} of a launched job and computes on cuda:{current}, the "
            f"current device; each rank of a node needs a GPU of its own: call torch.cuda.set_device({local}) "
            "(or torch.cuda.set_device(int(os.environ['LOCAL_RANK']))) before infinity.Init, or give each "
            "process one device with CUDA_VISIBLE_DEVICES")
    return current


class ComputeDevice:
    """The device the model computes on ("cpu" or a CUDA device).

    Parameters
    ----------
    kind:
        "auto" (``$INFINITY_DEVICE`` when set, else CUDA when available), "cpu" or "cuda".
    """

    def __init__(self, kind: str = "auto") -> None:
        kind = resolve_device(kind)
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("tiers.device = 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
            self.device = torch.device("cuda", _launched_device())
            self._copy_stream = torch.cuda.Stream(self.device)
        elif kind == "cpu":
            self.device = torch.device("cpu")
            self._copy_stream = None
        else:
            raise ValueError(f"tiers.device: {kind!r} is not one of 'auto', 'cpu', 'cuda'")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def copy_stream(self):
        """Context under which shard copies run (the side stream on CUDA)."""
        if self._copy_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._copy_stream)

    def record_copy_done(self):
        """An event marking the copies issued so far on the copy stream."""
        if self._copy_stream is None:
            return _NullEvent()
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        return event

    def wait_for(self, event) -> None:
        """Make the compute stream wait for ``event`` (no host block on CUDA)."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the compute device's memory."""
        if self.is_cuda:
            return torch.cuda.mem_get_info(self.device)
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    def __repr__(self) -> str:
        return f"ComputeDevice({self.device})"
