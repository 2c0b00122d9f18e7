"""benchmarks/stages.py at a tiny size on two gloo ranks: every stage's row, and its figures agreeing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_stages_benchmark_rows_and_comm_against_the_paper(tmp_path):
    out = tmp_path / "stages.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "stages.py"), "--worlds", "2",
                           "--layers", "1", "--d-model", "64", "--vocab", "256", "--seq", "16", "--steps", "2",
                           "--rounds", "1", "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0].split()[:3] == ["N", "stage", "s/step"]
    rows = json.loads(out.read_text())["worlds"]["2"]
    assert sorted(rows) == ["1", "2", "3"]
    for stage, r in rows.items():
        sent = r["comm"]["all_gather_bytes"] + r["comm"]["reduce_scatter_bytes"]
        assert r["s_per_step"] > 0 and sent >= r["comm_paper"] > 0, (stage, r)
        assert r["measured"]["device"] > 0 and r["plan"]["device"] > 0, (stage, r)
    # Stages 1 and 2 send the same (one all-gather, one reduce-scatter per step), stage 3 more.
    sent = {s: r["comm"]["all_gather_bytes"] + r["comm"]["reduce_scatter_bytes"] for s, r in rows.items()}
    assert sent["1"] == sent["2"] < sent["3"], sent
