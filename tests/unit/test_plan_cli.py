"""``infinity-plan`` end to end (main([...]) in process, one real subprocess) and bench JSON input."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from infinity.cli.plan import main
from infinity.plan import Bandwidth, PlanError

MODEL_SOURCE = (
    "from torch import nn\n"
    "def build():\n"
    "    return nn.Sequential(nn.Linear(100, 300), nn.LayerNorm(300))\n"
    "def broken():\n"
    "    raise RuntimeError('no weights for you')\n"
)


def _bench_record(read_ours=(1.1, 1.6), write_ours=(2.9, 3.2), fio_read=9.0):
    """A result shaped like ``infinity-bench nvme --json`` (infinity/cli/bench.py)."""
    settings = [{"engine": "io_uring", "block_size": 1 << 20, "queue_depth": 8, "threads": 1,
                 "direct": True},
                {"engine": "threads", "block_size": 8 << 20, "queue_depth": 4, "threads": 4,
                 "direct": True}]
    summary, samples = [], []
    for setting, r, w in zip(settings, read_ours, write_ours):
        for op, rate in (("read", r), ("write", w)):
            summary.append({"tool": "ours", "setting": setting, "op": op, "n": 1,
                            "gb_per_s": rate, "cpu_s_per_gb": 0.1})
            samples.append({"tool": "ours", "op": op, "setting": setting, "repeat": 0,
                            "nbytes": 1 << 26, "seconds": (1 << 26) / (rate * 1e9),
                            "gb_per_s": rate})
    summary.append({"tool": "fio", "setting": settings[0], "op": "read", "gb_per_s": fio_read})
    samples.append({"tool": "fio", "op": "read", "setting": settings[0], "gb_per_s": fio_read})
    return {"benchmark": "nvme", "best": {"block_size": 1 << 20, "engine": "threads"},
            "samples": samples, "summary": summary}


@pytest.fixture
def model_module(tmp_path, monkeypatch):
    (tmp_path / "plan_cli_models.py").write_text(MODEL_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "plan_cli_models"


def test_bench_json_takes_best_median_of_our_engine(tmp_path):
    path = tmp_path / "nvme.json"
    path.write_text(json.dumps(_bench_record()))
    bw = Bandwidth.from_bench_json(path)
    # fio's 9 GB/s read is not what the engine does; the best "ours" medians are 1.6 and 3.2.
    assert (bw.read_gbps, bw.write_gbps, bw.source) == (1.6, 3.2, str(path))
    # Without a summary, medians of the raw "ours" samples give the same.
    record = _bench_record()
    del record["summary"]
    path.write_text(json.dumps(record))
    assert Bandwidth.from_bench_json(path).read_gbps == pytest.approx(1.6)
    path.write_text(json.dumps({"best": {"read_gbps": 2.5, "write_gbps": 3.0}}))
    assert Bandwidth.from_bench_json(path) == Bandwidth(2.5, 3.0, str(path))


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "cannot read bench result"),
        ("{not json", "is not JSON"),
        (json.dumps({"summary": [{"tool": "ours", "op": "read", "gb_per_s": 2.0}]}),
         "holds no write rate"),
        (json.dumps({"benchmark": "nvme"}), "holds no read or write rate"),
    ],
)
def test_bad_bench_json(tmp_path, content, match):
    path = tmp_path / "nvme.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(PlanError, match=match):
        Bandwidth.from_bench_json(path)


def test_table_command(capsys, tmp_path):
    out_json = tmp_path / "zero.json"
    assert main(["table", "--params", "7.5e9,128e9,1e12", "--ranks", "1,4,16,64,256,1024",
                 "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert text.count("Model states per rank") == 3
    assert "GB = 1e9 bytes" in text
    line_64 = next(line for line in text.splitlines() if line.split()[:1] == ["64"])
    assert line_64.split() == ["64", "120.0", "31.41", "16.64", "1.88"]
    data = json.loads(out_json.read_text())
    assert len(data["rows"]) == 18 and data["k"] == 12
    assert main(["table", "--params", "7.5B", "--ranks", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["P_os+g+p"] == 1_875_000_000


def test_model_command_text_and_json(capsys, tmp_path, model_module):
    bench = tmp_path / "nvme.json"
    bench.write_text(json.dumps(_bench_record()))
    config = tmp_path / "offload.toml"
    config.write_text(
        f'[tiers]\nparams = "nvme"\noptimizer = "nvme"\nnvme_path = "{tmp_path}"\n'
        '[precision]\ndtype = "bfloat16"\n'
    )
    code = main(["model", "--model", f"{model_module}:build", "--config", str(config),
                 "--ranks", "2", "--bench-json", str(bench)])
    text = capsys.readouterr().out
    # ~1 GiB of host buffers and a few MiB of disk: it fits any machine that runs this suite.
    assert code == 0, text
    assert "Fits this machine" in text and "NO:" not in text
    assert f"Plan for {model_module}:build: 30,900" in text
    assert "GiB = 2^30 bytes" in text and "Step time lower bound from NVMe:" in text
    assert "read 1.60 GB/s, write 3.20 GB/s" in text
    assert main(["model", "--params", "1.3e9", "--config", "offload-host", "--read-gbps", "2",
                 "--write-gbps", "3", "--no-check", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_params"] == 1_300_000_000 and data["params_tier"] == "host"
    assert data["step_time_lower_bound_s"] == 0.0 and data["fit"] is None


def test_model_command_exit_1_when_short(capsys, tmp_path):
    config = tmp_path / "tight.json"
    config.write_text(json.dumps({"tiers": {"optimizer": "nvme", "nvme_path": str(tmp_path),
                                            "host_budget": "1MiB"}}))
    assert main(["model", "--params", "1e6", "--config", str(config)]) == 1
    assert "Fits this machine (1 rank): NO:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["model", "--params", "-5", "--config", "device"], "must be positive"),
        (["model", "--params", "0", "--config", "device"], "must be positive"),
        (["model", "--params", "1e9", "--config", "device", "--ranks", "0"],
         "world_size must be a positive integer"),
        (["model", "--params", "1e9", "--config", "device", "--ranks", "4", "--local-ranks", "3"],
         "must divide world_size"),
        (["model", "--model", "no_such_pkg_for_cli:build", "--config", "device"],
         "cannot import module 'no_such_pkg_for_cli'"),
        (["model", "--model", "plan_cli_models:broken", "--config", "device"],
         "RuntimeError: no weights for you"),
        (["model", "--params", "1e9", "--config", "/nonexistent/x.toml"], "does not load"),
        (["model", "--params", "1e9", "--config", "device", "--read-gbps", "2"],
         "--read-gbps and --write-gbps go together"),
        (["model", "--params", "1e9", "--config", "device", "--bench-json", "/nonexistent.json"],
         "cannot read bench result"),
        (["table", "--params", "7.5e9,-1", "--ranks", "4"], "must be positive"),
        (["table", "--params", "7.5e9", "--ranks", "4,2.5"], "--ranks values must be positive"),
        (["table", "--params", "7.5e9", "--ranks", "4", "--k", "0"], "k .*positive integer"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, model_module, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"infinity-plan {argv[0]}: error: ")
    assert re.search(match, err), err


def test_usage_errors_are_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["model", "--params", "1e9"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--config" in err


def test_console_entry_runs_as_a_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "infinity.cli.plan", "table", "--params", "7.5e9",
         "--ranks", "64"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "1.88" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "infinity.cli.plan", "model", "--model", "nope_pkg_x:build",
         "--config", "device"],
        capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr
    assert "cannot import module 'nope_pkg_x'" in bad.stderr


def test_set_changes_config_keys_and_an_error_names_the_flag_and_the_key(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["model", "--params", "1e6", "--config", "nvme", "--set", f"tiers.nvme_path={tmp_path}",
                 "--set", "aio.direct=false", "--json", str(out)]) == 0
    assert "Fits this machine (1 rank): yes" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["nvme_paths"] == [str(tmp_path)] and record["nvme_direct"] is False
    for flag, says in (("prefetch.enabeld=false", "--set prefetch.enabeld=false: prefetch.enabeld: unknown key; "
                                                  "did you mean prefetch.enabled?"),
                       ("prefetchh.enabled=false", "--set prefetchh.enabled=false: prefetchh: unknown section"),
                       ("aio.queue_depth=lots", "--set aio.queue_depth=lots: aio.queue_depth: expected"),
                       ("prefetch=false", "--set 'prefetch=false': expected section.key=value")):
        assert main(["model", "--params", "1e6", "--config", "nvme", "--set", flag]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"infinity-plan model: error: {says}"), err


@pytest.mark.skipif(__import__("os").path.lexists("/local_nvme"), reason="this machine has a /local_nvme")
def test_the_nvme_presets_placeholder_path_is_said_to_be_one_with_the_flag_to_give_a_directory(capsys):
    assert main(["model", "--params", "1e6", "--config", "nvme"]) == 1
    out = capsys.readouterr().out
    assert "tiers.nvme_path: '/local_nvme' is the nvme preset's placeholder" in out
    assert "infinity-plan --set tiers.nvme_path=DIR" in out and "create it" not in out


def test_a_model_module_in_the_working_directory_is_importable(capsys, tmp_path, monkeypatch):
    """A console script does not see the working directory; --model wd_models:build needed PYTHONPATH=."""
    (tmp_path / "plan_cli_wd_models.py").write_text(MODEL_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert main(["model", "--model", "plan_cli_wd_models:build", "--config", "device"]) == 0, capsys.readouterr().err
    assert "Plan for plan_cli_wd_models:build" in capsys.readouterr().out
