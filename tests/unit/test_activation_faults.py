"""A failed activation write is reported, never lost in a finalizer nor read back as garbage."""
from __future__ import annotations

import gc

import pytest
import torch

import infinity
from infinity import registry
from infinity.errors import EngineError
from tests.distributed.test_activations import LAYERS, B, T, CheckpointedGPT, _config

WRITES = LAYERS * 2     # per forward: each 8 KiB checkpoint input in two chunks of the 8 KiB staging buffer


class Injected(OSError):
    pass


def _failing_writes(monkeypatch, offloader, fail_at):
    """The ``fail_at``-th NVMe write of the activation tier (counting from 1) raises."""
    datapath = offloader.tier.datapath
    write, calls = datapath.write, [0]

    def write_or_fail(tier, key, src, offset=0, source="host"):
        if tier is offloader.tier.nvme:
            calls[0] += 1
            if calls[0] == fail_at:
                raise Injected(5, "injected: no space left on the activation drive")
        return write(tier, key, src, offset, source)

    monkeypatch.setattr(datapath, "write", write_or_fail)


def _model(tmp_path):
    torch.manual_seed(0)
    with infinity.Init(_config("nvme", str(tmp_path))):
        model = CheckpointedGPT("wrapper")
    return model, registry.engine_of(model).activations


def test_a_write_that_failed_under_a_graph_still_alive_is_not_read_back(tmp_path, monkeypatch):
    """Graph A's write fails; graph B is freed without backward (its activations given back from a finalizer,
    which used to swallow A's error); A's backward must refuse the missing bytes, not train on garbage."""
    model, offloader = _model(tmp_path)
    _failing_writes(monkeypatch, offloader, fail_at=2 * WRITES)     # graph A's last write
    idx = torch.randint(0, 64, (B, T))
    loss_b = model(idx, idx)
    loss_a = model(idx, idx)
    offloader.tier._io.submit(lambda: None).result()    # A's failed write has finished on the I/O thread
    del loss_b
    gc.collect()
    with pytest.raises((EngineError, Injected), match="injected|cannot be read back"):
        loss_a.backward()
    infinity.release(model)


def test_a_write_error_met_by_a_finalizer_is_raised_by_the_next_forward(tmp_path, monkeypatch):
    model, offloader = _model(tmp_path)
    _failing_writes(monkeypatch, offloader, fail_at=WRITES)        # the forward's last write
    idx = torch.randint(0, 64, (B, T))
    loss = model(idx, idx)              # no backward: the graph is dropped
    offloader.tier._io.submit(lambda: None).result()
    del loss
    gc.collect()
    with pytest.raises(Injected, match="injected"):
        model(idx, idx).backward()
    infinity.release(model)
