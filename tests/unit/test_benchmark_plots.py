"""benchmarks/plots.py: the stored runs draw every figure, the committed SVGs are what the data draws now, and a
stored row without its provenance is refused, naming the file and the row."""
from __future__ import annotations

import json

import pytest

from tests.support.benchmarks import load_benchmark

pytest.importorskip("matplotlib", reason="the figures need matplotlib (the test and plot extras)")

PLOTS = load_benchmark("plots")
FIGURES = ["deepspeed-nvme-step-seconds.svg", "gpu-step-seconds.svg", "bytes-per-parameter.svg"]


@pytest.fixture(scope="module")
def redrawn(tmp_path_factory):
    out = tmp_path_factory.mktemp("img")
    assert PLOTS.main(["--out", str(out)]) == 0
    return out


def test_stored_runs_draw_every_figure(redrawn):
    assert sorted(p.name for p in redrawn.iterdir()) == sorted(FIGURES)
    for name in FIGURES:
        svg = (redrawn / name).read_text(encoding="utf-8")
        assert svg.startswith("<?xml") and "<dc:date>" not in svg and "benchmarks/plots.py" in svg, name
    # Every stored run says where it came from, and each figure shows what it draws from.
    steps = (redrawn / "gpu-step-seconds.svg").read_text(encoding="utf-8")
    assert "GPT 350M, bfloat16, batch 8 x 1024" in steps and "DeepSpeed ZeRO-3 offload" in steps
    assert "2026-11-28 a27579a" in steps and "failed" in steps
    traffic = (redrawn / "bytes-per-parameter.svg").read_text(encoding="utf-8")
    assert "NVMe written" in traffic and "16.09 + 14.08" in traffic and "9.03 + 6.03" in traffic


def test_committed_figures_are_current(redrawn):
    for name in FIGURES:
        committed = PLOTS.IMG_DIR / name
        assert committed.exists() and committed.read_bytes() == (redrawn / name).read_bytes(), (
            f"docs/benchmarks/img/{name} is stale: run  python benchmarks/plots.py  and commit the figures "
            f"(matplotlib's version changes the bytes too; they were drawn with the one the test extra installs)")


def test_every_stored_run_has_its_provenance():
    for run in PLOTS.load(sorted(PLOTS.DATA_DIR.glob("*.json"))):
        p = run.provenance
        assert p["date"][:4] == "2026" and p["machine"] and p["command"], (run.file, run.index)
        assert "source" in p and p["source"].startswith("transcribed from docs/benchmarks/"), (run.file, run.index)


def _write(path, runs):
    path.write_text(json.dumps({"runs": runs}), encoding="utf-8")
    return path


def _run(**provenance):
    return {"provenance": provenance, "settings": {"dtype": "bfloat16", "batch": 1, "seq": 8},
            "rows": [{"size": "tiny", "config": "torch", "error": None, "step_seconds": 0.5},
                     {"size": "tiny", "config": "nvme", "error": None, "step_seconds": 0.7}]}


FULL = {"date": "2026-12-07", "machine": "a CPU", "commit": None, "command": "python benchmarks/gpu.py"}


def test_a_row_without_provenance_is_refused_naming_file_and_row(tmp_path, capsys):
    lacking = {k: v for k, v in FULL.items() if k != "date"}
    path = _write(tmp_path / "runs.json", [_run(**FULL), _run(**lacking)])
    with pytest.raises(PLOTS.ProvenanceError, match=r"runs\.json: run 1, row 0 \(tiny torch\): provenance lacks date"):
        PLOTS.load([path])
    assert PLOTS.main(["--out", str(tmp_path / "img"), str(path)]) == 2
    assert "run 1, row 0 (tiny torch): provenance lacks date" in capsys.readouterr().err
    assert not (tmp_path / "img").exists()
    # A row's own provenance completes its run's; an empty command counts as none; commit must be present.
    completed = _run(**lacking)
    completed["rows"][1]["provenance"] = {"date": "2026-12-07", "command": ""}
    with pytest.raises(PLOTS.ProvenanceError, match=r"run 0, row 0 \(tiny torch\): provenance lacks date;"):
        PLOTS.load([_write(tmp_path / "partial.json", [completed])])
    completed["rows"][0]["provenance"] = {"date": "2026-12-07"}
    with pytest.raises(PLOTS.ProvenanceError, match=r"run 0, row 1 \(tiny nvme\): provenance lacks command"):
        PLOTS.load([_write(tmp_path / "partial.json", [completed])])
    no_commit = {k: v for k, v in FULL.items() if k != "commit"}
    with pytest.raises(PLOTS.ProvenanceError, match=r"row 0 \(tiny torch\): provenance lacks commit"):
        PLOTS.load([_write(tmp_path / "commit.json", [_run(**no_commit)])])


def test_a_run_as_gpu_py_writes_it_draws_its_steps_and_its_ledger(tmp_path):
    run = _run(**FULL)
    run["rows"][1].update(n_params=1000, nvme_per_parameter={"read": 8.5, "written": 6.0},
                          transfers={"host_to_device": {"bytes": 4000}, "device_to_host": {"bytes": 2000}})
    path = tmp_path / "one.json"
    path.write_text(json.dumps(run), encoding="utf-8")
    assert PLOTS.main(["--out", str(tmp_path / "img"), str(path)]) == 0
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == ["bytes-per-parameter.svg", "one-step-seconds.svg"]
    traffic = (tmp_path / "img" / "bytes-per-parameter.svg").read_text(encoding="utf-8")
    assert "8.50 + 6.00 + 4.00 + 2.00" in traffic and "host-&gt;device" in traffic
