"""The ranks the model states are sharded over.

A thin face over ``torch.distributed``: when a default process group exists
(torchrun, or tests that spawn gloo ranks) every collective goes through it;
without one, the engine runs as a single rank and the collectives become copies.

[Note: what a collective may be given]
NCCL, the backend of every multi-GPU run, takes tensors on the GPU and refuses host
tensors. Tests and these machines run gloo on the CPU, where any tensor would pass, so a
collective handed host memory would only fail on a GPU. Every collective here therefore
checks what the backend of a real run would take: tensors on the compute device, and
never memory of the tiers' host allocator (pools, host tier, staging: host memory on a
GPU, whatever device torch reports on the CPU). A violation raises ``CollectiveError``
naming the collective, the rank and the tensor, on the CPU as on a GPU, at world size 1
too. And ``src`` ranks are group ranks, translated to the global ranks
``torch.distributed`` expects when the group is not the default one.

[Note: communication volume]
``infinity.stats(model)["comm"]`` is what this rank sent through collectives in the last
complete step: ``all_gather_bytes``, ``reduce_scatter_bytes``, ``all_reduce_bytes`` (and
``broadcast_bytes``, ``calls``). A collective's bytes are those a rank sends in the
bandwidth-optimal ring algorithm, the accounting of the ZeRO paper (Section 7) and of
NCCL's bus bandwidth: an all-gather of shards of s bytes sends s (N-1); a reduce-scatter of
f bytes, f (N-1)/N; an all-reduce of f bytes, 2 f (N-1)/N; a broadcast of f bytes,
f (N-1)/N. One rank sends nothing. So stage 3, which gathers every parameter in forward and
again in backward and reduce-scatters every gradient, moves 3 Psi (N-1)/N elements per rank
and step (plus padding, a tied weight's extra gathers and the step's small all-reduces);
``infinity-plan`` prints the same figures before a run.

[Note: failing together]
A rank that raises before a collective (a damaged engine, a swap file cut under it, a failed
background update) leaves the others waiting in that collective for ever on NCCL. Where such
rank-local checks precede collectives (``opt.step()``, the step's first forward at stage 3,
``infinity.gathered``, state dicts, checkpoint saves and loads, the end of an update during
backward), they run inside ``Ranks.together(what)``: one small all-reduce after them
(``Ranks.failed_ranks``, which checkpoint saves and loads also agree with between their phases)
tells every rank whether any failed, and all raise together, so the recovery an
error advises (``infinity.load_checkpoint`` on every rank) can run. Refusals between the step's
agreement and its exchange (no gradients, stray ``.grad`` tokens) ride on the exchange's own
all-reduce instead (``GradientChecks.exchange(failed=...)``), and a gradient norm's rank-local
part (settling and reading the stored shards; at stages 2-3 closing a backward whose end failed
after its collectives too) on the norm's (``Ranks.reduce_together``): no collective added for the
agreement. A failure between collectives that only some of the ranks would then skip cannot be agreed
on after them: no agreement reaches a rank waiting in one of them. Where it is a gradient's hand-off
(part-way through a backward's reduce-scatters, stage 1's in the step, or the end of a backward that
every rank was cut short in), the failing rank issues the rest and raises at the next agreement
([Note: a hand-off that fails on one rank] in infinity/runtime/grads.py).

[Note: collectives user code calls]
Some engine operations are collectives that a user may well call on one rank only, as with
DDP they could: ``param.grad.norm()`` of an engine gradient (``if rank == 0:
log(w.grad.norm())``) needs every rank's shard. On NCCL the lone rank's all-reduce would
wait for ever or, worse, meet the other ranks' next collective and mix tensors. Before such a
collective each rank checks in through the default group's key-value store
(``Ranks.arrive``): it goes on once every rank has, and a rank left alone for
``arrival_timeout_s`` (the process group's timeout; it warns after ``arrival_warn_s``, 30 s) takes
its arrival back and raises an ``EngineError`` that says to call it on every rank, having issued no
collective.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from infinity.errors import EngineError, add_note
from infinity.runtime.datapath import StepLedger

# torch 2.13 renamed the flat collectives (``all_gather_into_tensor`` and ``reduce_scatter_tensor``
# warn on every call there); earlier releases have only the old names. Looked up at each call, so that
# whatever wraps ``torch.distributed``'s functions (the tests' collective ledger) sees these too.
def _all_gather_flat(full: torch.Tensor, shard: torch.Tensor, group) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, shard, group=group)


def _reduce_scatter_flat(shard: torch.Tensor, full: torch.Tensor, group) -> None:
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(shard, full, group=group)


class RanksFailedError(RuntimeError):
    """Another rank failed where this one would have gone on to a collective (see [Note: failing together])."""


class CollectiveError(RuntimeError):
    """A collective was given a tensor its backend would refuse (an engine bug: the message says which)."""


class CommLedger(StepLedger):
    """Bytes this rank sent through collectives, by kind, per step (see [Note: communication volume])."""

    KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")

    @classmethod
    def _empty(cls) -> dict:
        out: dict = {f"{kind}_bytes": 0 for kind in cls.KINDS}
        out["calls"] = dict.fromkeys(cls.KINDS, 0)
        return out

    def sent(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._current[f"{kind}_bytes"] += int(nbytes)
            self._current["calls"][kind] += 1

    def calls_so_far(self) -> int:
        """The collectives this rank issued in the running step."""
        with self._lock:
            return sum(self._current["calls"].values())


class Ranks:
    """This process's place among the data-parallel ranks.

    Parameters
    ----------
    group:
        A ``torch.distributed`` process group, or None for the default group
        when one is initialized, else a single rank.
    device:
        The compute device: where every tensor given to a collective must be.
    allocator:
        The tiers' host allocator, whose memory no collective may be given (None: not checked).
    """

    def __init__(self, group=None, device: torch.device | str = "cpu", allocator=None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group
        self.device = torch.device(device)
        self.allocator = allocator
        if self.enabled:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = dist.get_backend(group)
            self.global_rank = dist.get_rank()      # in the whole job (names what is per process)
            self._name = "default" if group is None else "-".join(map(str, dist.get_process_group_ranks(group)))
        else:
            self.rank, self.world_size, self.backend, self.global_rank = 0, 1, "none", 0
            self._name = "single"
        self._arrivals: dict[str, int] = {}
        self.arrival_warn_s = 30.0
        self.arrival_timeout_s: float | None = None     # None: the process group's timeout
        self.comm = CommLedger()

    def __repr__(self) -> str:
        return f"Ranks(rank={self.rank}, world_size={self.world_size}, backend={self.backend})"

    def _check(self, what: str, *tensors: torch.Tensor) -> None:
        """See [Note: what a collective may be given]."""
        for t in tensors:
            if t.device.type != self.device.type or (t.device.index or 0) != (self.device.index or 0):
                raise CollectiveError(
                    f"rank {self.rank}: {what} was given a tensor on {t.device} (shape {tuple(t.shape)}); "
                    f"collectives take tensors on the compute device {self.device} (NCCL refuses host "
                    "tensors): an engine bug")
            if self.allocator is not None and self.allocator.owns(t):
                raise CollectiveError(
                    f"rank {self.rank}: {what} was given host memory of the tiers' allocator (shape "
                    f"{tuple(t.shape)}); on a GPU that is a host tensor NCCL refuses: an engine bug")

    def _global(self, rank: int) -> int:
        """``rank`` of this group as the global rank ``torch.distributed`` expects for ``src``."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill ``full`` (world_size x shard numel) with every rank's ``shard``, in rank order.

        ``shard`` may be this rank's slice of ``full`` itself (an in-place all-gather).
        """
        self._check("all_gather", full, shard)
        if self.world_size == 1:
            if shard.data_ptr() != full.data_ptr():
                full.copy_(shard)
            return
        self.comm.sent("all_gather", _nbytes(shard) * (self.world_size - 1))
        _all_gather_flat(full, shard, group=self.group)

    def reduce_scatter_mean(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """``shard`` = this rank's slice of the mean of ``full`` over ranks.

        ``shard`` may be this rank's slice of ``full`` itself (an in-place reduce-scatter).
        """
        self._check("reduce_scatter", shard, full)
        if self.world_size == 1:
            if shard.data_ptr() != full.data_ptr():
                shard.copy_(full)
            return
        self.comm.sent("reduce_scatter", _ring_share(full, self.world_size))
        if full.dtype == torch.float16:
            # Summed first, fp16 gradients near its largest finite value (65504) overflow at a few ranks and
            # skip steps that need no skipping: divided first, the mean stays in range (bf16 has fp32's range).
            full.div_(self.world_size)
            _reduce_scatter_flat(shard, full, group=self.group)
            return
        _reduce_scatter_flat(shard, full, group=self.group)
        shard.div_(self.world_size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._check("all_reduce", tensor)
        if self.world_size > 1:
            self.comm.sent("all_reduce", 2 * _ring_share(tensor, self.world_size))
            dist.all_reduce(tensor, group=self.group)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        self._check("all_reduce", tensor)
        if self.world_size > 1:
            self.comm.sent("all_reduce", 2 * _ring_share(tensor, self.world_size))
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """``tensor`` = rank ``src``'s (a rank of this group)."""
        self._check("broadcast", tensor)
        if self.world_size > 1:
            self.comm.sent("broadcast", _ring_share(tensor, self.world_size))
            dist.broadcast(tensor, src=self._global(src), group=self.group)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def arrive(self, what: str) -> None:
        """Wait until every rank of the group called this for ``what`` as often, before a collective that user
        code may call on one rank only ([Note: collectives user code calls]); raises ``EngineError`` naming
        ``what`` if the others do not come within ``arrival_timeout_s``."""
        if self.world_size == 1:
            return
        store = _default_store()
        if store is None:
            return
        count_of = self._arrivals.get(what, 0)
        key = f"infinity/arrive/{self._name}/{what}/{count_of}"
        count = store.add(key, 1)
        start, pause, warned = time.monotonic(), 0.0005, False
        limit = self.arrival_timeout_s
        if limit is None:       # the process group's own timeout (init_process_group(timeout=...))
            limit = store.timeout.total_seconds() if hasattr(store, "timeout") else 1800.0
        while count < self.world_size:
            waited = time.monotonic() - start
            if waited > limit:
                left = store.compare_set(key, str(count), str(count - 1))   # take back this arrival, unless the
                if int(left) == count - 1:                                  # last one came meanwhile
                    raise EngineError(self._alone(what, waited))
                count = int(left)
                continue
            if waited > self.arrival_warn_s and not warned:
                warnings.warn(self._alone(what, waited) + "; still waiting", RuntimeWarning, stacklevel=3)
                warned = True
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
            count = store.add(key, 0)
        self._arrivals[what] = count_of + 1
        if store.add(key + "/seen", 1) == self.world_size:     # the last to see it: no key is left behind
            store.delete_key(key)
            store.delete_key(key + "/seen")

    def _alone(self, what: str, waited: float) -> str:
        return (f"rank {self.rank}: {what} is a collective over the {self.world_size} ranks (each holds a shard of "
                f"every gradient), and rank {self.rank} waited {waited:.0f} s for the other ranks to call it: call "
                "it on every rank (take the value on all of them, print it on one), as torch.distributed's "
                "collectives are called")

    @contextlib.contextmanager
    def together(self, what: str):
        """Run the block's rank-local checks, then agree (one all-reduce): if the block raised on any rank,
        every rank raises, that one its own error and the others ``RanksFailedError`` naming it; none goes on
        alone to a collective the failed one never joins ([Note: failing together])."""
        error = None
        try:
            yield
        except BaseException as exc:
            error = exc
        self._raise_agreed(error, lambda: self.failed_ranks(error is not None), what)

    def reduce_together(self, what: str, local: Callable[[], torch.Tensor], numel: int,
                        op: str = "sum") -> torch.Tensor:
        """``local()`` (rank-local work, a float64 vector of ``numel``), summed (``op="max"``: the maximum) over
        the ranks in one all-reduce that also carries each rank's failure flag: if ``local()`` raised on any
        rank, every rank raises as with ``together``, with no collective of its own ([Note: failing
        together])."""
        error, values = None, None
        try:
            values = local()
        except BaseException as exc:
            error = exc
        if values is None:
            values = torch.zeros(numel, dtype=torch.float64)
        flags = torch.zeros(self.world_size, dtype=torch.float64, device=self.device)
        flags[self.rank] = 1.0 if error is not None else 0.0
        # Values on the device stay there: no host wait before the all-reduce (one after it, reading the flags).
        both = torch.cat([values.reshape(-1).to(self.device, torch.float64), flags])

        def reduce() -> list[int]:
            (self.all_reduce_max if op == "max" else self.all_reduce_sum)(both)
            return [r for r, f in enumerate(both[numel:].tolist()) if f > 0]

        self._raise_agreed(error, reduce, what)
        return both[:numel].cpu()

    def _raise_agreed(self, error: BaseException | None, agree: Callable[[], list[int]], what: str) -> None:
        """Raise as ``together`` says, after ``agree()`` told which ranks failed."""
        try:
            failed = agree()
        except BaseException as exc:
            if error is None:
                raise
            add_note(error, f"rank {self.rank}: then telling the other ranks failed too: {exc!r}")
            raise error from None
        if error is not None:
            raise error
        if failed:
            raise RanksFailedError(f"rank {self.rank}: rank(s) {failed} failed in {what} (see the error raised "
                                   "there); every rank stops here, as that one did")

    def failed_ranks(self, failed: bool) -> list[int]:
        """The ranks that say ``failed`` (one all-reduce: every rank calls it, whatever it says)."""
        if self.world_size == 1:
            return [0] if failed else []
        flags = torch.zeros(self.world_size, dtype=torch.float32, device=self.device)
        flags[self.rank] = 1.0 if failed else 0.0
        self.all_reduce_sum(flags)
        return [r for r, f in enumerate(flags.tolist()) if f > 0]


def _default_store():
    """The default group's key-value store (torch has no public accessor), or None."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _ring_share(tensor: torch.Tensor, world_size: int) -> int:
    """(N-1)/N of ``tensor``'s bytes: what one rank sends of it in a ring (see [Note: communication volume])."""
    return _nbytes(tensor) * (world_size - 1) // world_size
