"""The scale benchmark's arithmetic on small Llama-shaped models.

The 6.7B run (benchmarks/scale.py) is too big for the suite; here the same model code, the
same config (bf16 compute, parameters and optimizer on NVMe, int8 moments) and the same
save-and-resume path run on ``llama-tiny``: the shape's parameter count is exact, the plan's
stored NVMe bytes match what the engine's tiers hold, and a checkpoint resumed in a fresh
engine gives the loss the uninterrupted run has at the same step.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infinity.config import load_config
from infinity.examples.llama import LLAMA_PRESETS, Llama
from infinity.examples.train_gpt import TrainOptions, train
from infinity.plan import plan

CONFIG = str(Path(__file__).resolve().parents[2] / "benchmarks" / "scale_nvme_int8.toml")


@pytest.mark.parametrize("name", sorted(LLAMA_PRESETS))
def test_parameter_count_is_exact(name):
    cfg = LLAMA_PRESETS[name]
    with torch.device("meta"):
        model = Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params


def test_the_large_preset_is_the_llama_6p7b_shape():
    cfg = LLAMA_PRESETS["llama-6.7B"]
    assert (cfg.d_model, cfg.n_layer, cfg.n_head, cfg.intermediate, cfg.vocab_size) == (4096, 32, 32, 11008, 32000)
    assert 6.7e9 < cfg.n_params < 6.8e9


def _options(tmp_path, name: str, steps: int, **kw) -> TrainOptions:
    return TrainOptions(config=CONFIG, model_size="llama-tiny", steps=steps, batch=1, seq=32, data="repeat",
                        lr=1e-3, nvme_dir=str(tmp_path / name), progress="none", quiet=True, **kw)


def test_plan_matches_the_engine_and_a_resumed_checkpoint_continues_exactly(tmp_path):
    reference = train(_options(tmp_path, "ref", 3))
    losses = [s["loss"] for s in reference["steps"]]
    assert all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) == 3

    n = LLAMA_PRESETS["llama-tiny"].n_params
    config = load_config(CONFIG, overrides={"tiers": {"nvme_path": str(tmp_path / "ref")}})
    predicted = plan(n, config, check_fit=False).to_dict()["tier_bytes"]["nvme"]
    held = reference["summary"]["tier_peak_bytes"]["nvme"]
    assert held == pytest.approx(predicted, rel=0.15), (held, predicted)

    saved = train(_options(tmp_path, "save", 2, checkpoint=str(tmp_path / "ckpt")))
    assert [s["loss"] for s in saved["steps"]] == losses[:2]
    resumed = train(_options(tmp_path, "resume", 1, resume=str(tmp_path / "ckpt")))
    assert resumed["steps"][0]["loss"] == losses[2]
