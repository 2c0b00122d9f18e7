"""Checkpointed activations offloaded to host memory or NVMe (``[activations] offload``).

Each run trains the same checkpointed model with offload "none", "host" and "nvme", the
checkpoint made three ways (``infinity.activation_checkpoint`` wrapping each block, and
``torch.utils.checkpoint`` called by the model, non-reentrant and reentrant, as transformers'
``gradient_checkpointing_enable()`` does), at world sizes 1 and 2: the losses must be identical
to offload "none", every checkpoint input must have moved, and the transfer ledger must book them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import infinity
from infinity.errors import EngineError
from tests.support.ranks import run_ranks
from tests.support.tiny_gpt import TinyGPT

B, T, D, LAYERS = 4, 16, 32, 3


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose blocks run under an activation checkpoint, made the way ``mode`` says."""

    def __init__(self, mode: str) -> None:
        super().__init__(vocab=64, d=D, layers=LAYERS, seq=T)
        self.mode = mode
        if mode == "wrapper":
            self.blocks = torch.nn.ModuleList(infinity.activation_checkpoint(b) for b in self.blocks)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = block(x) if self.mode == "wrapper" else checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        logits = self.head(self.ln_f(x)) * self.scale
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def _config(offload: str, nvme: str) -> dict:
    # Small budgets so that several chunks, waits for staging space and prefetch limits all happen.
    return {"tiers": {"device": "cpu", "nvme_path": nvme}, "aio": {"direct": False},
            "activations": {"offload": offload, "min_nbytes": 1024, "prefetch_bytes": 4096,
                            "buffer_bytes": 8192}}


def _train(rank, world, workdir, mode, offload):
    import os

    nvme = os.path.join(workdir, f"{mode}-{offload}")
    os.makedirs(nvme, exist_ok=True)
    torch.manual_seed(0)
    with infinity.Init(_config(offload, nvme)):
        model = CheckpointedGPT(mode)
    opt = infinity.AdamW(model, lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(3):
        idx, tgt = (torch.randint(0, 64, (B, T), generator=g) for _ in range(2))
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.synchronize()
    stats = infinity.stats(model)
    return losses, stats["activations"], stats["transfers"]


def _all(rank, world, workdir):
    return {(mode, offload): _train(rank, world, workdir, mode, offload)
            for mode in ("wrapper", "torch", "reentrant") for offload in ("none", "host", "nvme")}


@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_activations_give_the_same_losses_and_are_booked(tmp_path, world):
    per_checkpoint = B * T * D * 4
    for rank, runs in enumerate(run_ranks(_all, world, tmp_path)):
        for mode in ("wrapper", "torch", "reentrant"):
            base, none_stats, none_ledger = runs[(mode, "none")]
            assert none_stats == {"offload": "none"}
            for offload in ("host", "nvme"):
                losses, act, ledger = runs[(mode, offload)]
                where = f"rank {rank} of {world}, {mode}, offload {offload}: {act}"
                assert losses == base, where
                last = act["last"]
                assert act["checkpoint_nbytes"] == LAYERS * per_checkpoint, where
                assert last["offloaded_tensors"] == LAYERS and last["fetched_bytes"] == LAYERS * per_checkpoint
                assert last["demand_fetches"] == 0 and last["prefetched"] == LAYERS, where
                assert act["ahead_bytes"] == 0 and act["arena"]["bytes_in_use"] == 0, where
                moved = ledger["device_to_host"]["bytes"] - none_ledger["device_to_host"]["bytes"]
                back = ledger["host_to_device"]["bytes"] - none_ledger["host_to_device"]["bytes"]
                assert moved == back == LAYERS * per_checkpoint, (where, ledger)
                assert ledger["unpooled"] == none_ledger["unpooled"], where
                if offload == "nvme":
                    # Whole 4 KiB blocks of chunks of a quarter of the 8 KiB buffer.
                    assert ledger["host_to_nvme"]["bytes"] == LAYERS * per_checkpoint, where
                    assert ledger["nvme_to_host"]["bytes"] == LAYERS * per_checkpoint, where
                    assert act["arena"]["nbytes"] == 8192 and act["arena"]["peak_bytes"] <= 8192, where


def _misuse(rank, world, workdir):
    import gc
    import os

    from infinity import registry

    out = {}
    for offload in ("host", "nvme"):
        nvme = os.path.join(workdir, offload)
        os.makedirs(nvme, exist_ok=True)
        with infinity.Init(_config(offload, nvme)):
            model = CheckpointedGPT("wrapper")
        idx = torch.randint(0, 64, (B, T))
        before = infinity.stats(model)["tiers"].get("nvme", {}).get("bytes_in_use", 0)
        loss = model(idx, idx)                     # a forward whose graph is dropped, never backward
        moved = infinity.stats(model)["tiers"].get("nvme", {}).get("bytes_in_use", 0) - before
        del loss
        gc.collect()
        offloader = registry.engine_of(model).activations
        offloader.tier.close()                     # every transfer and free done
        after = infinity.stats(model)["tiers"].get("nvme", {}).get("bytes_in_use", 0)
        out[offload + "-keys"] = (moved, after - before)
        out[offload + "-arena"] = infinity.stats(model)["activations"]["arena"]["bytes_in_use"]
        # A saved tensor used twice (backward(retain_graph=True)) is refused, naming the setting.
        saved = offloader.pack(torch.randn(B, T, D))
        offloader.tier = type(offloader.tier)(offloader.config, offloader.tier.datapath,
                                              registry.engine_of(model).tiers, torch.device("cpu"))
        offloader._move(saved)
        first = offloader.unpack(saved)
        try:
            offloader.unpack(saved)
            out[offload] = "no error"
        except EngineError as exc:
            out[offload] = str(exc)
        out[offload + "-first"] = tuple(first.shape)
        offloader.tier.close()
    return out


def test_activations_are_given_back_without_backward_and_a_second_use_is_refused(tmp_path):
    (out,) = run_ranks(_misuse, 1, tmp_path)
    for offload in ("host", "nvme"):
        assert "used a second time in backward" in out[offload] and "retain_graph" in out[offload], out
        assert out[offload + "-first"] == (B, T, D), out
        assert out[offload + "-arena"] == 0, str(out)
    moved, left = out["nvme-keys"]
    assert moved == LAYERS * B * T * D * 4 and left == 0, out
