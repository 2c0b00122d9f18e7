"""Smoke run of benchmarks/in_backward.py at a tiny size: equal losses, the update during backward moving
fewer NVMe bytes than the ordinary step, and the plan (with the tied head's holders) agreeing."""
import json

import pytest

from tests.support.benchmarks import load_benchmark


@pytest.fixture
def bench():
    return load_benchmark("in_backward")


def test_in_backward_benchmark_tiny(bench, tmp_path):
    out = tmp_path / "in_backward.json"
    result = bench.main(["--model", "tiny", "--steps", "2", "--seq", "16", "--sub-group-size", "4096",
                         "--workdir", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text())["equal_losses"] is True
    modes = result["modes"]
    assert modes["in_backward"]["subs_in_backward"] > 0 and modes["in_backward"]["fresh_shards_served"] > 0
    # No gradient written or read (2 + 2 B/param): both modes hand the compute copies over from host memory.
    assert modes["in_backward"]["nvme_moved_per_param"] == pytest.approx(modes["ordinary"]["nvme_moved_per_param"] - 4,
                                                                         abs=0.05)
    for mode in modes.values():
        assert mode["nvme_moved_per_param"] == pytest.approx(mode["plan_with_uses_moved_per_param"], rel=0.05)
