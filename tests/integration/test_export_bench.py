"""Smoke runs of benchmarks/export.py and benchmarks/save_pretrained.py at a tiny size: both ways give the same
state dict (the same files), and ``infinity.state_dict`` gathers no more at once than the largest group,
``gathered`` the whole model."""
import json

import pytest

from tests.support.benchmarks import load_benchmark


def test_export_benchmark_tiny(tmp_path):
    out = tmp_path / "export.json"
    report = load_benchmark("export").main(["--model", "tiny", "--rounds", "1", "--json", str(out)])
    assert json.loads(out.read_text())["equal"] is True
    ways = report["ways"]
    whole = report["parameters"] * 2        # bf16
    assert ways["infinity.state_dict"]["peak_gathered_bytes"] <= report["largest_group_bytes"] < whole
    assert ways["gathered + state_dict()"]["peak_gathered_bytes"] >= whole


@pytest.mark.hf
def test_save_pretrained_benchmark_tiny(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "save.json"
    report = load_benchmark("save_pretrained").main(["--dir", str(tmp_path / "dirs"), "--hidden", "32",
                                                      "--rounds", "2", "--json", str(out)])
    assert json.loads(out.read_text())["equal"] is True and report["files_bytes"] > 0
    assert set(report["ways"]) == {"save_pretrained(state_dict=infinity.state_dict)", "infinity.save_pretrained"}
    assert all(len(v) == 2 for v in report["samples"]["seconds"].values())
    assert not (tmp_path / "dirs").exists()
