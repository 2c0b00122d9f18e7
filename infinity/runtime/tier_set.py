"""Build the tiers one rank uses from the config (the engine's side of the tiers layer).

[Note: per-rank swap directories]
Each rank keeps its NVMe swap files in ``<nvme_path>/rank<r>`` under every
configured path, so ranks sharing a drive never share a directory lock and a
multi-node job can point every node at the same mount name. ``r`` is the process's
rank in the whole job (``torch.distributed.get_rank()``), not its rank in the engine's
group: with ``infinity.Init(group=...)`` and several data-parallel groups on one
machine, group rank 0 of each group would take the same directory.
"""
from __future__ import annotations

import os
import stat

import torch

from infinity.config import Config, ConfigError
from infinity.config.paths import check_nvme_paths
from infinity.errors import EngineError


def private_directory(path: str) -> None:
    """Make ``path`` (a rank's swap directory under ``nvme_path``) ``0700``, or check the one there: on a shared
    scratch disk another user may have made it first, to plant links or read the swap files in it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise EngineError(f"swap directory {path}: " + (
            "not a directory (a symbolic link?)" if not stat.S_ISDIR(info.st_mode) else
            f"owned by uid {info.st_uid}, not this user" if info.st_uid != os.geteuid() else
            f"writable by others (mode {stat.S_IMODE(info.st_mode):o})") + "; refusing to keep the model's states "
            "there. Remove it, or use an nvme_path of your own")


class TierSet:
    """The tiers, host allocator, I/O handle and pools of one rank.

    Parameters
    ----------
    config:
        The loaded config.
    device:
        The compute device (infinity.runtime.device.ComputeDevice).
    rank:
        This process's rank in the whole job, for the per-rank swap directories.
    adopt:
        Sealed swap files the NVMe tier takes over, one per directory (a checkpoint in place), or None.
    """

    def __init__(self, config: Config, device, rank: int, adopt: list[str] | None = None) -> None:
        from tiers.device import DeviceTier
        from tiers.host import HostTier
        from tiers.host_alloc import HostAllocator
        from tiers.pool import BufferPool

        t = config.tiers
        if t.pin_memory == "always" and not torch.cuda.is_available():
            raise ConfigError('"always" needs CUDA to page-lock host memory, and this machine has none; use '
                              '"auto" (pins where a GPU is present) or "never"', "tiers.pin_memory")
        # "always" pins even for a CPU compute device (it was silently "never" there, as "auto" is).
        self.allocator = HostAllocator(pin=t.pin_memory if device.is_cuda or t.pin_memory == "always" else "never",
                                       numa_node=t.numa_node)
        self.device_tier = DeviceTier(device.device)
        self.host_tier = HostTier(self.allocator, capacity=t.host_budget or None)
        self.nvme_tier = None
        self.handle = None
        self.pool = None
        uses_nvme = "nvme" in (t.params, t.optimizer, config.activations.offload)
        if uses_nvme:
            if not t.nvme_path:
                raise ConfigError("tiers.nvme_path: required when tiers.params, tiers.optimizer or "
                                  "activations.offload is 'nvme'; give a directory (or a list of directories) "
                                  "on a fast drive")
            check_nvme_paths(t.nvme_path, config.aio.direct, rank)
            from tiers.nvme import NVMeTier
            from tiers.aio import AioHandle

            dirs = [os.path.join(p, f"rank{rank}") for p in t.nvme_path]
            for d in dirs:
                private_directory(d)
            a = config.aio
            self.handle = AioHandle(block_size=a.block_size, queue_depth=a.queue_depth,
                                    threads=a.threads, engine=a.engine, direct=a.direct)
            # Made at its first loan: only unaligned transfers use it ([Note: constant-size buffers] in tiers/pool.py).
            self.pool = BufferPool(t.pool_buffer_size, t.pool_buffers, self.allocator, name="nvme-io", lazy=True)
            try:
                self.nvme_tier = NVMeTier(dirs, self.handle, self.pool, verify=t.verify, adopt=adopt)
            except BaseException:
                self.handle.close()
                raise
        self.by_name = {"device": self.device_tier, "host": self.host_tier, "nvme": self.nvme_tier}
        self.params = self.by_name[t.params]
        self.optimizer = self.by_name[t.optimizer]
        # Every tier holding optimizer states, fastest first ([Note: optimizer states over tiers] in
        # infinity/optim/tier_split.py).
        self.optimizer_parts = [tier for kind, share in (("device", t.optimizer_device_share),
                                                         ("host", t.optimizer_host_share)) if share
                                for tier in (self.by_name[kind],)] + [self.optimizer]

    def check(self) -> None:
        """Raise when a swap file was cut or overwritten under this run (tiers' ``SwapFileDamagedError``)."""
        if self.nvme_tier is not None:
            self.nvme_tier.check()

    def stats(self) -> dict:
        out = {name: tier.stats() for name, tier in self.by_name.items() if tier is not None}
        out["host_allocator"] = self.allocator.stats()
        if self.pool is not None:
            out["nvme_pool"] = self.pool.stats()
        return out

    def close(self) -> None:
        """Close the swap files, release their directory locks and stop the I/O threads (idempotent)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.nvme_tier is not None:
            self.nvme_tier.close()
        if self.handle is not None:
            self.handle.close()
