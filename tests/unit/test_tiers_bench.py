"""Smoke run of benchmarks/tier_io.py at a tiny size: it runs, prints its table, writes JSON."""
from __future__ import annotations

import json

from benchmarks import tier_io as bench


def test_tiers_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "tiers.json"
    result = bench.main(["--path", str(tmp_path), "--size", "3MiB", "--repeats", "2", "--pool-buffer", "1MiB",
                         "--pool-buffers", "4", "--move", "6MiB", "--move-pool", "2MiB", "--move-pool-buffer",
                         "1MiB", "--chunk", "1MiB", "--pin", "never", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "staged" in printed and "peak RSS over baseline" in printed
    saved = json.loads(out.read_text())
    assert saved["bandwidth"]["size"] == 3 << 20 and len(saved["bandwidth"]["samples_s"]["raw read"]) == 2
    assert set(saved["bandwidth"]["ratio"]) == {"staged write / raw", "staged read / raw", "direct write / raw",
                                                "direct read / raw"}
    assert result["memory"]["moved_bytes"] == 12 << 20 and result["memory"]["pool_nbytes"] == 2 << 20
    assert [p.name for p in tmp_path.iterdir()] == ["tiers.json"]  # swap files removed


def test_parse_size():
    assert bench.parse_size("1GiB") == 1 << 30 and bench.parse_size("4096") == 4096
    assert bench.parse_size("1.5MiB") == 3 << 19
