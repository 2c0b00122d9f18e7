"""The budget check: do the bytes each tier must hold fit, before anything is allocated?

[Note: what counts as available]
host: ``host_budget`` when set (> 0), else ``psutil.virtual_memory().available``.
nvme: ``shutil.disk_usage(path).free`` per filesystem; needs on paths of the same
filesystem (same ``st_dev``) add up, since they draw from the same free space.
device: ``torch.cuda.mem_get_info`` (free) on CUDA; on the CPU the device tier is host
RAM, so the device row uses RAM available, and one more row checks host + device
needs together against it (they cannot both have all of it).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Iterable

import psutil
import torch

from tiers.base import format_nbytes

_TIERS = ("device", "host", "nvme")


class BudgetError(RuntimeError):
    """The configured tiers cannot hold what they must; the message has the numbers."""


@dataclass(frozen=True)
class Need:
    """Bytes one tier must hold for one purpose.

    what : str
        What the bytes are ("params", "optimizer states"), named in messages.
    tier : str
        ``"device"``, ``"host"`` or ``"nvme"``.
    nbytes : int
        Bytes needed.
    path : str | None
        The NVMe directory (required for ``tier="nvme"``).
    """

    what: str
    tier: str
    nbytes: int
    path: str | None = None

    def __post_init__(self) -> None:
        if self.tier not in _TIERS:
            raise ValueError(f"Need({self.what!r}): tier must be one of {_TIERS}, got {self.tier!r}")
        if not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool) or self.nbytes < 0:
            raise ValueError(f"Need({self.what!r}): nbytes must be an int >= 0, got {self.nbytes!r}")
        if self.tier == "nvme" and not self.path:
            raise ValueError(f"Need({self.what!r}): tier 'nvme' needs a path (the nvme_path directory)")


@dataclass(frozen=True)
class BudgetReport:
    """The outcome of :func:`check_budget`: one row per place bytes draw from.

    Each row is a dict with ``tier``, ``path``, ``need``, ``available`` (bytes), ``what``
    (the purposes, joined with " + ") and ``source`` (where ``available`` came from).
    """

    fits: bool
    rows: list[dict] = field(default_factory=list)

    def shortfalls(self) -> list[str]:
        """One sentence per row that does not fit, e.g.
        ``"params need 38.2 GiB on nvme_path /x; 12.1 GiB free"``."""
        return [_sentence(row) for row in self.rows if row["need"] > row["available"]]

    def raise_if_short(self) -> None:
        """Raise :class:`BudgetError` listing every shortfall, if any."""
        lines = self.shortfalls()
        if lines:
            raise BudgetError("the configured tiers do not fit:\n  " + "\n  ".join(lines))

    def table(self) -> str:
        """A plain-text table of all rows (for logs and ``infinity-plan``)."""
        lines = [f"{'tier':<7} {'need':>10} {'available':>10}  {'fits':<4}  what @ where"]
        for row in self.rows:
            fits = "yes" if row["need"] <= row["available"] else "NO"
            lines.append(f"{row['tier']:<7} {format_nbytes(row['need']):>10} "
                         f"{format_nbytes(row['available']):>10}  {fits:<4}  {row['what']} @ {row['path']}")
        return "\n".join(lines)


def _sentence(row: dict) -> str:
    need, available, what = format_nbytes(row["need"]), format_nbytes(row["available"]), row["what"]
    if row["tier"] == "nvme":
        return f"{what} need {need} on nvme_path {row['path']}; {available} free"
    if row["tier"] == "host" and row["source"] == "budget":
        return f"{what} need {need} of host memory; host_budget is {available}"
    if row["tier"] == "host":
        return f"{what} need {need} of {row['path']}; {available} available"
    return f"{what} need {need} on {row['path']}; {available} free"


def _existing(path: str) -> str:
    """The nearest existing ancestor of ``path`` (the directory may not be created yet)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _row(tier: str, path: str, needs: list[Need], available: int, source: str) -> dict:
    return {"tier": tier, "path": path, "need": sum(n.nbytes for n in needs),
            "available": int(available), "what": " + ".join(n.what for n in needs), "source": source}


def check_budget(needs: Iterable[Need], *, host_budget: int = 0,
                 device: torch.device | None = None) -> BudgetReport:
    """Check that ``needs`` fit in host RAM, on each NVMe filesystem and on the device.

    Parameters
    ----------
    needs : iterable of Need
        Bytes per tier and purpose.
    host_budget : int
        When > 0, the host tier's limit instead of the RAM psutil reports available.
    device : torch.device | None
        The compute device; None: CUDA when available, else the CPU.

    Returns
    -------
    BudgetReport
        ``fits`` and one row per resource; ``raise_if_short()`` raises with the numbers.

    Examples
    --------
    >>> report = check_budget([Need("params", "nvme", 1 << 50, path="/tmp")])
    >>> report.fits, report.shortfalls()[0].startswith("params need 1024.0 TiB on nvme_path /tmp;")
    (False, True)
    """
    needs = list(needs)
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    rows: list[dict] = []
    ram_available = psutil.virtual_memory().available

    host = [n for n in needs if n.tier == "host"]
    if host:
        if host_budget > 0:
            rows.append(_row("host", "host_budget", host, host_budget, "budget"))
        else:
            rows.append(_row("host", "host RAM", host, ram_available, "available"))

    on_device = [n for n in needs if n.tier == "device"]
    if on_device:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            rows.append(_row("device", str(device), on_device, free, "free"))
        else:
            rows.append(_row("device", f"{device} (host RAM)", on_device, ram_available, "available"))
            if host:
                rows.append(_row("host", "host RAM (host + cpu device)", host + on_device,
                                 ram_available, "available"))

    by_filesystem: dict[int, list[Need]] = {}
    for need in (n for n in needs if n.tier == "nvme"):
        by_filesystem.setdefault(os.stat(_existing(need.path)).st_dev, []).append(need)
    for group in by_filesystem.values():
        paths = ", ".join(dict.fromkeys(n.path for n in group))
        free = shutil.disk_usage(_existing(group[0].path)).free
        rows.append(_row("nvme", paths, group, free, "free"))

    fits = all(row["need"] <= row["available"] for row in rows)
    return BudgetReport(fits=fits, rows=rows)
