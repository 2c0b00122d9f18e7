"""Checkpointed activations moved off the compute device between forward and backward (ZeRO-R).

[Note: which saved tensors move]
An activation checkpoint (``torch.utils.checkpoint``, ``infinity.activation_checkpoint``) saves only
its region's inputs for backward; everything inside is recomputed. Those inputs are what
``activations.offload`` moves. While a model's forward runs with grad enabled, the engine
keeps ``saved_tensors_hooks`` pushed (innermost hooks win, and a non-reentrant checkpoint
pushes its own inside its region, so ours see only what is saved outside regions). Every
tensor saved there is packed into a ``SavedActivation`` that at first just holds it. The
checkpoint saves its inputs immediately before it calls the region; so when a module's
forward starts and the tensors packed since the previous module event are exactly among
its arguments, they are a checkpoint's inputs, and move to the tier then. A reentrant
checkpoint saves its inputs after its region ran without grad: a module whose forward
starts with grad disabled inside a grad-enabled forward names its arguments as expected,
and they move as soon as they are packed. Tensors smaller than ``activations.min_nbytes``,
and parameters (the engine's, in their own tiers), are never packed.

Anything else saved outside checkpoints stays where it is (it passes through the hook,
a Python call per saved tensor, only while ``offload`` is not "none"). A tensor matched by
coincidence (an op saves exactly what the next module takes) moves too: the result is the
same, only the traffic is spent.

[Note: activation prefetch]
Backward needs the inputs in the reverse order of the forward that saved them. When
backward starts, the tensors moved in that forward are fetched in reverse order of
packing, within ``activations.prefetch_bytes`` (at least one tensor); each one used makes
room for the next. A tensor asked for before its fetch was issued is fetched on demand
(``demand_fetches``); the time ``unpack`` waits is the stall it caused. With
``prefetch_bytes = 0`` nothing is fetched ahead: each tensor comes back when backward asks
for it, so no fetched tensor waits beside the recompute of the region before it (the peak of
a checkpointed backward: docs/benchmarks/activations.md), at the cost of a stall per tensor.

What the room may touch: the tensors autograd hands it, the data path, the host
allocator and the NVMe tier (through ``ActivationTier``).
"""
from __future__ import annotations

import collections
import time
import weakref

import torch
from torch import nn

from infinity.errors import EngineError
from infinity.runtime.activation_tier import ActivationTier


class SavedActivation:
    """One saved tensor: held as is, or moved to the tier (``place``) and fetched back (``pending``).

    It holds the tensor detached: the tensor itself would reference, through its ``grad_fn``,
    the graph that holds this object, a cycle through C++ that Python's collector cannot see,
    and the whole graph would outlive its last use. Autograd puts the autograd metadata back
    on what ``unpack`` returns.
    """

    __slots__ = ("tensor", "source_id", "place", "shape", "dtype", "nbytes", "pending", "consumed",
                 "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor.detach()
        self.source_id = id(tensor)
        self.place = None
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.nbytes = tensor.numel() * tensor.element_size()
        self.pending = None
        self.consumed = False


class ActivationStats:
    """Counters of the moved activations: since the start, and the last forward/backward cycle."""

    FIELDS = ("offloaded_bytes", "offloaded_tensors", "fetched_bytes", "prefetched", "demand_fetches",
              "stall_seconds", "pack_wait_seconds")

    def __init__(self) -> None:
        self.total = dict.fromkeys(self.FIELDS, 0)
        self.current = dict.fromkeys(self.FIELDS, 0)
        self.last: dict | None = None

    def add(self, name: str, amount) -> None:
        self.total[name] += amount
        self.current[name] += amount

    def close_cycle(self) -> None:
        self.last, self.current = self.current, dict.fromkeys(self.FIELDS, 0)


class ActivationOffload:
    """Moves checkpointed activations to ``activations.offload`` and back (see [Note: which saved
    tensors move] and [Note: activation prefetch]).

    Parameters
    ----------
    config:
        The ``[activations]`` section.
    datapath:
        Moves and books every byte (``infinity.runtime.datapath.DataPath``).
    tiers:
        The rank's ``TierSet`` (its host allocator; its NVMe tier for "nvme").
    device:
        The compute device (``torch.device``).
    """

    def __init__(self, config, datapath, tiers, device: torch.device) -> None:
        self.config = config
        self.tier = ActivationTier(config, datapath, tiers, device)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._pushed = False
        self._recent: list[SavedActivation] = []
        self._expected: list[torch.Tensor] = []
        self._expected_depth = 0
        self._moved: list[weakref.ref] = []
        self._queue: collections.deque = collections.deque()
        self._ahead_bytes = 0
        self._forward_bytes = 0
        self.stats_ = ActivationStats()

    # -- forward -------------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """A grad-enabled forward of the model starts: catch what it saves."""
        if not self._pushed:
            self._moved = [ref for ref in self._moved if ref() is not None]
            self._forward_bytes = 0
            self._hooks.__enter__()
            self._pushed = True

    def end_forward(self) -> None:
        if self._pushed:
            self._hooks.__exit__(None, None, None)
            self._pushed = False
        self._recent = []
        self._expected = []

    def module_called(self, module: nn.Module, args, depth: int) -> None:
        """A module's forward starts with ``args``, ``depth`` modules deep: move the tensors just packed
        for a checkpoint of it."""
        if not self._pushed:
            return
        recent, self._recent = self._recent, []
        if not torch.is_grad_enabled():
            # A reentrant checkpoint's region (or the user's no_grad block): its inputs are packed after
            # it ran. The outermost module of the region names them; the modules inside it do not.
            if not self._expected or depth <= self._expected_depth:
                self._expected = [a for a in args if isinstance(a, torch.Tensor)]
                self._expected_depth = depth
            return
        self._expected = []
        if recent:
            ids = {id(a) for a in args if isinstance(a, torch.Tensor)}
            if all(saved.source_id in ids for saved in recent):
                for saved in recent:
                    self._move(saved)

    def pack(self, tensor: torch.Tensor):
        if (isinstance(tensor, nn.Parameter) or (tensor.is_leaf and tensor.requires_grad)
                or tensor.layout is not torch.strided or tensor.device != self.tier.device
                or tensor.numel() * tensor.element_size() < self.config.min_nbytes):
            return tensor
        saved = SavedActivation(tensor)
        if any(tensor is t for t in self._expected):
            self._expected = [t for t in self._expected if t is not tensor]
            self._move(saved)
        else:
            self._recent.append(saved)
        return saved

    def _move(self, saved: SavedActivation) -> None:
        tensor, saved.tensor = saved.tensor, None
        saved.place, waited = self.tier.put(tensor)
        self.stats_.add("pack_wait_seconds", waited)
        self.stats_.add("stall_seconds", waited)
        self.stats_.add("offloaded_bytes", saved.nbytes)
        self.stats_.add("offloaded_tensors", 1)
        self._forward_bytes += saved.nbytes
        self._moved.append(weakref.ref(saved))
        weakref.finalize(saved, self.tier.discard, saved.place)

    # -- backward ------------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        """Backward starts: fetch the moved tensors in reverse order, within ``prefetch_bytes``."""
        live = [ref() for ref in reversed(self._moved)]
        self._queue = collections.deque(s for s in live if s is not None and not s.consumed and s.pending is None)
        self._top_up()

    def _top_up(self) -> None:
        if not self.config.prefetch_bytes:
            return      # fetched on demand only
        while self._queue:
            saved = self._queue[0]
            if saved.consumed or saved.pending is not None:
                self._queue.popleft()
                continue
            if self._ahead_bytes and self._ahead_bytes + saved.nbytes > self.config.prefetch_bytes:
                return
            self._queue.popleft()
            try:
                self._fetch(saved)
            except EngineError:
                # Its write failed: said when backward uses it (``unpack`` fetches it again), not here. It
                # may belong to a graph no backward will read (a step that failed, kept alive by its error).
                continue
            self.stats_.add("prefetched", 1)

    def _fetch(self, saved: SavedActivation) -> None:
        saved.pending = self.tier.fetch(saved.place, saved.nbytes)
        self._ahead_bytes += saved.nbytes

    def unpack(self, saved):
        if not isinstance(saved, SavedActivation):
            return saved
        if saved.tensor is not None:
            return saved.tensor
        if saved.consumed:
            raise EngineError("an activation that infinity offloaded (activations.offload = "
                              f"{self.config.offload!r}) was used a second time in backward; it is given back "
                              "after its first use, so backward(retain_graph=True) over checkpointed regions "
                              "needs activations.offload = \"none\"")
        if saved.pending is None:
            self.stats_.add("demand_fetches", 1)
            self._fetch(saved)
        started = time.perf_counter()
        flat = self.tier.wait(saved.pending)
        self.stats_.add("stall_seconds", time.perf_counter() - started)
        self.stats_.add("fetched_bytes", saved.nbytes)
        self._ahead_bytes -= saved.nbytes
        place, saved.place, saved.pending = saved.place, None, None
        saved.consumed = True
        self.tier.discard(place)
        self._top_up()
        return flat[:saved.nbytes].view(saved.dtype).view(saved.shape)

    def end_backward(self) -> None:
        """Backward ended: fetches nobody used are waited for and given back; the cycle's counts close."""
        self._queue.clear()
        for ref in self._moved:
            saved = ref()
            if saved is not None and saved.pending is not None:
                try:
                    self.tier.wait(saved.pending)
                except Exception:   # a fetch ahead nobody used: its failure is no error of this backward's
                    pass
                saved.pending = None
                self._ahead_bytes -= saved.nbytes
        self._moved = [ref for ref in self._moved if ref() is not None and not ref().consumed]
        if self.tier.kind == "nvme":
            self.tier.drain()   # the reads are done, so only the frees of used keys are left: quick
        self.stats_.current["checkpoint_nbytes"] = self._forward_bytes
        self.stats_.close_cycle()

    # -- telemetry, teardown ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Bytes moved and the stall they caused (see infinity.stats, "activations")."""
        last = self.stats_.last or {}
        out = {"offload": self.config.offload, "checkpoint_nbytes": last.get("checkpoint_nbytes", 0),
               "last": {k: v for k, v in last.items() if k != "checkpoint_nbytes"} or None,
               "total": dict(self.stats_.total), "ahead_bytes": self._ahead_bytes}
        out.update(self.tier.stats())
        return out

    def close(self) -> None:
        self.end_forward()
        self.tier.close()
