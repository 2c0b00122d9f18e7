"""The checkpoint stream's error paths: what it started ends before its error leaves."""
from __future__ import annotations

import zlib

import pytest
import torch

from infinity.checkpoint.manifest import FileRecord
from infinity.checkpoint.stream import Run, StreamIO, read_runs
from infinity.config.sections import AioConfig


class _Tracked:
    def __init__(self, events, name):
        self.events, self.name = events, name

    def wait(self):
        self.events.append(f"{self.name} ended")


class _Dest:
    """Takes the first write (a transfer that ends when waited for) and refuses the second."""

    def __init__(self, events):
        self.events, self.calls = events, 0

    def write(self, dest_offset, data):
        self.calls += 1
        if self.calls == 2:
            self.events.append("second write refused")
            raise OSError("injected: the tier refused the write")
        return _Tracked(self.events, f"write {self.calls}")


def test_a_window_whose_second_write_fails_waits_for_its_first(tmp_path):
    """One read window scattered to two runs: when the second run's write cannot start, the first one's is
    in flight, and the load may not be declared failed (and its caller free or reuse the memory) before it
    ends."""
    data = torch.arange(8192, dtype=torch.int32).view(torch.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.numpy().tobytes())
    chunk = 4096
    crcs = tuple(zlib.crc32(data.numpy()[i:i + chunk]) for i in range(0, data.numel(), chunk))
    record = FileRecord("data.bin", data.numel(), chunk, crcs)
    events = []
    dest = _Dest(events)
    runs = [Run("data.bin", 0, 3072, dest, 0), Run("data.bin", 3072, 5000, dest, 3072)]
    with StreamIO(AioConfig(), 1 << 20) as io:
        with pytest.raises(OSError, match="injected"):
            read_runs(io, {"data.bin": (str(path), record)}, runs)
    assert events == ["second write refused", "write 1 ended"], events
