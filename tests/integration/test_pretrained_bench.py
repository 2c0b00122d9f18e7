"""Smoke run of benchmarks/pretrained.py at a tiny size: each load in its own process, the table and JSON."""
import json

import pytest

from tests.support.benchmarks import load_benchmark


pytestmark = pytest.mark.hf     # `make test-latest` runs these against the newest releases
pytest.importorskip("transformers")


def test_pretrained_benchmark_tiny(tmp_path, capsys):
    bench = load_benchmark("pretrained")
    (tmp_path / "nvme").mkdir()
    out = tmp_path / "pretrained.json"
    bench.main(["--dir", str(tmp_path / "ckpt"), "--path", str(tmp_path / "nvme"), "--write", "--hidden", "32",
                "--shard-size", "20KB", "--repeats", "1", "--host-budget", "1GiB", "--json", str(out)])
    table = capsys.readouterr().out
    assert "peak RSS GB" in table and "infinity" in table and "plain" in table
    result = json.loads(out.read_text())
    assert len(result["samples"]) == 2 and result["largest_file_bytes"] < result["checkpoint_bytes"]
    for mode in ("plain", "infinity"):
        assert result["medians"][mode]["seconds"] > 0 and result["medians"][mode]["max_rss"] > 0
