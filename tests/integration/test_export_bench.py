"""Smoke run of benchmarks/export.py at a tiny size: both ways give the same state dict, and
``infinity.state_dict`` gathers no more at once than the largest group, ``gathered`` the whole model."""
import json

from tests.support.benchmarks import load_benchmark


def test_export_benchmark_tiny(tmp_path):
    out = tmp_path / "export.json"
    report = load_benchmark("export").main(["--model", "tiny", "--rounds", "1", "--json", str(out)])
    assert json.loads(out.read_text())["equal"] is True
    ways = report["ways"]
    whole = report["parameters"] * 2        # bf16
    assert ways["infinity.state_dict"]["peak_gathered_bytes"] <= report["largest_group_bytes"] < whole
    assert ways["gathered + state_dict()"]["peak_gathered_bytes"] >= whole
