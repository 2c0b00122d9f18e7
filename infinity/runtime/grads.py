"""Gradients: collected per group as autograd produces them, reduce-scattered, sent to the optimizer's space.

[Note: gradient flow]
When autograd has the whole gradient of a parameter (all its uses summed), it is
copied into its group's flat bucket on the compute device, in the compute dtype, and
``param.grad`` is dropped. When the last gradient-requiring parameter of a group has
arrived, the bucket is reduce-scattered (averaged over ranks, in place) and this
rank's shard leaves the device: downloaded, still in the compute dtype, into host
memory of the tiers' allocator (pinned on a GPU) on the data path's device->host
stream, where the host adds it into the fp32 accumulator of the optimizer's flat
space. When the states live on the compute device (the device tier) the shard is
added there and nothing moves. Each shard's squared L2 norm (for clipping and the
non-finite check) is added up on the device, so backward never waits for the device;
the host reads it once, in ``opt.step()``. The gathered parameters of the group are
released at once, since autograd will not touch them again in this backward.

On a GPU the host-side addition waits for its download: shards downloaded during
backward are added once their copies are done, checked without blocking at each
later group and all of them, waiting if need be, when the step (or anything else that
reads the gradients) asks (``settle``). On the CPU a download is done at once.

Groups whose parameters received no gradient in a pass (unused branches) are flushed
by a callback queued at the end of backward, so the collectives are issued in the
same order on every rank.

[Note: ZeRO stages 1 and 2]
Stage 3 is the flow above. Stage 2 keeps whole parameters on every rank: each group is
persistent, gathered once after an update and kept through forward and backward, so a
step all-gathers every parameter once, and its gradients flow as above, reduce-scattered
bucket by bucket as backward produces them: 2 Psi (N-1)/N sent per rank and step.
Stage 1 partitions only the optimizer states: each rank adds its whole gradients up in a
per-group buffer on the compute device (``whole``: the group's padded flat, compute dtype,
made once) over however many micro-batches, and they are reduce-scattered to their owners
once per step, when the step (or a clip, or ``zero_grad``) first asks for the gradients
(``reduce_whole``); with one rank there is nothing to reduce and stage 1 flows as stage 2.
"""
from __future__ import annotations

import collections
import traceback

import torch
from torch import nn

from infinity.errors import EngineError, add_note
from infinity.param_group import ParamGroup, ParamState
from infinity.runtime.reduce_buckets import ReduceBuckets
from tiers.arena import Arena


_NORM_CHUNK = 1 << 20      # fp32 elements widened at a time for a CPU shard's norm (GradReducer._add_norm)


# [Note: handed over in order]
# A group's gradients are handed over (bucketed, reduce-scattered) when the last of its parameters' gradients
# arrives, or at the end of the backward for a group some of whose parameters got none
# (``GradArrivals.flush``). NCCL pairs collectives by order alone, so a parameter used on some ranks only (a
# branch on the rank's data, an expert that got no tokens) would move its group's reduce-scatter to another
# place in that rank's sequence: the ranks hang, or reduce two same-sized groups into each other without an
# error (no collective ledger sees it: same op, dtype and count).
# So at stages 1 and 2 on several ranks, as torch DDP with ``find_unused_parameters`` does, every backward
# hands over every trainable group on every rank, in one order: reversed group order (the order a backward
# completes them in a model built in the order it runs). A group complete before its turn waits for the
# groups ahead of it (its gradients stay where autograd put them, as without the engine); the end of the
# backward hands over the rest, a parameter without a gradient as zeros and a group no forward used on this
# rank as all zeros. The step's one all-reduce then says which parameters had a gradient on some rank, and
# those are updated, with the mean over all ranks (zeros from the ranks without one), as DDP gives; a
# parameter with a gradient on no rank is left alone, as torch's optimizers leave a None ``.grad``. Stage 1
# reduces only at the step, in group order, so only ``every`` matters there.
# At stage 3 the backward's all-gathers run between the reduce-scatters, so a group waiting its turn there
# would move relative to them (and hold gathered parameters the next gather needs): see [Note: handed over at
# the call's end]. What that leaves (a group several calls use, a call whose backward's end is not watched)
# is detected: the book keeps, per group, where among this rank's collectives it was handed over, counted from
# its backward's first hand-over (what a rank ran before alone, an evaluation after a step, shifts nothing);
# the step's one all-reduce (``GradientChecks.exchange``) carries them with their negation, and when the
# largest and the smallest differ anywhere every rank refuses the step alike, naming the group and the
# parameters with a gradient on some ranks only, before anything is updated. A rank whose collectives no
# longer pair up may wait in one before the step.

# [Note: handed over at the call's end]
# At stage 3 on several ranks, a group that one call used in the forward (its module, outermost: submodules
# of a unit share its group) is handed over when that call's backward is over, as FSDP2's post-backward does:
# when the gradient of every argument of the call is complete ([Note: a module's backward is over] in
# infinity/runtime/backward_holds.py), complete or not, a parameter without a gradient as zeros. That point
# is the same on every rank that ran the call, whichever of its parameters each used: its all-gathers and
# reduce-scatters pair up. Complete early, a group waits there a few nodes (its last weight's gradient comes
# in the node that makes the call's input gradient). Every other group is handed over at the end of the
# backward, in group order, with zeros where nothing arrived: a group several calls use (a module called
# twice, a tied weight another module reads), or whose call is not watched (an argument that is a leaf, or
# none that needs a gradient: the embedding, last in the backward anyway), or whose call's backward never
# came (an output the loss does not use). Calls inside the backward count only for groups no forward used: a
# reentrant checkpoint's recomputation (its forward ran without gradients; its backward runs) hands over at
# its call's end too, a non-reentrant one's recomputation (no backward runs through it) is not counted. Left
# out: a group first used inside the backward by several calls is handed over when complete, as before.
class GradientBook:
    """What arrived since ``zero_grad``, kept on the compute device: no host wait to update it.

    ``arrived[1 + k]`` is 1.0 once the gradient of the k-th parameter (in group and slot order) arrived on this
    rank (torch's ``.grad is not None``; see [Note: parameters without a gradient] in infinity/optim/ranges.py);
    ``arrived[0]`` is left for the non-finite flag of the step's single all-reduce. ``norm_sq`` is the running
    sum of the shards' squared norms (fp32 dot products of at most 1Mi elements on the CPU), in float64;
    ``exact`` turns False when a group received gradients twice (accumulation): only the stored sum knows it.
    """

    def __init__(self, nparams: int, device: torch.device) -> None:
        self.arrived = torch.zeros(1 + nparams, dtype=torch.float32, device=device)
        self.norm_sq = torch.zeros((), dtype=torch.float64, device=device)
        self.exact = True
        # Per group index: where among this rank's collectives its gradients were handed over (1 + those since its
        # backward's first hand-over, ``base``, summed over the step's backwards); [Note: handed over in order].
        self.handed_at: dict[int, int] = {}
        self.base: int | None = None

    def reset(self) -> None:
        self.arrived.zero_()
        self.norm_sq.zero_()
        self.exact = True
        self.handed_at.clear()
        self.base = None

    def flags(self, positions: torch.Tensor) -> torch.Tensor:
        """The non-finite flag, then whether each parameter at ``positions`` had a gradient (device)."""
        out = self.arrived[positions]
        out[0] = (~torch.isfinite(self.norm_sq)).float()
        return out


def _wait_quietly(datapath, events) -> None:
    """Wait for downloads on an error path, ignoring theirs: the error already on its way is the one that counts."""
    for done in events:
        try:
            if not done.query():
                datapath.host_wait(done)
        except Exception:  # noqa: BLE001
            pass


class _Landed:
    """Tier writes as an event: done when all are (the host buffer they read may then be reused). Waiting for it
    waits for I/O, not for the device: the data path does not count it."""

    __slots__ = ("futures",)
    on_device = False

    def __init__(self, futures) -> None:
        self.futures = futures

    def query(self) -> bool:
        return all(f.done() for f in self.futures)

    def synchronize(self) -> None:
        for f in self.futures:
            f.wait()


class _Kept:
    """Device memory that stays with its owner (stage 1's whole gradient): nothing to give back."""

    def release(self) -> None:
        pass


# [Note: a hand-off that fails on one rank]
# Handing a shard over to the optimizer is this rank's alone and may fail (the accumulator's key widened on a full
# disk, an NVMe write, host memory). Raised there, on several ranks, it leaves the others in the collectives this
# rank then skips: the rest of the backward's reduce-scatters (at stage 3 its all-gathers too), the rest of stage
# 1's in the step, or the end of a backward cut short that every rank closes: on NCCL they wait for ever, or pair
# the collective with another one. So on several ranks the reducer keeps the first failure (an ``Exception``:
# Ctrl-C still raises at once) as ``lost``, its traceback as text (its frames would hold the backward's tensors),
# and goes on: while ``faulted``, each later group is still reduce-scattered in its place and nothing more of the
# step is sent (its gradients are not whole here anyway), and ``settle()``, which whatever reads the gradients
# calls, raises after its own collectives (stage 1's). The step, a gradient norm and ``clip_grad_norm_`` call it
# inside their agreement: this rank raises, the others ``RanksFailedError`` ([Note: failing together] in
# infinity/runtime/ranks.py); ``clamp_`` edits nothing. ``zero_grad()`` drops it and the step is redone (with the
# update during backward, sub-groups stepped before it leave the states damaged: load a checkpoint). One rank
# raises at once. Left: a failure before a group's own reduce-scatter (its bucket's memory) raises in that
# rank's backward, as any error there does.
class GradReducer:
    """Turns per-parameter gradients into accumulated fp32 gradient shards.

    Parameters
    ----------
    coordinator:
        Owner of the groups (infinity.runtime.coordinator.Coordinator).
    ranks:
        The data-parallel ranks.
    datapath:
        Moves the shards to the host and books them (``infinity.runtime.datapath.DataPath``).
    allocator:
        Host memory for the downloaded shards (``tiers.HostAllocator``).
    stage, bucket_nbytes:
        ``partition.stage``; ``partition.reduce_bucket_bytes`` ([Note: gradient buckets] in reduce_buckets.py).

    The optimizer state store, which accumulates the shards, is attached once it exists.
    """

    def __init__(self, coordinator, ranks, datapath, allocator, stage: int = 3, bucket_nbytes: int = 0) -> None:
        self.coordinator = coordinator
        # Stage 1 on several ranks: whole gradients wait on the device for one reduce-scatter per step.
        self.defer = stage == 1 and ranks.world_size > 1
        self._whole: dict[ParamGroup, torch.Tensor] = {}
        self._waiting: list[ParamGroup] = []     # groups with a whole gradient not reduced yet
        self._read_until: dict[ParamGroup, object] = {}     # whole gradient -> its download's event
        self.ranks = ranks
        self.datapath = datapath
        self.store = None
        self.device = coordinator.device.device
        self.device_buckets = ReduceBuckets(self.device, datapath, bucket_nbytes)
        self.allocator = allocator
        self.host_buckets: Arena | None = None
        self._bucket_nbytes = self._host_nbytes = 0     # what the buckets hold at most (``_size_buckets``)
        self._stale: list[tuple[ParamGroup, list]] = []     # taken; .grad and the group let go next
        self._carried: dict[ParamGroup, list] = {}    # reopened: parameters whose token the next take restores
        self._packed: dict[ParamGroup, list[int] | None] = {}   # group -> its slots' sizes, when packed from 0
        self._group_positions: dict[ParamGroup, torch.Tensor] = {}
        # (group index, positions of the parameters that had a gradient) -> those positions on the device.
        self._partial_positions: dict[tuple, torch.Tensor] = {}
        self._position: dict[nn.Parameter, int] = {}
        self._sent: list[tuple] = []      # (group index, host loan, event, numel, dtype) waiting to be added
        self._sent_groups: collections.Counter[int] = collections.Counter()     # group index -> entries in _sent
        self._norm_scratch: torch.Tensor | None = None     # _add_norm's fp32 piece of a 2-byte CPU shard
        self.book: GradientBook | None = None
        # Sets the ``.grad`` of parameters whose gradient is in the store (``GradFace.mark``), or None.
        self.mark_grads = None
        # Told ``taken(group index, every parameter had a gradient)`` and ``landed(group index)`` (the
        # shard is in the store): the update during backward (infinity/optim/in_backward.py), or None.
        self.watcher = None
        # A hand-off failed in this step (an I/O error, the disk full, Ctrl-C): part of its gradients may be in
        # the store; ``opt.step()`` refuses until ``zero_grad()`` (``settle(drop=True)``) clears them. ``lost``:
        # on several ranks, the failure kept for their next agreement ([Note: a hand-off that fails on one rank]).
        self.faulted, self.lost = False, None

    def attach(self, store) -> None:
        """The groups are final and ``store`` accumulates their gradients from now on."""
        self.store = store
        self._packed.clear()
        self._partial_positions.clear()
        self._position.clear()      # attached again to a new store (infinity/optim/relayout.py): the same positions
        for g in self.coordinator.groups:
            end = 0
            for slot in g.slots:
                self._position[slot.param] = 1 + len(self._position)
                end = end + slot.numel if slot.offset == end else -1
            self._packed[g] = [s.numel for s in g.slots] if end >= 0 else None
            self._group_positions[g] = torch.tensor([self._position[s.param] for s in g.slots],
                                                    dtype=torch.long, device=self.device)
        self.book = store.book = GradientBook(len(self._position), self.device)
        store.land_grads = self.land_direct
        trainable = [g for g in self.coordinator.groups if g.has_trainable]
        biggest = max(trainable, key=lambda g: g.full_nbytes, default=None)
        self._size_buckets(biggest.full_nbytes if biggest else 0, biggest.name if biggest else None,
                           max((g.shard_nbytes for g in trainable), default=0))

    def _size_buckets(self, full_nbytes: int, name: str | None, shard_nbytes: int) -> None:
        """Buckets for gradients of groups up to ``full_nbytes`` (the largest: ``name``) on the device and
        shards up to ``shard_nbytes`` on the host: two of the largest shard (infinity-plan's "grad_staging"
        row), made at first use."""
        self.device_buckets.size_for(full_nbytes, name)
        self._bucket_nbytes = full_nbytes
        host_nbytes = max(4096, -(-shard_nbytes // 4096) * 4096)
        if self.host_buckets is None or host_nbytes > self._host_nbytes:
            self.host_buckets = Arena(self.allocator.empty, 2 * host_nbytes, name="gradient-host")
        self._host_nbytes = max(self._host_nbytes, host_nbytes)

    def _grow_buckets(self, group: ParamGroup) -> None:
        """``group`` has gradients and is larger than every group trainable when the buckets were sized (its
        parameters were frozen then: requires_grad may change at any time, as in torch): size them for it.
        Buckets still lent keep the old buffers alive until they come back."""
        self._size_buckets(max(self._bucket_nbytes, group.full_nbytes), group.name,
                           max(self._host_nbytes, group.shard_nbytes))

    @property
    def whole_nbytes(self) -> int:
        """Device bytes of stage 1's whole-gradient buffers (0 at other stages)."""
        return sum(t.numel() * t.element_size() for t in self._whole.values())

    def positions(self, params) -> torch.Tensor:
        """Where ``params``' arrival flags are in ``book.arrived``, after the flag slot 0 (a device index)."""
        return torch.tensor([0] + [self._position[p] for p in params], dtype=torch.long, device=self.device)

    # -- arriving gradients ------------------------------------------------------------------------
    def take(self, group: ParamGroup, params: list[nn.Parameter], grads) -> None:
        """Every parameter of ``group`` that takes part in this backward has its whole gradient in
        ``grads`` (None for the others): bucket them, reduce-scatter, send the shard on its way.

        Called once per group (see [Note: one gradient hook per group] in infinity/runtime/hooks.py),
        just before autograd stores the last of these gradients in ``.grad``: the group's memory
        is released at once, but its parameters keep their shapes, and their ``.grad`` are dropped,
        at the next group or at the end of the backward, once autograd is done with them.
        """
        self._let_go()
        if self.ranks.world_size > 1:       # [Note: handed over in order]
            book, calls = self.book, self.ranks.comm.calls_so_far()
            book.base = calls if book.base is None else book.base
            book.handed_at[group.index] = book.handed_at.get(group.index, 0) + 1 + calls - book.base
        if group.full_nbytes > self._bucket_nbytes or group.shard_nbytes > self._host_nbytes:
            self._grow_buckets(group)
        arrived = sum(grad is not None for grad in grads)
        if self.watcher is not None:    # may refuse the gradient: before anything is taken for it
            self.watcher.taken(group.index, arrived == len(params))     # every trainable one (frozen: not among them)
        flat = self._accumulator(group)
        loan = None
        first_whole = self.defer and group not in self._waiting
        if first_whole:
            flat = self._whole.get(group)
            if flat is None:
                flat = self._whole[group] = torch.empty(group.padded_numel, dtype=group.dtype, device=self.device)
            done = self._read_until.pop(group, None)
            if done is not None:
                self.datapath.use(done)     # the last step's download of it came first (on the device)
        if flat is None:
            loan = self.device_buckets.take(group.full_nbytes, f"gradients {group.name}")
            flat = loan.tensor.view(group.dtype)[:group.padded_numel]
        sizes = self._packed.get(group)
        if sizes is not None and arrived == len(group.slots):
            # Every slot, packed from 0 in order, has its gradient: one call (one multi-tensor
            # kernel on a GPU where the dtypes agree), not a copy per parameter.
            torch._foreach_copy_(flat[:group.numel].split(sizes), [grad.reshape(-1) for grad in grads])
        else:
            # Every slot is written: a gradient, or zeros for a parameter without one in this backward, or
            # frozen (requires_grad False, so not among ``params``). The memory is reused: a slot left
            # alone would hand the last group's values to the norm, the non-finite check and the update.
            given = {id(param): grad for param, grad in zip(params, grads)}
            for slot in group.slots:
                grad = given.get(id(slot.param))
                part = flat[slot.offset:slot.offset + slot.numel]
                part.zero_() if grad is None else part.copy_(grad.reshape(-1))   # converts into an fp32 accumulator
        flat[group.slots[-1].offset + group.slots[-1].numel:].zero_()   # padding: reused memory, zero as at partitioning
        if arrived == len(group.slots):
            self.book.arrived.index_fill_(0, self._group_positions[group], 1.0)
        elif arrived:   # only the parameters with a gradient (a frozen one has none): one fill per pattern met
            present = tuple(self._position[param] for param, grad in zip(params, grads) if grad is not None)
            positions = self._partial_positions.get((group.index, present))
            if positions is None:
                positions = torch.tensor(present, dtype=torch.long, device=self.device)
                self._partial_positions[(group.index, present)] = positions
            self.book.arrived.index_fill_(0, positions, 1.0)
        if first_whole:
            self._waiting.append(group)         # reduced once per step (reduce_whole)
        elif self.defer:
            self._whole[group].add_(flat)       # a later micro-batch adds into the whole gradient
            loan.release()      # its next user fills it on the compute stream, after this addition
        elif loan is None:
            self.book.norm_sq += torch.dot(flat, flat)      # written in place: nothing to reduce or send
        else:
            self._reduce(group, flat, loan)
        if len(params) == len(group.slots):
            self.coordinator.backward_done(group, keep_views=True)
        # else frozen parameters share the group (frozen after Init: [Note: frozen inside a group] in
        # infinity/runtime/construction.py); autograd may still read them for an input's gradient (a frozen
        # norm before trained projections), so the group stays held until the backward ends.
        arrived = [p for p, grad in zip(params, grads) if grad is not None]
        carried = self._carried.pop(group, ())
        self._stale.append((group, params, arrived + [p for p in carried if all(p is not q for q in arrived)]))

    def _accumulator(self, group: ParamGroup) -> torch.Tensor | None:
        """The optimizer's fp32 accumulator for ``group``, when autograd's gradients can be copied
        straight into it instead of a bucket: one rank (nothing to reduce), states on the compute
        device, the group in one piece of one sub-group, first gradient since ``zero_grad``."""
        store = self.store
        if self.ranks.world_size != 1 or _states_tier(store, group).kind != "device":
            return None
        pieces = store.layout.pieces_of_group[group.index]
        if len(pieces) != 1 or pieces[0].numel != group.padded_numel:
            return None
        views = store.first_grad_views(group.index)
        return None if views is None else views[0][2]

    def reopen(self, group: ParamGroup) -> None:
        """``group`` is armed again in the backward that took its gradients: a module called again inside
        it (the nested backward of a reentrant checkpoint, ``use_reentrant=True``, through a module called
        twice) stores a second gradient for the same parameters. Autograd would add it onto the ``.grad``
        just taken (counted twice) or onto its token (refused), so the ``.grad`` become None again and
        the second take adds what is new to the store, as a second micro-batch does; the parameters that
        had a gradient get their token back at that take."""
        carried = self._carried.setdefault(group, [])
        kept = []
        for entry in self._stale:
            if entry[0] is group:
                carried += entry[2]
            else:
                kept.append(entry)
        self._stale = kept
        for slot in group.slots:
            param = slot.param
            if param.grad is not None:
                if all(p is not param for p in carried):
                    carried.append(param)       # let go already: its token stands for the first gradient
                param.grad = None

    def _let_go(self) -> None:
        """Drop the ``.grad`` autograd stored for groups already taken (a token of the stored gradient
        takes its place: see [Note: gradient tokens] in infinity/optim/grad_face.py), and their shapes."""
        stale, self._stale = self._stale, []
        for group, params, arrived in stale:
            for param in params:
                param.grad = None
            if self.mark_grads is not None:
                self.mark_grads(arrived)
            if group.state is ParamState.NOT_AVAILABLE:
                group.drop_views()

    def _reduce(self, group: ParamGroup, flat: torch.Tensor, memory) -> None:
        shard = group.shard_of(flat)
        self.ranks.reduce_scatter_mean(shard, flat)
        if self.faulted:        # in its place among the collectives; nothing more is sent
            self._release_after(memory, None)
            return
        if group.index in self.store.grad_written or self._sent_groups[group.index]:
            self.book.exact = False     # a second micro-batch: the norm of the sum is not the sum of norms
        self._send(group, shard, memory)

    def _add_norm(self, shard: torch.Tensor) -> None:
        """Add the shard's squared norm (for clipping) to the book; it is also the non-finite check:
        inf or nan exactly when some element is (barring an overflow past 3e38, which is no gradient
        to apply either). It stays on the device.

        fp32 dot products, summed in float64. A 2-byte shard on the CPU is widened 1Mi elements at a
        time into a reused buffer: ``shard.float()`` of a 135M-element shard is a fresh 540 MB tensor,
        page-faulted on every step (0.8 s against 0.12), and one fp32 dot over that many elements was
        0.4% off (MKL's sdot: 134.52e6 for 135.04e6 in chunks)."""
        if shard.dtype == torch.float32 or shard.device.type != "cpu" or shard.numel() <= _NORM_CHUNK:
            self.book.norm_sq += torch.dot(shard.float(), shard.float())
            return
        if self._norm_scratch is None:
            self._norm_scratch = torch.empty(_NORM_CHUNK, dtype=torch.float32)
        for lo in range(0, shard.numel(), _NORM_CHUNK):
            piece = self._norm_scratch[:min(_NORM_CHUNK, shard.numel() - lo)].copy_(shard[lo:lo + _NORM_CHUNK])
            self.book.norm_sq += torch.dot(piece, piece)

    def _send(self, group: ParamGroup, shard: torch.Tensor, device_memory):
        """The shard to the optimizer's accumulator: in place on the device, or downloaded to the host.

        Its squared norm is added to the book first. Returns the download's event (None when nothing left
        the device): ``shard``'s memory is read until then. A failure on the way (the disk full while gradient
        keys widen, an I/O error) gives the bucket back once the data path has no copy reading it."""
        store = self.store
        handed, issued, host, done = False, [], None, None
        try:
            self._add_norm(shard)
            if _states_tier(store, group).kind == "device":
                store.accumulate_grad(group.index, shard)
                handed = True
                device_memory.release()     # the addition may still be queued: the next bucket is filled after it
                return None
            direct = store.direct_grad(group.index, shard.dtype)
            if direct is not None:     # fp32 into a host accumulator: no staging on the host
                for offset, numel, target in direct:
                    done = self.datapath.download(target, shard[offset:offset + numel])
                    issued.append(done)
                handed = True
                self._release_after(device_memory, done)
                self._sent.append((group.index, None, done, 0, None))
                self._sent_groups[group.index] += 1
                return done
            host = self.host_buckets.take(group.shard_nbytes, f"gradients {group.name}")
            if host is None:            # both buffers still in use: let their copies and writes finish
                self.settle()
                host = self.host_buckets.take(group.shard_nbytes, f"gradients {group.name}")
            done = self.datapath.download(host.tensor.view(group.dtype)[:group.shard_numel], shard)
            handed = True
            self._release_after(device_memory, done)
            self._sent.append((group.index, host, done, group.shard_numel, group.dtype))
            self._sent_groups[group.index] += 1
        except BaseException as exc:
            if not handed:
                _wait_quietly(self.datapath, issued)      # downloads already reading the bucket
                self._release_after(device_memory, None)
                if host is not None:
                    host.release()
            _keep_on_several(self, exc)
            return done if handed else None
        try:
            self.settle(wait=False)
        except BaseException as exc:
            _keep_on_several(self, exc)
        return done

    def land_direct(self) -> None:
        """Wait for the downloads still writing first shards straight into the store's accumulator
        (``direct_grad``): the store counts those groups as written from the copy's issue, and whatever reads
        or replaces the keys (widening them to fp32) must find the bytes there."""
        for _, host, done, _, _ in self._sent:
            if host is None and not done.query():
                self.datapath.host_wait(done)

    def _release_after(self, device_memory, done) -> None:
        """The bucket goes back to its buffer once its download ``done`` is (stage 1's kept memory stays)."""
        if not isinstance(device_memory, _Kept):
            self.device_buckets.release_after(device_memory, done)

    def reduce_whole(self) -> None:
        """Stage 1: reduce-scatter the whole gradients added up since the last step and send each
        rank's shard to the optimizer, in group order (the same on every rank)."""
        waiting, self._waiting = self._waiting, []
        for group in sorted(waiting, key=lambda g: g.index):
            whole = self._whole[group]
            shard = group.shard_of(whole)
            self.ranks.reduce_scatter_mean(shard, whole)
            if not self.faulted:    # else in its place among the collectives, and nothing more is sent
                self._read_until[group] = self._send(group, shard, _Kept())
        if not self.faulted:
            self.settle(wait=False, reduce=False)

    @property
    def reduces_on_settle(self) -> bool:
        """Whether ``settle()`` would issue collectives (stage 1's whole gradients, not reduced yet)."""
        return bool(self._waiting)

    def settle(self, wait: bool = True, reduce: bool = True, drop: bool = False) -> None:
        """Add the downloaded shards whose copies are done into the store (all of them, with ``wait``).

        With ``wait`` (and ``reduce``), stage 1's whole gradients are reduced first (``reduce_whole``).
        With ``drop`` the gradients are being cleared (``zero_grad``): the shards on their way are dropped, not
        added (an addition that failed, the disk full, would fail again): their copies are waited for and
        their buffers given back; stage 1's whole gradients are not reduced."""
        if drop:
            sent, self._sent = self._sent, []
            _wait_quietly(self.datapath, (done for _, _, done, _, _ in sent))   # no copy still writes a buffer given back
            for _, host, _, _, _ in sent:
                if host is not None:
                    host.release()
            self._sent_groups.clear()
            self._waiting = []
            self.faulted, self.lost = False, None
            self.datapath.settle(wait=True)
            return
        if wait and reduce and self._waiting:
            self.reduce_whole()
        if wait and self.faulted:      # after the collectives: every rank has issued them
            raise hand_off_refusal(self)
        sent, self._sent, left = self._sent, [], []
        for i, (index, host, done, numel, dtype) in enumerate(sent):
            added = False
            try:
                if not done.query():
                    if not wait:
                        left.append((index, host, done, numel, dtype))
                        continue
                    self.datapath.host_wait(done)
                if host is not None:    # else written in place already
                    writes = self.store.accumulate_grad(index, host.tensor.view(dtype)[:numel])
                    self.datapath.when_done(_Landed(writes), host.release)   # NVMe writes still read it
                added = True
                self._sent_groups[index] -= 1
                if self.watcher is not None:
                    self.watcher.landed(index)
            except BaseException as exc:    # the rest stay on their way, this one unless added (its buffer is
                self._sent = left + sent[i + added:]    # given back then): ``settle(drop=True)`` drops them
                _keep_on_several(self, exc)
                raise hand_off_refusal(self) from None
        self._sent = left
        if wait:
            self.datapath.settle(wait=True)

    def finish_backward(self, cut_short: bool = False) -> None:
        """End of a backward pass: autograd is done with every group taken. ``cut_short``: an exception ended
        it ([Note: aborted backward] in infinity/runtime/engine.py), which the watcher is told. Issues no
        collective and adds no gradient: a second call finds nothing left to let go."""
        if self.book is not None:
            self.book.base = None       # the next backward counts from its own first hand-over
        try:
            self._let_go()
        finally:
            if cut_short and self.watcher is not None:
                self.watcher.cut_short()

    def pending(self) -> bool:
        """Whether groups taken in this backward are still held for autograd."""
        return bool(self._stale)


def _keep_on_several(reducer: GradReducer, exc: BaseException) -> None:
    """A hand-off failed: raise ``exc``, or on several ranks keep it in ``reducer.lost`` ([Note: a hand-off that
    fails on one rank]): where it was raised as text, since its frames would keep the backward's tensors."""
    reducer.faulted = True
    if reducer.ranks.world_size == 1 or not isinstance(exc, Exception):
        raise exc
    if reducer.lost is not None:    # the first one says why (later ones: its refusal, raised again)
        return
    add_note(exc, "raised at (kept for the ranks' agreement):\n" + "".join(traceback.format_tb(exc.__traceback__)))
    reducer.lost = exc.with_traceback(None)


def hand_off_refusal(reducer: GradReducer) -> EngineError:
    """What ``settle`` raises after a hand-off failed: this step's gradients are not whole on this rank."""
    lost, redo = reducer.lost, "call opt.zero_grad() and redo the step"
    error = EngineError(
        "a gradient hand-off of this step failed (the error raised then says why), so part of its gradients may be "
        f"in the store twice or not at all; {redo}" if lost is None else
        f"rank {reducer.ranks.rank}: handing a gradient shard over to the optimizer failed during this step "
        f"({lost!r}); the other ranks' collectives went on, so none waits, but this rank's gradients of the step "
        f"are lost: {redo}")
    error.__cause__ = lost
    return error


def _states_tier(store, group: ParamGroup):
    """The tier holding ``group``'s optimizer states (one per group, also when they are split over tiers)."""
    return store.sub_tiers[store.layout.pieces_of_group[group.index][0].sub_index]
