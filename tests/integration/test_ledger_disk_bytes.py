"""The transfer ledger's NVMe bytes of a step against the operating system's count of the same step.

``/proc/self/io`` counts the bytes this process (every thread of it: the aio workers, the staging
threads and the update's worker are threads of this process) read from and wrote to storage. With
``O_DIRECT`` every read and write of the NVMe tier reaches the disk, so over a window in which the
engine moves nothing else the operating system's count and the ledger's must agree. The window here
is two steady steps between two points where no transfer is in flight (``opt.synchronize()``), and
the first step's update is held until the second step's forward has begun, as the overlapped update
of a fast machine often is: each step's ledger must still hold its own forward, backward and update,
half of the window (see [Note: a step's bytes] in infinity/runtime/datapath.py).
"""
from __future__ import annotations

import os
import threading

import pytest
import torch

import infinity
from infinity.optim.background import BackgroundUpdate
from infinity.telemetry import StepTelemetry
from tests.support.tiny_gpt import TinyGPT

PROC_IO = "/proc/self/io"
# Filesystems whose I/O the kernel does not count as storage traffic (or that refuse O_DIRECT).
UNCOUNTED = {"tmpfs", "ramfs", "overlay", "fuse", "nfs", "nfs4", "9p", "virtiofs", "squashfs"}
REL = 0.05


def storage_bytes() -> tuple[int, int]:
    """(read_bytes, write_bytes) of this process so far, as the kernel counts them."""
    with open(PROC_IO) as f:
        fields = dict(line.split(": ") for line in f.read().splitlines() if line)
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def filesystem_type(path: str) -> str:
    """The type of the filesystem ``path`` is on (the longest mount point above it)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def skip_unless_counted(path) -> None:
    if not os.path.exists(PROC_IO):
        pytest.skip(f"{PROC_IO} is missing: no per-process count of storage bytes on this system")
    kind = filesystem_type(str(path))
    if kind in UNCOUNTED:
        pytest.skip(f"{path} is on {kind}, whose reads and writes the kernel does not count in {PROC_IO}")


def batch(step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (4, 32), generator=gen)
    return x, torch.roll(x, -1, dims=1)


def train_step(model, opt, step: int) -> None:
    x, y = batch(step)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def update_held(monkeypatch):
    """Arm it and the next background update waits until a step's forward has begun (the step records'
    boundary), then runs beside that forward."""
    armed, begun = threading.Event(), threading.Event()
    work, begin_step = BackgroundUpdate.work, StepTelemetry.begin_step

    def held_work(self, *args):
        if armed.is_set():
            armed.clear()
            if not begun.wait(60):
                raise RuntimeError("no forward began within 60 s of the held update")
        return work(self, *args)

    def marked_begin_step(self, step):
        begin_step(self, step)
        begun.set()

    monkeypatch.setattr(BackgroundUpdate, "work", held_work)
    monkeypatch.setattr(StepTelemetry, "begin_step", marked_begin_step)

    def arm():
        begun.clear()
        armed.set()
    return arm


def test_nvme_step_bytes_match_the_os_count(tmp_path, update_held):
    skip_unless_counted(tmp_path)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path), "device": "cpu"},
           "precision": {"dtype": "bfloat16"}, "dpu": {"overlap": True}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT(vocab=256, d=128, heads=4, layers=3, seq=32)
    opt = infinity.AdamW(model, lr=1e-3)
    for step in range(3):       # m and v exist from the second update on: the steps after are steady
        train_step(model, opt, step)
    opt.synchronize()
    read0, written0 = storage_bytes()
    update_held()               # step 3's update runs only once step 4's forward has begun
    train_step(model, opt, 3)
    x, y = batch(4)
    model(x, y).backward()      # the backward waits for step 3's update: its record is complete
    first = infinity.stats(model)["transfers"]
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    read1, written1 = storage_bytes()
    x, y = batch(5)
    model(x, y).backward()      # step 5's forward closed step 4's record
    second = infinity.stats(model)["transfers"]

    os_bytes = (read1 - read0) + (written1 - written0)
    assert os_bytes > 0, "the OS counted no storage traffic for two steps on NVMe"
    per_step = os_bytes / 2
    for name, ledger in (("step 3", first), ("step 4", second)):
        moved = ledger["nvme_to_host"]["bytes"] + ledger["host_to_nvme"]["bytes"]
        assert moved == pytest.approx(per_step, rel=REL), (
            f"{name}: the ledger's NVMe bytes ({moved}: read {ledger['nvme_to_host']['bytes']}, written "
            f"{ledger['host_to_nvme']['bytes']}) against the OS count per step ({per_step:.0f}: read "
            f"{(read1 - read0) / 2:.0f}, written {(written1 - written0) / 2:.0f})")
