"""The up-front budget check: fits or says by how much, per tier and filesystem."""
from __future__ import annotations

import re
import shutil

import psutil
import pytest
import torch

from tiers import BudgetError, Need, check_budget

GiB = 1 << 30


def test_everything_fits(tmp_path):
    report = check_budget([Need("params", "nvme", 4096, path=str(tmp_path)), Need("optimizer", "host", 4096),
                           Need("params", "device", 4096)], device=torch.device("cpu"))
    assert report.fits and report.shortfalls() == []
    report.raise_if_short()
    assert {row["tier"] for row in report.rows} == {"nvme", "host", "device"}
    assert "yes" in report.table()


def test_nvme_shortfall_message(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    report = check_budget([Need("params", "nvme", free + 100 * GiB, path=str(tmp_path))])
    assert not report.fits
    (line,) = report.shortfalls()
    assert re.fullmatch(rf"params need \d+\.\d (GiB|TiB) on nvme_path {re.escape(str(tmp_path))}; "
                        r"\d+\.\d (MiB|GiB|TiB) free", line), line
    with pytest.raises(BudgetError, match=rf"params need .* GiB on nvme_path {tmp_path}; .* free"):
        report.raise_if_short()


def test_needs_on_one_filesystem_add_up(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    half = shutil.disk_usage(tmp_path).free * 2 // 3  # each fits alone, not both together
    alone = check_budget([Need("params", "nvme", half, path=str(tmp_path / "a"))])
    both = check_budget([Need("params", "nvme", half, path=str(tmp_path / "a")),
                         Need("optimizer states", "nvme", half, path=str(tmp_path / "b"))])
    assert alone.fits and not both.fits
    (line,) = both.shortfalls()
    assert line.startswith("params + optimizer states need") and f"{tmp_path / 'a'}, {tmp_path / 'b'}" in line


def test_path_not_created_yet_uses_its_parent(tmp_path):
    report = check_budget([Need("params", "nvme", 1, path=str(tmp_path / "later" / "deeper"))])
    assert report.fits


def test_host_budget_replaces_available_ram():
    report = check_budget([Need("optimizer states", "host", 3 * GiB)], host_budget=2 * GiB)
    assert report.shortfalls() == ["optimizer states need 3.0 GiB of host memory; host_budget is 2.0 GiB"]
    huge = psutil.virtual_memory().total * 2
    (line,) = check_budget([Need("optimizer states", "host", huge)]).shortfalls()
    assert line.startswith("optimizer states need") and "of host RAM;" in line and line.endswith("available")


def test_cpu_device_shares_host_ram():
    ram = psutil.virtual_memory().available
    report = check_budget([Need("params", "device", ram * 2 // 3), Need("optimizer", "host", ram * 2 // 3)],
                          device=torch.device("cpu"))
    assert not report.fits
    (line,) = report.shortfalls()
    assert line.startswith("optimizer + params need") and "host + cpu device" in line


@pytest.mark.parametrize("kwargs,match", [
    (dict(what="p", tier="disk", nbytes=1), "tier must be one of"),
    (dict(what="p", tier="host", nbytes=-1), "nbytes must be an int >= 0"),
    (dict(what="p", tier="nvme", nbytes=1), "needs a path"),
])
def test_need_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Need(**kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="device memory check needs a CUDA device")
def test_cuda_device_memory():
    free, _total = torch.cuda.mem_get_info()
    report = check_budget([Need("params", "device", free * 2)], device=torch.device("cuda"))
    assert not report.fits and "on cuda" in report.shortfalls()[0]
