"""Smoke run of benchmarks/tiling.py at a tiny size: it runs its modes, prints its table, writes its JSON."""
import json

from tests.support.benchmarks import load_benchmark


def test_tiling_benchmark_tiny(tmp_path, capsys):
    bench = load_benchmark("tiling")
    out = tmp_path / "tiling.json"
    rc = bench.main(["--in-features", "255", "--out-features", "512", "--batch", "2", "--tiles", "4",
                     "--optimizer", "host", "--path", str(tmp_path), "--iters", "1", "--warmup", "1",
                     "--rounds", "1", "--threads", "1", "--torch", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "gathered MiB" in table and "tiles=4" in table and "untiled" in table
    assert "plain PyTorch, no engine: TiledLinear(4 tiles)" in table
    result = json.loads(out.read_text())
    rows = {r["mode"]: r for r in result["summary"]}
    assert rows["untiled"]["peak_gathered_MiB"] == 512 * 256 * 4 / 2**20
    assert rows["tiles=4"]["peak_gathered_MiB"] <= 2 * 128 * 256 * 4 / 2**20
    assert result["runs"]["4"][0]["layer"] == "TiledLinear" and result["runs"]["0"][0]["layer"] == "Linear"
    assert len(result["torch"]["4"]["tiled_seconds"]) == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tiling-")], "swap directories are removed"
