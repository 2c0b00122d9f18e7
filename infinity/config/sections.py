"""The ten config sections as frozen dataclasses, and ``Config``, the whole of them.

[Note: config]
A config has ten sections (``tiers``, ``aio``, ``precision``, ``partition``,
``prefetch``, ``tiling``, ``dpu``, ``optimizer``, ``checkpoint``, ``activations``). Each is a frozen dataclass whose
fields carry their defaults, the only place a default is written, and a docstring
that ``reference_markdown()`` turns into docs/reference/config.md. Validation lives in
each section's ``__post_init__``, so a section built from Python (``AioConfig(
block_size="4MiB")``) is checked and coerced exactly like one read from a file.

Every problem is a ``ConfigError`` naming the file, the full key, the value found
and what is allowed. Unknown keys are errors at every depth, with the closest valid
key suggested. Sizes in bytes accept "64MiB"-style strings, element counts accept
"32Mi" or 1e9 ([Note: size units] in ``infinity/config/sizes.py``).

Examples
--------
>>> cfg = Config(aio={"block_size": "4MiB"}, tiers={"optimizer": "nvme", "nvme_path": "/mnt/nvme"})
>>> cfg.aio.block_size, cfg.tiers.nvme_path
(4194304, ('/mnt/nvme',))
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from infinity.config import sizes as _sizes
from infinity.config.paths import not_a_directory
from infinity.config.rules import check_across_sections
from infinity.config.sizes import GiB, TiB
from infinity.config.values import (Bytes, ConfigError, LossScale, Numel, NumaNode, Paths, Patterns, Section, check_keys,
                                    show, type_name)



# Upper bounds of the numeric keys. Each is far beyond any sensible setting, so it only catches
# slips (a unit too large, an exponent too many) before they reach an allocator or the kernel;
# the message of each says why its bound is where it is.
_MAX_MEMORY = 64 * TiB       # bytes of memory or of a look-ahead: beyond any machine
_MAX_ELEMENTS = 1 << 40      # parameter elements: 4 TiB in fp32, beyond any model's single parameter
_MAX_STEPS = 2**31 - 1       # step counts
_MAX_THREADS = 1024          # OS threads of one kind
_MAX_NUMA_NODE = 1023        # Linux: MAX_NUMNODES is at most 1024
_MAX_POOL = 256 * GiB        # pinned host memory taken up front by the NVMe pool

# Chooses the compute device where tiers.device is "auto" (a test suite or a job script pins it).
DEVICE_ENV = "INFINITY_DEVICE"


def resolve_device(setting: str) -> str:
    """A ``tiers.device`` setting as "cpu" or "cuda": "auto" is $INFINITY_DEVICE, else cuda when available."""
    if setting != "auto":
        return setting
    chosen = os.environ.get(DEVICE_ENV)
    if chosen is not None:
        if chosen not in ("cpu", "cuda"):
            raise ConfigError(f"the environment variable {DEVICE_ENV}={chosen!r} is not 'cpu' or 'cuda' "
                              "(it chooses the device where tiers.device is \"auto\")", "tiers.device")
        return chosen
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass(frozen=True)
class TiersConfig(Section):
    """Where each model state lives, and the host memory that backs the tiers."""

    section: ClassVar[str] = "tiers"

    params: Literal["device", "host", "nvme", "auto"] = "device"
    """Tier holding each rank's shard of the parameters (the compute copy, in `precision.dtype`) between
    uses: "device" on the compute device, "host" in pinned host RAM, "nvme" in files under `nvme_path`,
    "auto": the tier predicted fastest ([Note: auto placement] in infinity/plan/placement.py)."""

    optimizer: Literal["device", "host", "nvme", "auto"] = "host"
    """Tier holding the fp32 master weights, Adam's m and v, and the accumulated fp32 gradients:
    "device" keeps them on the compute device and steps there (models that fit: the baseline),
    "host" in host RAM with the step on the host, "nvme" streams them through host buffers one
    sub-group at a time; "auto" as for `params`."""

    optimizer_device_share: float = 0.0
    """Fraction of each rank's optimizer states kept on the compute device and stepped there (exact: the same
    AdamW), the rest staying in `optimizer` ("host" or "nvme"). Whole parameter groups in model order, so the
    first groups the next forward needs are stepped first, on the device; the share is rounded to a group
    boundary (`infinity.stats(model)["optimizer_tiers"]` says what each tier got). 0: none."""

    optimizer_host_share: float = 0.0
    """With `optimizer` = "nvme": fraction of each rank's optimizer states kept in host memory (after the
    device share's groups), the rest on NVMe. 0: none."""

    nvme_path: Paths = ()
    """Directory for swap files, or a list of directories to stripe them over; required when
    `params` or `optimizer` is "nvme". Each rank keeps its own files below it."""

    host_budget: Bytes = 0
    """Most host RAM the tiers and buffers may use, checked before training starts; 0 means no
    limit beyond the memory available."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Compute device: "cuda" (the rank's local GPU), "cpu", or "auto": the environment variable
    `INFINITY_DEVICE` ("cpu" or "cuda") when set, else cuda when available."""

    numa_node: NumaNode = None
    """NUMA node that host buffers are bound to: a node number, "auto" (stored as -1: the node
    nearest the GPU), or unset for no binding. Binding needs libnuma."""

    pin_memory: Literal["auto", "always", "never"] = "auto"
    """Page-lock host buffers so copies to the GPU run asynchronously: "always" (an error when
    impossible), "never", or "auto" (pin when a GPU is present)."""

    pool_buffer_size: Bytes = 64 * _sizes.MiB
    """Size of each buffer of the constant-size NVMe I/O pool, a multiple of 4 KiB; transfers that
    are not aligned for direct I/O are staged through these buffers."""

    pool_buffers: int = 8
    """Number of buffers in the NVMe I/O pool; staged NVMe I/O in flight is at most
    `pool_buffers` x `pool_buffer_size` bytes."""

    verify: bool = False
    """Checksum (CRC-32) every 64 KiB block of the NVMe swap files as it is written, and check it
    on every read that covers the block whole: bytes changed on the disk under a running job raise
    an error naming the file and the key instead of training on them. Costs one CRC pass over the
    bytes each way (measured: docs/benchmarks/verify.md)."""

    def compute_device(self) -> str:
        """``device`` with "auto" resolved on this machine: "cpu" or "cuda"."""
        return resolve_device(self.device)

    def _check(self) -> None:
        on_nvme = [name for name in ("params", "optimizer") if getattr(self, name) == "nvme"]
        if on_nvme and not self.nvme_path:
            raise ConfigError(f"required when tiers.{on_nvme[0]} is \"nvme\"; give a directory on a fast local disk",
                              "tiers.nvme_path")
        for name in ("optimizer_device_share", "optimizer_host_share"):
            self._within(name, 0.0, 1.0, "a fraction of the optimizer states")
        if self.optimizer_device_share + self.optimizer_host_share > 1.0:
            raise ConfigError(f"{self.optimizer_device_share:g} + {self.optimizer_host_share:g} is more than the "
                              "whole of the optimizer states", "tiers.optimizer_host_share")
        self._within("host_budget", 0, _MAX_MEMORY, "a budget of host RAM; no machine has more than 64TiB",
                     "bytes")
        if self.numa_node is not None:
            self._within("numa_node", -1, _MAX_NUMA_NODE, "Linux numbers NUMA nodes from 0 to 1023 "
                         "(-1 is \"auto\": the node nearest the GPU)")
        for path in self.nvme_path:       # the rest is checked where the path is used ([Note: checking nvme_path])
            wrong = not_a_directory(path)
            if wrong:
                raise ConfigError(wrong, "tiers.nvme_path")
        self._aligned("pool_buffer_size")
        self._within("pool_buffer_size", 4096, 4 * GiB, "each pool buffer is host memory taken when the "
                     "engine starts, and one transfer larger than 4GiB gains nothing", "bytes")
        self._within("pool_buffers", 1, 1024, "a transfer needs at least one buffer; beyond 1024 the pool "
                     "only takes host memory")
        pool = self.pool_buffers * self.pool_buffer_size
        if pool > _MAX_POOL:
            raise ConfigError(f"{self.pool_buffers} x {_sizes.format_size(self.pool_buffer_size)} = "
                              f"{_sizes.human_size(pool)} of pinned host memory is taken when the engine starts; "
                              f"the pool may hold at most {_sizes.format_size(_MAX_POOL)}: lower pool_buffers "
                              "or pool_buffer_size", "tiers.pool_buffers")


@dataclasses.dataclass(frozen=True)
class AioConfig(Section):
    """How NVMe files are read and written (the `tiers._aio` extension)."""

    section: ClassVar[str] = "aio"

    block_size: Bytes = 8 * _sizes.MiB
    """Largest single read or write submitted, a multiple of 4 KiB; larger transfers are split into
    pieces of this size. `infinity-bench nvme` measures a good value."""

    queue_depth: int = 32
    """Requests kept in flight per I/O handle, at least 1."""

    threads: int = 4
    """Worker threads of the thread-pool engine, at least 1."""

    engine: Literal["auto", "io_uring", "threads"] = "auto"
    """I/O engine: "io_uring", "threads" (a pthread pool doing pread/pwrite), or "auto" (io_uring when
    the kernel allows it, else threads). `infinity-report` shows which work here."""

    direct: bool = True
    """Open swap files with O_DIRECT, bypassing the page cache. Set false on file systems that refuse
    O_DIRECT (tmpfs)."""

    def _check(self) -> None:
        self._aligned("block_size")
        self._within("block_size", 4096, 1 * GiB, "one read or write; Linux moves at most 2GiB - 4KiB per "
                     "call, and a request larger than 1GiB only delays the first completion", "bytes")
        # The I/O core's own limits (tiers.aio.MAX_QUEUE_DEPTH and MAX_THREADS; the config does not
        # import the extension), checked here so that a bad value names its key.
        self._within("queue_depth", 1, 4096, "at least one request must be in flight, and the I/O core "
                     "keeps at most 4096 (its ring and slot table)")
        self._within("threads", 1, 256, "the thread-pool engine needs one thread; the I/O core starts at "
                     "most 256, and beyond that they only contend for the disk")


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class PrecisionConfig(Section):
    """Number formats."""

    section: ClassVar[str] = "precision"

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the parameters' compute copy in forward and backward, as after ``model.to(dtype)`` (give the
    model's floating-point inputs in it). Master weights, gradients and optimizer states are float32."""

    cpu_linear: Literal["native", "float32"] = "native"
    """How linear layers multiply in bfloat16 or float16 when the compute device is the CPU. "native":
    torch's kernel for the dtype (bit for bit what plain PyTorch computes; on a CPU without AVX-512 its
    layouts run at 0.3-20 GFLOP/s, against ~90 in float32 on the same cores, and Init says so once).
    "float32": `nn.Linear` layers (and linear tiles) widen input and weight exactly to float32, multiply
    there and round the output and the gradients to the compute dtype once: fp32 accumulation, as
    torch's kernels do, in another order (not bit-identical to "native"). A module that calls `F.linear`
    itself can call `infinity.tiling.widened.widened_linear` (the example GPT's tied head does under
    `train_gpt` and `make demo`: on the AMD EPYC here the demo's step went from 10.4 s to 1.0 s with it).
    Ignored in float32 or on a GPU."""

    max_nonfinite_steps: int = 5
    """In float32 and bfloat16, `opt.step()` raises once this many steps in a row had an inf/NaN
    gradient, naming the groups whose gradients, parameters or states are not finite and their
    tier (each such step is skipped until then). In float16 overflows are expected while the dynamic
    loss scale can still come down: it counts them once the scale is at `min_scale`, or fixed.
    0 never raises."""

    loss_scale: LossScale = "dynamic"
    """float16 only (ignored otherwise): "dynamic" scales the loss's gradient by a factor that halves
    after overflows (whose steps are skipped) and doubles after `growth_interval` clean steps; a
    number is a fixed scale. The optimizer's step divides it out, before clipping."""

    initial_scale: float = 2.0 ** 16
    """The dynamic loss scale's first value."""

    growth_interval: int = 2000
    """Clean steps (no inf/NaN gradient) after which the dynamic loss scale doubles."""

    hysteresis: int = 2
    """Overflowing steps it takes for the dynamic loss scale to start halving (it halves at each
    overflow from then on, until it next grows)."""

    min_scale: float = 1.0
    """The dynamic loss scale never halves below this."""

    def _check(self) -> None:
        self._within("max_nonfinite_steps", 0, _MAX_STEPS, "a count of steps (0: never raise)")
        # fp16 spans 2**-24 .. 65504; a scale outside 2**-24 .. 2**64 can only flush every gradient to
        # zero or make every one overflow.
        self._within("initial_scale", 2.0 ** -24, 2.0 ** 64, "a power of two such as 65536 is usual")
        self._within("min_scale", 2.0 ** -24, self.initial_scale, "at most initial_scale")
        if isinstance(self.loss_scale, float):
            self._within("loss_scale", 2.0 ** -24, 2.0 ** 64, "a fixed scale; a power of two such as 1024 is usual")
        self._within("growth_interval", 1, _MAX_STEPS, "a count of clean steps")
        self._within("hysteresis", 1, _MAX_STEPS, "a count of overflowing steps")

    @property
    def torch_dtype(self):
        """``dtype`` as a ``torch.dtype`` (imports torch on first use)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return _ITEMSIZE[self.dtype]


@dataclasses.dataclass(frozen=True)
class PartitionConfig(Section):
    """How parameters and optimizer states are cut up."""

    section: ClassVar[str] = "partition"

    stage: int = 3
    """ZeRO stage. 3 partitions parameters, gradients and optimizer states over the ranks. 2 keeps whole
    parameters on every rank's compute device and partitions gradients (reduce-scattered as backward
    produces them) and optimizer states; with `tiers.optimizer = "host"` it is ZeRO-Offload. 1
    partitions only the optimizer states: whole gradients accumulate on every rank and are
    reduce-scattered once per step. Stages 1 and 2 need `tiers.params = "device"`."""

    persistence_threshold: Numel = 0
    """Parameters with fewer elements than this stay gathered on the compute device after first use
    instead of being released (biases, norms: saves many tiny fetches); 0 releases all. With one rank and
    `tiers.params = "device"` every group stays gathered whatever this is: a gathered group is then its
    stored shard itself, so keeping it costs no memory, and releasing it would only cost host time per
    module."""

    sub_group_size: Numel = 32 * _sizes.MiB
    """Elements per optimizer sub-group: the flat fp32 unit the optimizer reads, steps and writes back
    in one piece. Larger means longer I/O; each sub-group in flight costs 16 bytes per element of
    host memory."""

    max_live_parameters: Numel = 0
    """Most parameter elements gathered on the compute device at once, prefetched and kept-for-reuse
    ones included (DeepSpeed's `stage3_max_live_parameters`): gathers ahead stop at it, and kept groups,
    then groups gathered ahead, are released for it; a running module's own groups are gathered
    regardless, and `Init` refuses a value below the largest group plus the groups that stay gathered
    (persistent); 0 means no limit."""

    gather_buffer_bytes: Bytes = 0
    """Compute-device memory that groups gathered for one use (stage 3; prefetched ones included)
    borrow and give back: one buffer of this many bytes, allocated at the first gather and never
    grown. A gather that finds it full (`infinity.gathered` of a whole model, say) gets memory of its
    own for that use, counted in `infinity.stats(model)["gather_memory"]["overflows"]` and warned
    about once. 0 grows it by 64 MiB slabs to the most gathered at once, reached in the first steps.
    Groups kept gathered all step (stages 1 and 2, `persistence_threshold`) have a buffer of their own,
    exactly their size. DeepSpeed has no equivalent (`allgather_bucket_size` cuts stage 1/2's
    all-gathers into pieces; infinity gathers each group whole). With a torch that cannot lend memory
    to a storage (2.13 can, 2.11 cannot: `infinity.stats(model)["gather_memory"]["lending"]`) each
    gathered group gets memory of its own, and a nonzero value warns that it has no effect."""

    reduce_bucket_bytes: Bytes = 0
    """Compute-device memory that each group's gradients are collected in before their reduce-scatter
    (DeepSpeed's `reduce_bucket_size`, in bytes): one buffer of this many bytes, allocated at the first
    backward and never grown, at least the largest trainable group's padded gradient (`infinity.Init`
    refuses less, naming the group); a bucket that finds it full waits for an earlier one's download.
    0 makes it twice the largest, so one bucket fills while the last one's shard leaves the device."""

    units: Patterns = ()
    """Module classes whose instances are each partitioned as one group of all the parameters under
    them, gathered and released with the module's own forward and backward (FSDP's wrap policy; the
    transformer block is the usual choice): fnmatch patterns over class names, for example
    ["Block"] or ["*DecoderLayer"], or "auto" for the model's `_no_split_modules` (Hugging Face
    models list their decoder layer there). A unit inside a unit belongs to the outer one. Fewer,
    larger groups cost less host time per step (on a GPU the host must stay ahead of the kernels)
    and gather a whole unit at once. Empty: one group per module with parameters of its own. A
    layer that `[tiling]` selects may not sit inside a unit (`infinity.Init` says which)."""

    def _check(self) -> None:
        self._within("stage", 1, 3, "ZeRO stage 1 partitions the optimizer states, 2 the gradients too, 3 the "
                     "parameters too")
        self._within("persistence_threshold", 0, _MAX_ELEMENTS, "no single parameter has more than 1Ti "
                     "elements", "elements")
        self._within("sub_group_size", 1, 4 << 30, "a sub-group holds at least one element, and each one in "
                     "flight takes 16 bytes per element of host memory (64GiB at 4Gi)", "elements")
        self._within("max_live_parameters", 0, _MAX_ELEMENTS, "no device holds more than 1Ti elements "
                     "(0: no limit)", "elements")
        for name in ("gather_buffer_bytes", "reduce_bucket_bytes"):
            self._within(name, 0, _MAX_MEMORY, "device memory allocated once; no device holds more than 64TiB "
                         "(0: sized by the engine)", "bytes")


@dataclasses.dataclass(frozen=True)
class PrefetchConfig(Section):
    """Trace-driven prefetching of parameters ahead of their use."""

    section: ClassVar[str] = "prefetch"

    enabled: bool = True
    """Record the order in which modules fetch parameters during the first step, and fetch ahead of
    it in later steps."""

    nvme_bytes: Bytes = 256 * _sizes.MiB
    """How far ahead, in bytes, reads of parameter shards from NVMe into host buffers run."""

    device_bytes: Bytes = 128 * _sizes.MiB
    """How far ahead, in bytes, host-to-device copies and all-gathers run."""

    reuse_distance: Bytes = 0
    """Keep a parameter gathered after use when the trace says it is needed again within this many
    bytes of fetches; 0 releases it always."""

    log_every: int = 0
    """Print a prefetch summary (stall time, hit rate) every this many steps; 0 never."""

    def _check(self) -> None:
        for name in ("nvme_bytes", "device_bytes", "reuse_distance"):
            self._within(name, 0, _MAX_MEMORY, "a look-ahead in bytes; no machine holds more than 64TiB",
                         "bytes")
        self._within("log_every", 0, _MAX_STEPS, "a number of steps (0: never)")


@dataclasses.dataclass(frozen=True)
class TilingConfig(Section):
    """Memory-centric tiling: large linear layers become several smaller parameters."""

    section: ClassVar[str] = "tiling"

    enabled: bool = True
    """Replace large linear layers by tiled equivalents inside `infinity.Init`."""

    threshold: Numel = 2**30
    """`nn.Linear` and `nn.Embedding` layers whose weight has more elements than this are tiled
    (applies only when `modules` is empty)."""

    tiles: int = 0
    """Tiles per tiled layer; 0 picks the fewest tiles that keep each at most `max_tile_bytes`."""

    max_tile_bytes: Bytes = 256 * _sizes.MiB
    """Largest tile, in bytes, when `tiles` is 0."""

    modules: Patterns = ()
    """Tile exactly the `nn.Linear` / `nn.Embedding` layers whose qualified name matches one of
    these fnmatch patterns (for example "blocks.*.mlp.*"), whatever their size; layers tied to a
    chosen one come along. Empty means every such layer above `threshold`."""

    def _check(self) -> None:
        self._within("threshold", 1, _MAX_ELEMENTS, "a weight of at least one element; no layer has more "
                     "than 1Ti", "elements")
        self._within("tiles", 0, 65536, "0 picks the count; each tile is a parameter fetched on its own, and "
                     "beyond 65536 the fetches cost more than they save")
        self._within("max_tile_bytes", 1, _MAX_MEMORY, "a tile of at least one byte, and no machine holds "
                     "more than 64TiB", "bytes")


@dataclasses.dataclass(frozen=True)
class DpuConfig(Section):
    """The host optimizer step beside the next iteration: exactly (`overlap`) or one step behind (DPU)."""

    section: ClassVar[str] = "dpu"

    enabled: bool = False
    """After warm-up, run the optimizer step of iteration t on a background thread while iteration
    t+1 computes with parameters one step older. This changes the training dynamics."""

    warmup_steps: int = 5
    """Steps run with ordinary, synchronous updates before the delay starts."""

    threads: int = 0
    """CPU threads for the host optimizer step on its background thread (DPU, or the overlapped step);
    0 keeps torch's default, except for the overlapped step with the CPU as compute device, which then
    uses 1 (it mostly waits for NVMe, and a second team of threads beside compute slows both)."""

    overlap: bool = True
    """Without DPU, when optimizer states or parameters are on NVMe, or the states are in host RAM and
    the compute runs on a GPU: `opt.step()` starts the update on a background thread and returns, and the
    next forward waits only for the parameters it is about to use. Results are identical to a synchronous
    step; the update's NVMe traffic and host work overlap the forward."""

    def _check(self) -> None:
        self._within("warmup_steps", 0, _MAX_STEPS, "a number of steps")
        self._within("threads", 0, _MAX_THREADS, "0 keeps torch's default; each is an OS thread, and beyond "
                     "1024 they only contend")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Section):
    """How the host optimizer stores Adam's moments (see [Note: compressed moments] in infinity/optim/moments.py)."""

    section: ClassVar[str] = "optimizer"

    state_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """Storage of Adam's m and v in the optimizer tier: "fp32" (4+4 bytes per parameter, exact),
    "bf16" (2+2, stochastic rounding) or "int8" (1+1 and one fp32 scale per block of
    `state_block_size`, with a non-linear code). The master weights stay fp32. Opt-in: the
    compressed formats change training slightly (docs/benchmarks/compressed-states.md)."""

    state_block_size: int = 256
    """With "int8": elements per block, each block with its own scales. A power of two."""

    update_in_backward: bool = False
    """Step each sub-group of the host optimizer (`partition.sub_group_size` elements) on a background thread
    as soon as backward has produced all of its gradients, while the rest of backward computes; `opt.step()`
    then steps only what is left. With states on NVMe the gradients stay in host memory and never go to the
    disk. With the states split over tiers (`tiers.optimizer_device_share`, `tiers.optimizer_host_share`) the
    device share is stepped inside `opt.step()`. Results are identical to the ordinary step; what cannot be
    exact is refused: with `dpu.enabled`, float16 or `tiers.optimizer = "device"` here, and at the call
    `clip_grad_norm_`, a second backward before `opt.step()` (accumulation), an edit of `.grad`, or a
    non-finite gradient once a sub-group was stepped. Learning rates are read during backward: change them
    after `opt.step()`, as schedulers do."""

    def _check(self) -> None:
        self._within("state_block_size", 32, 2048, "a block shares one 4-byte scale per moment, which costs "
                     "more than 1/8 byte per element below 32; above 2048 (the largest block the 8-bit Adam "
                     "literature uses) one large value coarsens too many others, and blocks must tile the "
                     "optimizer's 2048-element aligned shards")
        b = self.state_block_size
        if b & (b - 1):
            raise ConfigError(f"{b} is not a power of two (blocks must tile the 2048-element aligned shards); "
                              f"try {1 << (b.bit_length() - 1)} or {1 << b.bit_length()}", f"{self.section}.state_block_size")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    """Saving and loading sharded checkpoints."""

    section: ClassVar[str] = "checkpoint"

    buffer_size: Bytes = 64 * _sizes.MiB
    """Buffer through which shards stream between their tiers and checkpoint files, a multiple of
    4 KiB."""

    def _check(self) -> None:
        self._aligned("buffer_size")
        self._within("buffer_size", 4096, 4 * GiB, "a save or load holds three of these buffers in host "
                     "memory at once", "bytes")


@dataclasses.dataclass(frozen=True)
class ActivationsConfig(Section):
    """Activations saved at activation-checkpoint boundaries (ZeRO-R): where they wait for backward."""

    section: ClassVar[str] = "activations"

    offload: Literal["none", "host", "nvme"] = "none"
    """Where the tensors a checkpointed region saves for backward (its inputs: `infinity.activation_checkpoint`,
    or `torch.utils.checkpoint` with `use_reentrant=False` or True) wait between forward and backward:
    "none" leaves them on the compute device, "host" moves them to host memory, "nvme" to files under
    `tiers.nvme_path`. Backward brings them back ahead of use, in reverse order. Results are identical."""

    min_nbytes: Bytes = 64 * _sizes.KiB
    """Saved tensors smaller than this stay where they are (masks, scalars: not worth a transfer)."""

    prefetch_bytes: Bytes = 32 * _sizes.MiB
    """How far ahead, in bytes, backward brings offloaded activations back to the compute device
    (at least one tensor, however large); 0 brings each back only when backward uses it (the least
    memory at the recompute's peak, a wait per tensor)."""

    buffer_bytes: Bytes = 64 * _sizes.MiB
    """With "nvme": the constant-size host buffer, a multiple of 4 KiB, through which activations move
    to and from their files (writes in flight and reads under way share it); allocated once."""

    checkpoint_nbytes: Bytes = 0
    """Bytes of checkpointed activations one rank holds at the end of a forward (for a transformer with
    every block checkpointed: blocks x batch x sequence x hidden x dtype bytes). Only sizes the budget
    check, `infinity-plan` and "auto" tiers (which cannot know the batch); 0 leaves them out of the first
    two, and "auto" then keeps a quarter of a GPU's free memory for them ([Note: activations before the
    first step] in infinity/plan/placement.py). After a step,
    `infinity.stats(model)["activations"]["checkpoint_nbytes"]` is the measured value."""

    def _check(self) -> None:
        self._within("min_nbytes", 0, _MAX_MEMORY, "a tensor size; no machine holds more than 64TiB", "bytes")
        self._within("prefetch_bytes", 0, _MAX_MEMORY, "a look-ahead in bytes; no machine holds more than 64TiB",
                     "bytes")
        self._within("buffer_bytes", 4096, 4 * GiB, "one staging buffer of host memory, allocated when the engine "
                     "starts", "bytes")
        self._aligned("buffer_bytes")
        self._within("checkpoint_nbytes", 0, _MAX_MEMORY, "activation bytes a step holds; no machine holds more "
                     "than 64TiB", "bytes")


SECTIONS: tuple[type[Section], ...] = (TiersConfig, AioConfig, PrecisionConfig, PartitionConfig,
                                        PrefetchConfig, TilingConfig, DpuConfig, OptimizerConfig,
                                        CheckpointConfig, ActivationsConfig)


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole config: one frozen dataclass per section.

    Build one with ``load_config``; change one with ``dataclasses.replace`` or
    ``load_config(cfg, overrides={...})``. A section may also be given as a mapping.

    Examples
    --------
    >>> cfg = Config(aio={"queue_depth": 8})
    >>> cfg.aio.queue_depth, cfg.tiers.params
    (8, 'device')
    """

    tiers: TiersConfig = dataclasses.field(default_factory=TiersConfig)
    aio: AioConfig = dataclasses.field(default_factory=AioConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    partition: PartitionConfig = dataclasses.field(default_factory=PartitionConfig)
    prefetch: PrefetchConfig = dataclasses.field(default_factory=PrefetchConfig)
    tiling: TilingConfig = dataclasses.field(default_factory=TilingConfig)
    dpu: DpuConfig = dataclasses.field(default_factory=DpuConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    activations: ActivationsConfig = dataclasses.field(default_factory=ActivationsConfig)

    def __post_init__(self) -> None:
        for cls in SECTIONS:
            value = getattr(self, cls.section)
            if isinstance(value, Mapping):
                check_keys({cls.section: value}, SECTIONS)
                object.__setattr__(self, cls.section, cls(**value))
            elif not isinstance(value, cls):
                raise ConfigError(f"expected a table of settings, got {show(value)} ({type_name(value)})", cls.section)
        check_across_sections(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        """Build a config from plain data (as read from a file); every unknown key is an error."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a table of sections, got {show(data)} ({type_name(data)})")
        check_keys(data, SECTIONS)
        return cls(**{name: section for name, section in data.items()})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain, JSON-able data: sizes as integers, tuples as lists, unset values as ``None``."""
        return {
            cls.section: {f.name: (list(v) if isinstance(v := getattr(section, f.name), tuple) else v)
                          for f in dataclasses.fields(section)}
            for cls in SECTIONS for section in (getattr(self, cls.section),)
        }
