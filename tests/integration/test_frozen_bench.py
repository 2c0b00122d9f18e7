"""Smoke run of benchmarks/frozen.py at a tiny size: a base frozen inside Init, or after it before the
optimizer is created, saves its moments and gradients (10 bytes per frozen parameter in bf16 on NVMe: m
4, v 4, gradient 2; 14 in host memory with bf16 values, whose masters need no remainder), trains to the
same losses as one frozen after the optimizer, and holds the same bytes once unfrozen."""
import json

import pytest

from infinity.examples.gpt import GPT, preset
from tests.support.benchmarks import load_benchmark


@pytest.fixture
def bench():
    return load_benchmark("frozen")


@pytest.mark.parametrize("extra, saved", [([], 10), (["--preset", "offload-optimizer", "--bf16-values"], 14)])
def test_frozen_benchmark_tiny(bench, tmp_path, extra, saved):
    out = tmp_path / "frozen.json"
    report = bench.main(["--model", "tiny", "--steps", "2", "--seq", "16", "--workdir", str(tmp_path),
                         "--json", str(out), *extra])
    assert json.loads(out.read_text())["losses_equal"] is True
    assert report["losses_equal_unfrozen"] is True
    inside, before, held = report["rows"]
    # Shards are whole multiples of 2048 elements: a little more than the bytes per frozen parameter.
    assert inside["saved_bytes_per_frozen_param"] == pytest.approx(saved, rel=0.1)
    assert before["tier_bytes"] == inside["tier_bytes"]
    assert inside["tier_bytes_unfrozen"] == before["tier_bytes_unfrozen"] == held["tier_bytes_unfrozen"] \
        == held["tier_bytes"]


def test_frozen_benchmark_bitfit_tiny(bench, tmp_path):
    """BitFit inside Init: each block's group split at Init's exit, the matrices dormant; after Init the
    groups train whole (the optimizer warns), holding every state; the same losses."""
    report = bench.main(["--model", "tiny", "--steps", "2", "--seq", "16", "--workdir", str(tmp_path),
                         "--freeze", "bitfit"])
    assert report["losses_equal"] is True and report["losses_equal_unfrozen"] is True
    inside, before, held = report["rows"]
    assert inside["saved_bytes_per_frozen_param"] == pytest.approx(10, rel=0.1)    # m, v, a bf16 gradient
    # Before the optimizer only the groups frozen whole (the embeddings) are put apart: the blocks' matrices,
    # frozen beside their vectors, keep their 10 bytes.
    blocks = GPT(preset("tiny", seq_len=16)).blocks
    in_blocks = sum(p.numel() for p in blocks.parameters() if p.dim() > 1)
    assert before["tier_bytes"] - inside["tier_bytes"] == pytest.approx(10 * in_blocks, rel=0.05)
