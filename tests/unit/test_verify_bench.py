"""Smoke run of benchmarks/verify.py at a tiny size: it runs, prints its table, writes JSON, leaves no file."""
from __future__ import annotations

import json

from benchmarks import verify as bench


def test_verify_benchmark_smoke(tmp_path, capsys):
    out = tmp_path / "verify.json"
    result = bench.main(["--path", str(tmp_path), "--total", "2MiB", "--block", "512KiB", "--repeats", "2",
                         "--json", str(out)])
    printed = capsys.readouterr().out
    assert "verify off vs on" in printed and "overhead" in printed and "CRC-32 alone" in printed
    saved = json.loads(out.read_text())
    assert saved["blocks"] == 4 and len(saved["samples_s"]["on read"]) == 2
    assert set(result["overhead"]) == {"write", "read"}
    assert [p.name for p in tmp_path.iterdir()] == ["verify.json"]   # swap files removed
