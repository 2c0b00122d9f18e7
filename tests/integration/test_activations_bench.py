"""Smoke run of benchmarks/activations.py at a tiny size: each setting in its own process, identical
losses, its table printed and its JSON written."""
import json

from tests.support.benchmarks import load_benchmark


def test_activations_benchmark_tiny(tmp_path, capsys):
    bench = load_benchmark("activations")
    out = tmp_path / "activations.json"
    rc = bench.main(["--path", str(tmp_path), "--layers", "2", "--d-model", "64", "--batch", "2", "--seq", "256",
                     "--vocab", "128", "--steps", "2", "--threads", "1", "--buffer-bytes", "64KiB",
                     "--prefetch-bytes", "64KiB", "--buffered", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "checkpointed activations 0.2 MiB per step" in table and "peak RSS MiB" in table
    result = json.loads(out.read_text())
    runs = {r["mode"]: r for r in result["runs"]}
    assert set(runs) == {"none", "host", "nvme"}
    assert runs["host"]["losses"] == runs["nvme"]["losses"] == runs["none"]["losses"]
    assert result["checkpoint_nbytes"] == 2 * 2 * 256 * 64 * 4
    for mode in ("host", "nvme"):
        assert runs[mode]["activations"]["total"]["offloaded_bytes"] == 2 * result["checkpoint_nbytes"]
        assert len(runs[mode]["rss_per_step"]) == 2 and runs[mode]["peak_rss"] > 0
