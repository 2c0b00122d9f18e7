"""Where tensors live: host allocator, buffer pools, and the device / host / NVMe tiers.

Nothing here knows what a model or an optimizer is (shared/DESIGN.md, "tiers").
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public names -> the module defining them. Imported on first use, so that e.g.
# ``tiers.budget`` works (and stays cheap) even where the C extension is not built.
_EXPORTS = {
    "Arena": "arena", "Tier": "base", "Future": "base", "CompletedFuture": "base", "TierFullError": "base",
    "byte_view": "base", "format_nbytes": "base", "wait_quietly": "base",
    "HostAllocator": "host_alloc", "HostAllocatorError": "host_alloc", "NumaPlacement": "host_alloc",
    "BufferPool": "pool", "PoolBuffer": "pool", "Loan": "pool", "PoolTimeoutError": "pool",
    "DeviceTier": "device", "CudaCopyFuture": "memory", "MemoryTier": "memory",
    "HostTier": "host",
    "NVMeTier": "nvme", "NVMeIOError": "nvme", "UnwrittenKeyError": "nvme", "Placement": "swapspace", "SwapSpace": "swapspace",
    "SwapDirectoryError": "swapfile", "SwapDirectoryLockedError": "swapfile",
    "StaleSwapFileError": "swapfile", "NVMeSpaceError": "swapfile",
    "Staging": "staging", "Run": "staging",
    "TransferFuture": "future", "TierStats": "telemetry",
    "Need": "budget", "BudgetReport": "budget", "BudgetError": "budget", "check_budget": "budget",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tiers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tiers.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from tiers.arena import Arena
    from tiers.base import CompletedFuture, Future, Tier, TierFullError, byte_view, format_nbytes, wait_quietly
    from tiers.budget import BudgetError, BudgetReport, Need, check_budget
    from tiers.device import DeviceTier
    from tiers.future import TransferFuture
    from tiers.host import HostTier
    from tiers.host_alloc import HostAllocator, HostAllocatorError, NumaPlacement
    from tiers.memory import CudaCopyFuture, MemoryTier
    from tiers.nvme import NVMeIOError, NVMeTier, UnwrittenKeyError
    from tiers.pool import BufferPool, Loan, PoolBuffer, PoolTimeoutError
    from tiers.staging import Run, Staging
    from tiers.swapfile import NVMeSpaceError, StaleSwapFileError, SwapDirectoryError, SwapDirectoryLockedError
    from tiers.swapspace import Placement, SwapSpace
    from tiers.telemetry import TierStats
