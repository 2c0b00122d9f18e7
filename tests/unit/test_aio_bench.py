"""infinity-bench nvme: a smoke run at a tiny size, its outputs, and its refusals."""
from __future__ import annotations

import json
import shutil

import pytest

from infinity.config import toml_io as _toml
from infinity.cli import bench
from infinity.cli import bench_nvme as nv
from tiers import aio

from tests.support.benchmarks import load_benchmark


def test_smoke_run_writes_json_config_and_plot(tmp_path, capsys) -> None:
    out_json, out_toml, out_png = tmp_path / "r.json", tmp_path / "aio.toml", tmp_path / "r.png"
    args = ["nvme", "--path", str(tmp_path), "--size", "8MiB", "--block-sizes", "1MiB", "--queue-depths", "4",
            "--threads", "2", "--repeats", "1", "--no-progress",
            "--json", str(out_json), "--write-config", str(out_toml), "--plot", str(out_png)]
    fio = shutil.which("fio") is not None
    if fio:
        args.append("--compare-fio")
    assert bench.main(args) == 0
    text = capsys.readouterr().out
    assert "GB/s (decimal" in text and "python buffered" in text and "aiofiles" in text
    assert ("ours/fio read" in text) == fio
    assert sum(line.startswith("* ") for line in text.splitlines()) == 1  # exactly one best row
    record = json.loads(out_json.read_text())
    engines = aio.available_engines()
    tools = {s["tool"] for s in record["samples"]}
    assert tools == {"ours", "python", "aiofiles"} | ({"fio"} if fio else set())
    ours = [s for s in record["samples"] if s["tool"] == "ours"]
    assert len(ours) == 2 * len(engines)  # one write and one read per engine
    assert all(s["nbytes"] == 8 << 20 and s["gb_per_s"] > 0 and s["cpu_s_per_gb"] >= 0 for s in ours)
    assert record["machine"]["engines"] == engines and record["machine"]["kernel"]
    section = _toml.loads(out_toml.read_text())["aio"]
    assert set(section) == {"block_size", "queue_depth", "threads", "engine", "direct"}
    assert section["engine"] in engines and section["direct"] is True
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("infinity-bench-*"))  # the test file was deleted


def test_written_config_loads_and_keeps_other_sections(tmp_path) -> None:
    config = pytest.importorskip("infinity.config")
    target = tmp_path / "offload.toml"
    target.write_text('# mine\n[aio]\nqueue_depth = 2\n\n[prefetch]\nenabled = false\n')
    best = nv.Setting("threads", 1 << 20, 8, 8)
    bench.write_config(str(target), best)
    cfg = config.load_config(target)
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.threads, cfg.aio.engine) == (1 << 20, 8, 8, "threads")
    assert cfg.prefetch.enabled is False and "# mine" in target.read_text()
    js = tmp_path / "c.json"
    bench.write_config(str(js), best)
    assert config.load_config(js).aio.threads == 8
    # an [aio] that no longer loads (an old key, a bad value) is what the write replaces
    target.write_text('[aio]\nqueue_depth = 0\nold_key = 1\n\n[prefetch]\nenabled = false\n')
    with pytest.raises(config.ConfigError, match="aio"):
        config.load_config(target)
    bench.write_config(str(target), best)
    assert config.load_config(target).aio.queue_depth == 8


def test_fio_command_matches_setting() -> None:
    cmd = nv.fio_command("/d/f", 1 << 30, "read", nv.Setting("io_uring", 1 << 20, 32, 4))
    assert "--ioengine=io_uring" in cmd and "--iodepth=32" in cmd and "--bs=1048576" in cmd and "--direct=1" in cmd
    cmd = nv.fio_command("/d/f", 1 << 30, "write", nv.Setting("threads", 1 << 20, 4, 4))
    assert "--ioengine=psync" in cmd and "--numjobs=4" in cmd and f"--size={1 << 28}" in cmd


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--engines", "libaio"], "unknown engine 'libaio'"),
        (["--block-sizes", "1000"], "multiple of 4096"),
        (["--ops", "copy"], "expected write, read"),
        (["--repeats", "0"], "at least 1"),
        (["--size", "4KiB", "--block-sizes", "1MiB"], "at least the largest block size"),
        (["--write-config", "x.yaml"], "expected a .toml or .json"),
    ],
)
def test_bad_arguments(tmp_path, capsys, extra, match) -> None:
    args = ["nvme", "--path", str(tmp_path), "--size", "1MiB", "--block-sizes", "1MiB", "--queue-depths", "1",
            "--threads", "1", "--repeats", "1", "--no-progress", "--no-baselines", "--engines", "threads"]
    assert bench.main(args + extra) == 2
    assert match in capsys.readouterr().err


def test_missing_directory(tmp_path, capsys) -> None:
    assert bench.main(["nvme", "--path", str(tmp_path / "nope"), "--no-progress"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_unparseable_size(tmp_path) -> None:
    with pytest.raises(SystemExit):
        bench.main(["nvme", "--path", str(tmp_path), "--size", "12 furlongs"])


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)")
def test_vs_fio_pairs_tool_smoke(tmp_path, capsys) -> None:

    tool = load_benchmark("nvme")
    out = tmp_path / "pairs.json"
    assert tool.main(["--path", str(tmp_path), "--size", "8MiB", "--pairs", "2", "--block-sizes", "1MiB",
                      "--queue-depth", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], len(r["ours_samples"]), len(r["fio_samples"])) for r in rows] == [("write", 2, 2), ("read", 2, 2)]
    assert all(r["ours"] > 0 and r["fio"] > 0 for r in rows)
    assert "pair-med" in capsys.readouterr().out
    assert not list(tmp_path.glob("infinity-bench-*"))


def test_write_config_onto_a_file_whose_only_fault_is_its_aio_section(tmp_path, capsys) -> None:
    """It was refused before measuring ("the existing file cannot be edited"), though the write replaces it."""
    pytest.importorskip("infinity.config")
    target = tmp_path / "offload.toml"
    target.write_text('[aio]\nengine = "libaio"\n\n[prefetch]\nenabled = false\n')
    args = ["nvme", "--path", str(tmp_path), "--size", "1MiB", "--block-sizes", "1MiB", "--queue-depths", "1",
            "--threads", "1", "--repeats", "1", "--no-progress", "--no-baselines", "--engines", "threads",
            "--write-config", str(target)]
    assert bench.main(args) == 0, capsys.readouterr().err
    text = target.read_text()
    assert 'engine = "threads"' in text and "libaio" not in text and "enabled = false" in text
