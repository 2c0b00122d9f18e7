"""Memory over many steps with activations offloaded: every buffer the engine lends from stays the size
it reached after the first steps (constant-size or grown once to a high-water mark), and the NVMe tier
holds the same bytes after every step (activation keys all given back)."""
import pytest
import torch

import infinity
from tests.distributed.test_activations import B, T, CheckpointedGPT


def _buffers(stats: dict) -> dict:
    act = stats["activations"]["arena"]
    gather = stats["gather_memory"]
    return {"activation_arena": (act["nbytes"], act["peak_bytes"]), "gather_arena": (gather["nbytes"], gather["peak_bytes"]),
            "nvme_in_use": stats["tiers"].get("nvme", {}).get("bytes_in_use"),
            "host_in_use": stats["tiers"]["host"]["bytes_in_use"]}


@pytest.mark.parametrize("offload", ["host", "nvme"])
def test_buffers_are_flat_over_many_steps(tmp_path, offload):
    cfg = {"tiers": {"device": "cpu", "nvme_path": str(tmp_path)}, "aio": {"direct": False},
           "activations": {"offload": offload, "min_nbytes": 1024, "prefetch_bytes": 4096, "buffer_bytes": 8192}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = CheckpointedGPT("wrapper")
    opt = infinity.AdamW(model, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    seen = []
    for step in range(30):
        idx = torch.randint(0, 64, (B, T), generator=g)
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        seen.append(_buffers(infinity.stats(model)))
    assert all(s == seen[2] for s in seen[2:]), (seen[2], [(i, s) for i, s in enumerate(seen) if s != seen[2]][:3])
    assert infinity.stats(model)["activations"]["total"]["offloaded_tensors"] == 30 * 3


def test_prefetch_bytes_zero_fetches_each_activation_when_backward_uses_it(tmp_path):
    """No look-ahead: nothing is fetched before backward asks (so no fetched input waits beside the
    recompute before it), and the losses are those of no offload."""
    losses = {}
    for offload in ("none", "nvme"):
        cfg = {"tiers": {"device": "cpu", "nvme_path": str(tmp_path / offload)}, "aio": {"direct": False},
               "activations": {"offload": offload, "min_nbytes": 1024, "prefetch_bytes": 0, "buffer_bytes": 8192}}
        (tmp_path / offload).mkdir()
        torch.manual_seed(0)
        with infinity.Init(cfg):
            model = CheckpointedGPT("wrapper")
        opt = infinity.AdamW(model, lr=1e-3)
        g = torch.Generator().manual_seed(0)
        losses[offload] = []
        for _ in range(3):
            idx = torch.randint(0, 64, (B, T), generator=g)
            loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[offload].append(loss.item())
        stats = infinity.stats(model)["activations"]
        infinity.release(model)
    assert losses["nvme"] == losses["none"]
    assert stats["last"]["prefetched"] == 0 and stats["last"]["demand_fetches"] == stats["last"]["offloaded_tensors"] == 3
