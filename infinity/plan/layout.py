"""Shard arithmetic: from a census, a config and a world size to bytes per tier and NVMe traffic.

[Note: where each byte lives]
Following shared/DESIGN.md ("Where each byte lives") and the engine's allocations, per rank:

* compute copy of each group's shard, ``precision.dtype``, in ``tiers.params``. The engine
  stores it apart from the fp32 master even in fp32 with params and optimizer in the same tier
  (shared/DESIGN.md would keep one copy there; until the engine does, the plan counts what is
  stored, so its fit check never promises room the run will not find).
* with delayed parameter update (``dpu.enabled``): a second gradient accumulator (at the
  gradients' stored size, below) in ``tiers.optimizer`` and a second compute copy of every trainable group in ``tiers.params``
  (the background step writes them while the next iteration uses the published set,
  ``infinity/optim/background.py``).
* fp32 master of every shard, frozen groups' too (a parameter unfrozen later trains from it; with
  bf16 copies and states off the device, as the copy plus a 2-byte remainder until then), and
  Adam m and v and the gradient accumulator of the trainable groups (a frozen group gets them when
  it is unfrozen: [Note: dormant sub-groups] in infinity/optim/flat_state.py):
  ``tiers.optimizer``; m and v at their stored size (``optimizer.state_dtype``: 4, 2 or
  1 + 4 / ``state_block_size`` bytes each per element). In bf16 with params and optimizer both on
  NVMe the master is stored as the compute copy plus a 2-byte remainder ([Note: split master] in
  infinity/optim/split_master.py); in bf16/fp16 with the optimizer in host memory or on NVMe
  the gradients are stored in the compute dtype ([Note: compact gradients] in
  infinity/optim/compact_grads.py; the plan assumes one micro-batch per step).
* with the optimizer states split over tiers (``tiers.optimizer_device_share`` / ``optimizer_host_share``,
  [Note: optimizer states over tiers] in infinity/optim/tier_split.py): master, m, v and gradient of the
  first groups on the compute device, of the next in host memory, of the rest in ``tiers.optimizer``, cut
  at the group boundary nearest each share as the engine cuts (a bare parameter count, one group, is cut
  at the shares themselves). Such a store keeps fp32 masters (no split master) and, with a device share,
  fp32 gradients everywhere; each tier's rows count its own elements.
* when anything is on NVMe: the I/O buffer pool (``tiers.pool_buffers`` x
  ``tiers.pool_buffer_size``) in host memory.
* when the optimizer is on NVMe: its sub-group pipeline buffers in host memory: 4 buffers
  (master, m, v, gradient; m and v at their stored size) of one sub-group, double buffered (one
  sub-group stepped while the next is read), plus the compute copy and remainder (split masters)
  and the compact gradient they are read into. In host memory, split masters and compact
  gradients are joined and widened into one sub-group's fp32 buffers. A sub-group is
  ``partition.sub_group_size`` elements rounded up to the shard alignment, but never more than the
  rank's whole shard (``infinity/optim/flat_state.py``).
* when params are on NVMe: aligned host staging buffers demand reads land in (3 buffers of the
  largest shard, ``infinity/runtime/shards.py``, [Note: staging buffers]) and, when prefetching, the
  arena reads issued ahead land in (``prefetch.nvme_bytes``, ``tiers/arena.py``).
* with a compute dtype other than fp32 and the states off the device: the update's new compute
  copies, converted from the fp32 masters into two sub-groups' worth of host staging
  (``infinity/optim/update.py``).
* gradient shards on their way from the compute device to the fp32 accumulator, in host
  memory: two buffers of the largest trainable shard in the compute dtype, unless the states
  are on the compute device or fp32 shards go straight into a host accumulator
  (``infinity/runtime/grads.py``, [Note: gradient flow]).
* on the compute device: the largest group gathered whole (its padded flat buffer, compute
  dtype) and ``prefetch.device_bytes`` when prefetching, or in their place
  ``partition.gather_buffer_bytes`` when set (the one buffer they are lent from); the gradient
  buckets' buffer, ``partition.reduce_bucket_bytes`` or twice the largest trainable group's
  padded gradient (compute dtype; [Note: gradient buckets] in infinity/runtime/reduce_buckets.py);
  and groups below ``partition.persistence_threshold`` elements, which stay gathered on every rank.

[Note: PCIe traffic per step]
Between the compute device and host memory, per rank and step (one micro-batch, steady state,
``prefetch.reuse_distance`` 0): every group's shard is copied to the device in forward (once per
module holding it: twice for a tied weight) and again in backward, in the compute dtype, when the
parameters are not on the device (persistent groups once: they are re-gathered after the update
only); each trainable group's gradient shard leaves
the device once, in the compute dtype, when the optimizer's states are not on it; and the
update's new compute copies cross once more when the parameters and the states are on different
sides. The all-gather and the reduce-scatter run between devices and are not counted here. The
engine's ledger (``infinity.stats(model)["transfers"]``) counts the same bytes, with one exception
the plan cannot see from the model's structure: a weight passed as an argument to a module that
does not hold it (the example GPT's output head uses the token embedding's weight so) is gathered
for that module too: one more gather of it per step than the plan counts (GPT 125M: 154 MB of
1.15 GB host->device bytes in fp32).

[Note: padding]
Each group's flat buffer is padded so that every rank's shard is a whole multiple of
``SHARD_ALIGN_NUMEL`` elements (2048, as ``infinity.param_group.ALIGN_NUMEL``: the brief asked for
1024; the engine uses 2048 so that a 2-byte shard is a whole 4096-byte O_DIRECT block):
shard = roundup(ceil(numel / world_size), 2048). Every rank therefore holds the same bytes (one
rank type) and nothing has to divide the world size. NVMe slots are whole 4096-byte blocks.

[Note: NVMe traffic per step]
shared/DESIGN.md, one micro-batch per step, steady state: compute copies are read in forward and
again in backward (persistent groups once: they are re-gathered after the update only; a group
held by several modules, a tied weight, is read once per holder in forward); gradients
are written as they are reduce-scattered; one pass over the optimizer's sub-groups reads master,
m, v and gradient and writes master, m, v and the new compute copy (frozen groups are not
rewritten). Split masters read the compute copy and the remainder (2 + 2 bytes) and write the
remainder; compact gradients are written and read in the compute dtype. bf16 on NVMe, one
micro-batch: 2 + 2 (forward, backward) + 2 (gradients) + 14 (copy, remainder, m, v, gradient)
+ 12 (remainder, m, v, copy) = 32 bytes per parameter and step, before fresh shards; the
update during backward (``optimizer.update_in_backward``) holds the gradients in host memory
(2 + 2 bytes fewer). With the overlapped step (``dpu.overlap`` without DPU) or the update during
backward, params on NVMe and prefetching on, the next forward takes rewritten compute copies from
host memory instead of reading them back ([Note: fresh shards] in infinity/prefetch/fresh_shards.py),
as many as the arena of ``prefetch.nvme_bytes`` holds at a time. How many that is depends on who
runs ahead:

* the forward keeps pace with the overlapped update (it waits for each group's new copy: the step
  is bound by the update, NVMe or host Adam, as on a GPU and in the 6.7B run on the CPU): each
  fresh shard is taken soon after the update makes it and its slice is reused, so every rewritten
  group whose shard fits the arena is served from host memory. ``nvme_read_bytes`` subtracts those
  (``fresh_bytes``). (A group offered while the arena is still full of shards the forward has not
  reached is read instead; with a large shard such as the embedding in front that is a few
  groups after it, which the plan does not count.)
* the update ends before the forward gets there (``opt.synchronize()`` between steps, a forward
  slower than the update, and always the update during backward, which has written every copy
  before the forward starts): only the first ``prefetch.nvme_bytes`` of them wait in the arena;
  ``nvme_read_bytes(paced=False)`` subtracts min(``prefetch.nvme_bytes``, rewritten bytes).
  For the overlapped step reads lie between the two; the plan reports both (``nvme_read_bytes_max``).

At llama-6.7B (a 256 or 512 MiB arena, the largest shards, the embedding and the head, 250 MiB)
the first serves the whole forward from host memory: 2 bytes per parameter fewer than the second.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from infinity.optim.moments import MomentFormat
from infinity.optim.tier_split import cut_groups, group_kind
from infinity.prefetch.prefetcher import read_ahead_arena_nbytes
from infinity.plan.census import ModelCensus
from infinity.plan.rows import PlanRow
from infinity.plan.units import round_up

if TYPE_CHECKING:
    from infinity.config import Config

SHARD_ALIGN_NUMEL = 2048
NVME_ALIGN_BYTES = 4096
FP32_BYTES = 4
# Demand-read staging buffers (infinity/runtime/engine.py, [Note: staging buffers]).
STAGING_BUFFERS = 3


def shard_numel(numel: int, world_size: int) -> int:
    """One rank's padded shard of a group of ``numel`` elements (see [Note: padding])."""
    return round_up(-(-numel // world_size), SHARD_ALIGN_NUMEL)


class Layout:
    """Per-rank sizes of one (census, config, world size); yields the plan's rows and traffic.

    Parameters
    ----------
    census : ModelCensus
        The partition groups.
    cfg : infinity.config.Config
        The loaded config.
    world_size : int
        Data-parallel ranks.
    param_bytes : int
        Bytes per element of the compute dtype.
    """

    def __init__(self, census: ModelCensus, cfg: "Config", world_size: int, param_bytes: int):
        self.cfg = cfg
        self.pb = param_bytes
        self.world_size = world_size
        self.structured = census.structured
        self.widened_numel = census.widened_numel
        self.params_tier = cfg.tiers.params
        self.opt_tier = cfg.tiers.optimizer
        # Adam m and v as stored (see [Note: compressed moments] in infinity/optim/moments.py).
        self.moments = MomentFormat(cfg.optimizer.state_dtype, cfg.optimizer.state_block_size)
        threshold = int(cfg.partition.persistence_threshold)
        self.shard_numel = 0
        self.trainable_numel = 0
        self.persistent_padded_numel = 0
        self.compute_nvme = 0  # compute-copy bytes as stored on NVMe (block aligned)
        self.compute_shards: list[int] = []     # the same, per group
        self.read_nvme = 0  # compute-copy bytes read per step (forward + backward)
        self.gathered_numel = 0  # shard elements gathered per step (forward + backward; persistent once)
        self.rewrite_nvme = 0  # compute-copy bytes of trainable groups, rewritten by the update
        self.rewrite_shards: list[int] = []   # the same, per group
        self.rewrite_groups: list[int] = []   # the index of each of those groups
        self.largest_shard = 0
        self.largest_name: str | None = None
        self.largest_numel: int | None = None
        self.largest_trainable_numel = 0
        self.largest_trainable_shard = 0
        self.trainable_padded_numel = 0   # stage 1: whole gradients held on every rank
        self.stage = int(cfg.partition.stage)
        shards: list[tuple[int, bool]] = []     # each group's shard and whether it trains
        for group in census.groups:
            shard = shard_numel(group.numel, world_size)
            shards.append((shard, group.trainable))
            padded = shard * world_size
            on_disk = round_up(shard * param_bytes, NVME_ALIGN_BYTES)
            persistent = cfg.partition.stage < 3 or (threshold > 0 and group.numel < threshold)
            self.shard_numel += shard
            self.compute_nvme += on_disk
            self.compute_shards.append(on_disk)
            fetches = 1 if persistent else group.uses + 1    # each use in forward, once in backward
            self.read_nvme += fetches * on_disk
            self.gathered_numel += fetches * shard
            self.largest_shard = max(self.largest_shard, shard)
            if persistent:
                self.persistent_padded_numel += padded
            # A trainable group: the engine streams, steps and rewrites it, and holds its moments and gradient.
            if group.trainable:
                self.trainable_numel += shard
                self.trainable_padded_numel += padded
                self.rewrite_nvme += on_disk
                self.rewrite_shards.append(on_disk)
                self.rewrite_groups.append(len(shards) - 1)
                self.largest_trainable_numel = max(self.largest_trainable_numel, padded)
                self.largest_trainable_shard = max(self.largest_trainable_shard, shard)
            if census.structured and (self.largest_numel is None or padded > self.largest_numel):
                self.largest_name, self.largest_numel = group.name, padded
        if not census.structured:
            self.largest_trainable_numel = 0
        # Elements (all, trainable) of the optimizer states per tier, fastest first (see [Note: where each
        # byte lives]): one tier, or split over tiers by the config's shares.
        self.split_states = bool(cfg.tiers.optimizer_device_share or cfg.tiers.optimizer_host_share)
        self.group_kinds = _group_kinds(shards, cfg, self.opt_tier) if census.structured else None
        self.state_numel = _state_numel(shards, cfg, self.opt_tier, self.group_kinds)
        # The tier of the first group's states: with a split store its kind sets the gradients' dtype.
        fastest = next(iter(self.state_numel), self.opt_tier)
        # See [Note: split master] in infinity/optim/split_master.py and [Note: compact gradients]
        # in infinity/optim/compact_grads.py: the engine's own rules, so plan and run agree.
        self.split_master = (not self.split_states and cfg.precision.dtype == "bfloat16"
                             and self.params_tier == self.opt_tier == "nvme")
        self.grad_bytes = (param_bytes if cfg.precision.dtype in ("bfloat16", "float16")
                           and fastest in ("host", "nvme") else FP32_BYTES)
        self.master_bytes = 2 if self.split_master else FP32_BYTES
        # Frozen groups' masters are split while their sub-groups are dormant ([Note: dormant sub-groups]
        # in infinity/optim/flat_state.py; ``rest_split`` in infinity/optim/split_master.py); a store split
        # over tiers keeps them fp32.
        self.frozen_master_bytes = (2 if cfg.precision.dtype == "bfloat16" and self.opt_tier in ("host", "nvme")
                                    and not self.split_states else self.master_bytes)
        # [Note: update during backward] in infinity/optim/in_backward.py: the NVMe share's gradients held in
        # host memory (a split store's shares in memory take theirs into their accumulators).
        self.grads_held = cfg.optimizer.update_in_backward and self.opt_tier == "nvme"

    @property
    def grad_staging_nbytes(self) -> int:
        """Host buffers that gradient shards are downloaded into before the fp32 accumulator takes them:
        none when the states are on the compute device, or fp32 shards go straight into a host accumulator."""
        if not self.trainable_off_device() or not self.structured:
            return 0
        if not self.trainable_on("nvme") and self.cfg.precision.dtype == "float32":
            return 0
        return 2 * round_up(self.largest_trainable_shard * self.pb, NVME_ALIGN_BYTES)

    @property
    def uses_nvme(self) -> bool:
        return self.params_tier == "nvme" or "nvme" in self.state_numel

    def trainable_on(self, tier: str) -> int:
        """Elements of groups that train whose optimizer states are in ``tier``."""
        return self.state_numel.get(tier, (0, 0))[1]

    def trainable_off_device(self) -> int:
        """Elements of groups that train whose optimizer states are in host memory or on NVMe: their
        gradients leave the device and their update runs on the host."""
        return self.trainable_numel - self.trainable_on("device")

    def rows(self) -> Iterator[PlanRow]:
        """Every byte one rank holds, by purpose (see [Note: where each byte lives])."""
        cfg, pb, dtype = self.cfg, self.pb, self.cfg.precision.dtype
        nbytes = self.compute_nvme if self.params_tier == "nvme" else self.shard_numel * pb
        yield PlanRow("compute_copy", f"compute copy of params ({dtype}, "
                      f"{self.shard_numel:,} elements)", self.params_tier, nbytes)
        t = self.trainable_numel
        yield from self._state_rows()
        if cfg.dpu.enabled and t:
            yield PlanRow("dpu_grad_accumulator", "second gradient accumulator (DPU; "
                          + ("fp32)" if self.grad_bytes == FP32_BYTES else f"{dtype} until micro-batches accumulate)"),
                          self.opt_tier, self.grad_bytes * t)
            spare = self.rewrite_nvme if self.params_tier == "nvme" else t * pb
            yield PlanRow("dpu_compute_copy", f"second compute copy of trainable params ({dtype}, "
                          "DPU)", self.params_tier, spare)
        if self.uses_nvme:
            count, size = int(cfg.tiers.pool_buffers), int(cfg.tiers.pool_buffer_size)
            yield PlanRow("pool_buffers", f"NVMe I/O buffer pool ({count} x "
                          f"{size / 2**20:g} MiB)", "host", count * size)
        if self.trainable_on("nvme"):
            sub = min(round_up(int(cfg.partition.sub_group_size), SHARD_ALIGN_NUMEL),
                      max(t, SHARD_ALIGN_NUMEL))
            extra = (4 if self.split_master else 0) + (self.grad_bytes if self.grad_bytes != FP32_BYTES else 0)
            yield PlanRow("optimizer_subgroup_buffers", f"optimizer sub-group buffers (2 sets x "
                          f"{sub:,} elements: 2 fp32 + m, v in {self.moments.dtype}"
                          f"{f' + {extra} bytes' if extra else ''})", "host",
                          2 * ((2 * FP32_BYTES + extra) * sub + 2 * self.moments.nbytes(sub)))
        if self.trainable_on("host") and (self.split_master or self.grad_bytes != FP32_BYTES):
            sub = min(round_up(int(cfg.partition.sub_group_size), SHARD_ALIGN_NUMEL),
                      max(t, SHARD_ALIGN_NUMEL))
            per = (8 if self.split_master else 0) + (FP32_BYTES if self.grad_bytes != FP32_BYTES else 0)
            yield PlanRow("optimizer_scratch", f"joined fp32 masters / widened gradients of the "
                          f"sub-group being stepped ({per} bytes x {sub:,} elements)", "host", per * sub)
        streamed = self.trainable_on("nvme")
        if self.grads_held and streamed:
            sub = min(round_up(int(cfg.partition.sub_group_size), SHARD_ALIGN_NUMEL),
                      max(streamed, SHARD_ALIGN_NUMEL))
            # Two sub-groups filling, and the largest group's, should its gradient come last (a tied weight).
            held = min(streamed, 2 * sub + round_up(self.largest_trainable_shard, sub))
            yield PlanRow("held_grads", f"gradients held in host memory until their sub-group is stepped "
                          f"(update during backward: two sub-groups of {sub:,} elements and the largest "
                          "group's)", "host", self.grad_bytes * held)
        if self.params_tier == "nvme" and self.structured:
            size = round_up(self.largest_shard * pb, NVME_ALIGN_BYTES)
            yield PlanRow("nvme_staging", f"NVMe demand-read staging ({STAGING_BUFFERS} x "
                          f"{size / 2**20:.3g} MiB)", "host", STAGING_BUFFERS * size)
        if self.params_tier == "nvme" and (cfg.prefetch.enabled or not self.structured):
            arena = read_ahead_arena_nbytes(cfg.prefetch.nvme_bytes, self.compute_shards)
            what = ("prefetch.nvme_bytes" if arena == int(cfg.prefetch.nvme_bytes) else
                    "twice the compute copies' shards, less than prefetch.nvme_bytes")
            yield PlanRow("prefetch_arena", f"NVMe read-ahead arena ({what})", "host", arena)
        gather_buffer = int(cfg.partition.gather_buffer_bytes) if self.stage == 3 else 0
        if gather_buffer:
            yield PlanRow("gather_buffer", "buffer that groups gathered for one use borrow, prefetched ones "
                          "included (partition.gather_buffer_bytes)", "device", gather_buffer)
        elif self.largest_numel is not None and self.stage == 3:
            yield PlanRow("working_set", f"largest working set: {self.largest_name} gathered "
                          f"({self.largest_numel:,} elements, {dtype})", "device",
                          self.largest_numel * pb)
        buckets = int(cfg.partition.reduce_bucket_bytes)
        if self.largest_trainable_numel or (buckets and t):
            what = ("partition.reduce_bucket_bytes" if buckets else
                    f"2 x the largest, {self.largest_trainable_numel:,} elements, {dtype}")
            yield PlanRow("working_set_grad", f"gradient buckets before reduce-scatter ({what})", "device",
                          buckets or 2 * round_up(self.largest_trainable_numel * pb, NVME_ALIGN_BYTES))
        # bf16 copies of parameters in host memory are written in place by the C pass ([Note: the fused
        # fp32 step] in optim_csrc/qadam.c): no staging. (A build without the C extension stages them.)
        in_place = self.params_tier == "host" and dtype == "bfloat16"
        # States on the device with the copies on NVMe: the new copies come down into the staging first.
        through_host = self.params_tier == "nvme" and self.trainable_on("device")
        if (self.trainable_off_device() and dtype != "float32" and not in_place) or through_host:
            sub = min(max(SHARD_ALIGN_NUMEL, round_up(int(cfg.partition.sub_group_size), SHARD_ALIGN_NUMEL)),
                      max(self.shard_numel, SHARD_ALIGN_NUMEL))
            yield PlanRow("compute_copy_staging", f"new compute copies converted from the fp32 master, or on their way "
                          f"from the device to NVMe "
                          f"(2 sub-groups x {sub:,} elements, {dtype})", "host", 2 * sub * pb)
        widened = self.widened_numel
        if (widened and cfg.precision.cpu_linear == "float32" and dtype != "float32"
                and cfg.tiers.compute_device() == "cpu"):
            yield PlanRow("widened_linear", f"fp32 weight and weight gradient of the largest linear layer "
                          f"(precision.cpu_linear = \"float32\": 2 x {widened:,} elements)", "device",
                          2 * FP32_BYTES * widened)
        if self.grad_staging_nbytes:
            yield PlanRow("grad_staging", f"gradient shards downloaded to the host (2 x the largest, "
                          f"{dtype})", "host", self.grad_staging_nbytes)
        if cfg.prefetch.enabled and not gather_buffer:
            yield PlanRow("device_prefetch", "host->device prefetch budget", "device",
                          int(cfg.prefetch.device_bytes))
        if self.persistent_padded_numel:
            why = (f"whole parameters on every rank (stage {self.stage})" if self.stage < 3 else
                   "groups below persistence_threshold")
            yield PlanRow("persistent_params", f"{why}, kept gathered ({self.persistent_padded_numel:,} elements)",
                          "device", self.persistent_padded_numel * pb)
        if self.stage == 1 and self.world_size > 1 and self.trainable_padded_numel:
            yield PlanRow("whole_grads", f"whole gradients added up on every rank until the step's "
                          f"reduce-scatter (stage 1, {self.trainable_padded_numel:,} elements, {dtype})", "device",
                          self.trainable_padded_numel * pb)

    def _state_rows(self) -> Iterator[PlanRow]:
        """Masters of every element, frozen ones too, and the other states of the groups that train, in each
        tier that holds states (see [Note: where each byte lives])."""
        dtype = self.cfg.precision.dtype
        for tier, (n, t) in self.state_numel.items():
            share = f"; the {tier} share" if self.split_states else ""
            which = f"{n:,} elements, {t:,} in groups that train{share}"
            if self.split_master:
                yield PlanRow("master", f"fp32 master params: 16-bit remainders beside the compute copy ({which})",
                              tier, self.master_bytes * n)
            elif self.frozen_master_bytes != self.master_bytes:
                yield PlanRow("master", f"fp32 master params ({which}; frozen ones as 16-bit remainders beside the "
                              "compute copy)", tier, FP32_BYTES * t + self.frozen_master_bytes * (n - t))
            else:
                yield PlanRow("master", f"fp32 master params ({which})", tier, FP32_BYTES * n)
            yield PlanRow("adam_moments", f"Adam m and v ({self.moments.dtype}, {t:,} elements of groups that "
                          f"train{share})", tier, 2 * self.moments.nbytes(t))
            if self.grad_bytes == FP32_BYTES:
                yield PlanRow("grad_accumulator", "fp32 gradient accumulator" + (f" (the {tier} share)"
                              if self.split_states else ""), tier, FP32_BYTES * t)
            else:
                yield PlanRow("grad_accumulator", f"gradient shards ({dtype}, {self.grad_bytes} bytes; twice that, "
                              f"fp32, once micro-batches accumulate{share})", tier, self.grad_bytes * t)

    def moment_nbytes(self, tier: str | None = None) -> int:
        """Bytes of Adam's m and v of this rank's elements in groups that train (those in ``tier``), as stored
        (blocks tile the 2048-element aligned shards, so the int8 scales add exactly 4 bytes per block)."""
        return 2 * self.moments.nbytes(self.trainable_numel if tier is None else self.trainable_on(tier))

    def host_to_device_bytes(self) -> int:
        """Bytes one rank copies from host memory to the compute device per step (see [Note: PCIe
        traffic per step])."""
        total = 0 if self.params_tier == "device" else self.pb * self.gathered_numel
        if self.params_tier == "device":
            total += self.pb * self.trainable_off_device()     # the host update's new compute copies
        return total

    def device_to_host_bytes(self) -> int:
        """Bytes one rank copies from the compute device to host memory per step."""
        total = self.pb * self.trainable_off_device()   # gradient shards of the states off the device
        if self.params_tier != "device":
            total += self.pb * self.trainable_on("device")     # the device update's new compute copies
        return total

    def all_gather_bytes(self) -> int:
        """Bytes one rank sends in all-gathers per step: each gathered shard to the N-1 others (see
        [Note: communication volume] in infinity/runtime/ranks.py); as many gathers as host->device copies."""
        return self.pb * self.gathered_numel * (self.world_size - 1)

    def reduce_scatter_bytes(self) -> int:
        """Bytes one rank sends in reduce-scatters per step: (N-1)/N of each trainable group's padded
        gradient bucket, i.e. its shard times N-1."""
        return self.pb * self.trainable_numel * (self.world_size - 1)

    def fresh_bytes(self, paced: bool = True) -> int:
        """Rewritten compute-copy bytes the next forward takes from host memory instead of NVMe (see
        [Note: NVMe traffic per step]): with the forward keeping pace with the update (``paced``), or
        after the update has ended."""
        cfg = self.cfg
        overlapped = cfg.dpu.overlap and not cfg.dpu.enabled and not cfg.optimizer.update_in_backward
        if not (self.params_tier == "nvme" and (overlapped or cfg.optimizer.update_in_backward)
                and cfg.prefetch.enabled and self.structured):
            return 0
        arena = read_ahead_arena_nbytes(cfg.prefetch.nvme_bytes, self.compute_shards)
        # A split store's device share is stepped inside opt.step() and offers no fresh shards.
        offered = [shard for shard, g in zip(self.rewrite_shards, self.rewrite_groups)
                   if self.group_kinds is None or self.group_kinds[g] != "device"]
        ended = min(arena, sum(offered))
        if not paced or not overlapped:     # the update during backward has ended before the forward
            return ended
        return max(ended, sum(shard for shard in offered if shard <= arena))

    def nvme_read_bytes(self, paced: bool = True) -> int:
        """Bytes one rank reads from NVMe per step (see [Note: NVMe traffic per step])."""
        total = self.read_nvme if self.params_tier == "nvme" else 0
        total -= self.fresh_bytes(paced)
        streamed = self.trainable_on("nvme")
        if streamed:
            # master (or compute copy + remainder), m, v, gradient (none held in host memory)
            grads = 0 if self.grads_held else self.grad_bytes
            total += (self.master_bytes + grads) * streamed + self.moment_nbytes("nvme")
            if self.split_master:
                total += self.pb * streamed     # the compute copies the masters are joined from
        return total

    def nvme_write_bytes(self) -> int:
        """Bytes one rank writes to NVMe per step (see [Note: NVMe traffic per step])."""
        total = 0
        streamed = self.trainable_on("nvme")
        if streamed:
            if not self.grads_held:
                total += self.grad_bytes * streamed  # gradients, as reduce-scattered
            total += self.master_bytes * streamed + self.moment_nbytes("nvme")  # master (remainder), m, v
        if self.params_tier == "nvme":
            total += self.rewrite_nvme
        return total


def _group_kinds(shards: list[tuple[int, bool]], cfg: "Config", base: str) -> list[str] | None:
    """The tier of each group's optimizer states, cut at group boundaries as the engine cuts ([Note: optimizer
    states over tiers] in infinity/optim/tier_split.py); None when they are in one tier."""
    device, host = cfg.tiers.optimizer_device_share, cfg.tiers.optimizer_host_share
    if not (device or host):
        return None
    cuts = cut_groups([n for n, _ in shards], device, host)
    return [group_kind(cuts, base, index) for index in range(len(shards))]


def _state_numel(shards: list[tuple[int, bool]], cfg: "Config", base: str,
                 kinds: list[str] | None) -> dict[str, tuple[int, int]]:
    """Elements (all, of groups that train) of the optimizer states in each tier that holds some, fastest first:
    by each group's tier (``kinds``), or, for a bare parameter count (one group standing for many, no kinds),
    by the shares themselves."""
    total = sum(n for n, _ in shards)
    trainable = sum(n for n, trains in shards if trains)
    device, host = cfg.tiers.optimizer_device_share, cfg.tiers.optimizer_host_share
    if not (device or host):
        return {base: (total, trainable)}
    out: dict[str, list[int]] = {}
    if kinds is not None:
        for kind, (n, trains) in zip(kinds, shards):
            counts = out.setdefault(kind, [0, 0])
            counts[0] += n
            counts[1] += n if trains else 0
    else:
        for tier, low, high in (("device", 0.0, device), ("host", device, device + host), (base, device + host, 1.0)):
            part = (round(high * total) - round(low * total), round(high * trainable) - round(low * trainable))
            counts = out.setdefault(tier, [0, 0])
            counts[0] += part[0]
            counts[1] += part[1]
    order = ("device", "host", "nvme")
    return {tier: (n, t) for tier, (n, t) in sorted(out.items(), key=lambda kv: order.index(kv[0])) if n}
