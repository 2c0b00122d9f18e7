"""The nine config sections as frozen dataclasses, and ``Config``, the whole of them.

[Note: config]
A config has nine sections (``tiers``, ``aio``, ``precision``, ``partition``,
``prefetch``, ``tiling``, ``dpu``, ``checkpoint``, ``activations``). Each is a frozen dataclass whose
fields carry their defaults, the only place a default is written, and a docstring
that ``reference_markdown()`` turns into the README's reference. Validation lives in
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
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from infinity.config import sizes as _sizes
from infinity.config.values import (Bytes, ConfigError, Numel, NumaNode, Paths, Patterns, Section, check_keys,
                                    show, type_name)



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

    params: Literal["device", "host", "nvme"] = "device"
    """Tier holding each rank's shard of the parameters (the compute copy, in `precision.dtype`)
    between uses: "device" on the compute device, "host" in pinned host RAM, "nvme" in files under
    `nvme_path`. A whole parameter exists only while a module uses it."""

    optimizer: Literal["device", "host", "nvme"] = "host"
    """Tier holding the fp32 master weights, Adam's m and v, and the accumulated fp32 gradients:
    "device" keeps them on the compute device and steps there (models that fit: the baseline),
    "host" in host RAM with the step on the host, "nvme" streams them through host buffers one
    sub-group at a time."""

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

    def compute_device(self) -> str:
        """``device`` with "auto" resolved on this machine: "cpu" or "cuda"."""
        return resolve_device(self.device)

    def _check(self) -> None:
        on_nvme = [name for name in ("params", "optimizer") if getattr(self, name) == "nvme"]
        if on_nvme and not self.nvme_path:
            raise ConfigError(f"required when tiers.{on_nvme[0]} is \"nvme\"; give a directory on a fast local disk",
                              "tiers.nvme_path")
        self._aligned("pool_buffer_size")
        self._at_least("pool_buffers", 1)


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
        self._at_least("queue_depth", 1)
        self._at_least("threads", 1)


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class PrecisionConfig(Section):
    """Number formats."""

    section: ClassVar[str] = "precision"

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the parameters' compute copy in forward and backward. Master weights, gradients and
    optimizer states are always float32."""

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

    persistence_threshold: Numel = 0
    """Parameters with fewer elements than this stay gathered on the compute device after first use
    instead of being released (biases, norms: saves many tiny fetches); 0 releases all."""

    sub_group_size: Numel = 32 * _sizes.MiB
    """Elements per optimizer sub-group: the flat fp32 unit the optimizer reads, steps and writes back
    in one piece. Larger means longer I/O; each sub-group in flight costs 16 bytes per element of
    host memory."""

    max_live_parameters: Numel = 0
    """Most parameter elements gathered on the compute device at once, prefetched ones included;
    0 means no limit."""

    def _check(self) -> None:
        self._at_least("sub_group_size", 1)


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
        self._at_least("log_every", 0)


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
        self._at_least("threshold", 1)
        self._at_least("tiles", 0)
        self._at_least("max_tile_bytes", 1)


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
        self._at_least("warmup_steps", 0)
        self._at_least("threads", 0)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    """Saving and loading sharded checkpoints."""

    section: ClassVar[str] = "checkpoint"

    buffer_size: Bytes = 64 * _sizes.MiB
    """Buffer through which shards stream between their tiers and checkpoint files, a multiple of
    4 KiB."""

    def _check(self) -> None:
        self._aligned("buffer_size")


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
    (at least one tensor, however large)."""

    buffer_bytes: Bytes = 64 * _sizes.MiB
    """With "nvme": the constant-size host buffer, a multiple of 4 KiB, through which activations move
    to and from their files (writes in flight and reads under way share it); allocated once."""

    checkpoint_nbytes: Bytes = 0
    """Bytes of checkpointed activations one rank holds at the end of a forward (for a transformer with
    every block checkpointed: blocks x batch x sequence x hidden x dtype bytes). Only sizes the budget
    check and `infinity-plan` (which cannot know the batch); 0 leaves them out. After a step,
    `infinity.stats(model)["activations"]["checkpoint_nbytes"]` is the measured value."""

    def _check(self) -> None:
        self._aligned("buffer_bytes")


SECTIONS: tuple[type[Section], ...] = (TiersConfig, AioConfig, PrecisionConfig, PartitionConfig,
                                        PrefetchConfig, TilingConfig, DpuConfig, CheckpointConfig,
                                        ActivationsConfig)


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
        if self.activations.offload == "nvme" and not self.tiers.nvme_path:
            raise ConfigError("\"nvme\" needs tiers.nvme_path, a directory on a fast local disk, for the "
                              "activations' files", "activations.offload")

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
