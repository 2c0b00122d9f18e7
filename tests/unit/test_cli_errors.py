"""The four commands fail in one line, with exit 2 for wrong input and 1 for failed work, and show a
traceback only under --debug ([Note: command-line errors] in infinity/cli/common.py)."""
from __future__ import annotations

import importlib
import os
import json
import subprocess
import sys

import pytest

import infinity
from infinity.cli import bench, consolidate, plan, report
from tests.support.tiny_gpt import BufferedGPT as GPT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: ") and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "ckpt"
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host"}}):
        model = GPT()
    infinity.save_checkpoint(root, model)
    return root


def test_consolidate_refuses_an_output_inside_the_checkpoint_and_leaves_it_intact(checkpoint, capsys):
    latest = (checkpoint / "latest").read_text()
    version = checkpoint / latest.strip()
    for out in (checkpoint / "latest", checkpoint / "model.pt", version / "model.pt"):
        for source in (checkpoint, version):
            assert consolidate.main([str(source), str(out)]) == 1
            assert "is inside the checkpoint" in one_line_error(capsys, "infinity-consolidate")
    assert (checkpoint / "latest").read_text() == latest
    assert sorted(os.listdir(checkpoint)) == ["latest", latest.strip()]
    infinity.checkpoint.verify_checkpoint(checkpoint)


def test_consolidate_missing_checkpoint_is_a_failure_and_bad_arguments_are_usage_errors(tmp_path, checkpoint,
                                                                                      capsys):
    assert consolidate.main([str(tmp_path / "nothing"), str(tmp_path / "m.pt")]) == 1
    assert "does not exist" in one_line_error(capsys, "infinity-consolidate")
    assert consolidate.main([str(checkpoint), str(tmp_path / "m.pt"), "--buffer-size", "4k"]) == 2
    assert "--buffer-size '4k'" in one_line_error(capsys, "infinity-consolidate")
    # as checkpoint.buffer_size: a positive multiple of 4 KiB, at most 4 GiB (0 used to mean the default)
    for size, says in (("0", "not a positive multiple of 4096"), ("1000", "not a positive multiple of 4096"),
                       ("8GiB", "<= 4GiB")):
        assert consolidate.main([str(checkpoint), str(tmp_path / "m.pt"), "--buffer-size", size]) == 2
        assert f"--buffer-size '{size}'" in (err := one_line_error(capsys, "infinity-consolidate")) and says in err
    assert not (tmp_path / "m.pt").exists()
    library = importlib.import_module("infinity.checkpoint.consolidate")      # sizes as the config takes them
    for size in ("1MiB", 1048576.0):
        library.consolidate(checkpoint, tmp_path / "m.pt", buffer_size=size)
        assert (tmp_path / "m.pt").exists()
    with pytest.raises(SystemExit) as info:
        consolidate.main([str(checkpoint)])
    assert info.value.code == 2
    assert "the following arguments are required: OUT" in one_line_error(capsys, "infinity-consolidate")


def test_an_unexpected_error_is_one_line_naming_its_type_and_debug_shows_the_traceback(tmp_path, checkpoint,
                                                                                     capsys, monkeypatch):
    library = importlib.import_module("infinity.checkpoint.consolidate")     # the module, not the function

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(library, "consolidate", broken)
    assert consolidate.main([str(checkpoint), str(tmp_path / "m.pt")]) == 1
    assert "(KeyError; --debug shows the traceback)" in one_line_error(capsys, "infinity-consolidate")
    with pytest.raises(KeyError, match="a bug"):
        consolidate.main([str(checkpoint), str(tmp_path / "m.pt"), "--debug"])


def test_plan_does_not_say_fits_when_nvme_path_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "no-disk"
    conf = tmp_path / "offload.toml"
    conf.write_text(f'[tiers]\nparams = "nvme"\noptimizer = "nvme"\nnvme_path = "{missing}"\n')
    assert plan.main(["model", "--params", "1e6", "--config", str(conf)]) == 1
    out = capsys.readouterr().out
    assert "Fits this machine (1 rank): NO" in out and f"tiers.nvme_path: '{missing}' does not exist" in out
    missing.mkdir()
    assert plan.main(["model", "--params", "1e6", "--config", str(conf)]) == 0
    assert "Fits this machine (1 rank): yes" in capsys.readouterr().out


def test_plan_bad_config_is_a_usage_error_in_one_line(tmp_path, capsys):
    conf = tmp_path / "bad.toml"
    conf.write_text("[aio]\nqueue_dept = 8\nthread = 2\n")              # two mistakes: two lines, joined
    assert plan.main(["model", "--params", "1e6", "--config", str(conf)]) == 2
    err = one_line_error(capsys, "infinity-plan model")
    assert "aio.queue_dept: unknown key" in err and "; aio.thread: unknown key" in err
    assert plan.main(["model", "--params", "1e6", "--config", str(tmp_path / "none.toml")]) == 2
    one_line_error(capsys, "infinity-plan model")
    with pytest.raises(SystemExit) as info:
        plan.main(["model", "--params"])
    assert info.value.code == 2
    one_line_error(capsys, "infinity-plan model")


def test_consolidate_refuses_an_output_it_cannot_write_before_reading(checkpoint, tmp_path, capsys):
    (tmp_path / "dir").mkdir()
    for out, says in ((tmp_path / "missing" / "m.pt", "does not exist"), (tmp_path / "dir", "is a directory")):
        assert consolidate.main([str(checkpoint), str(out)]) == 1
        assert says in one_line_error(capsys, "infinity-consolidate")


def test_bench_checks_its_outputs_and_sizes_before_the_sweep(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{bad")
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"\xff\xfe[aio]\n")
    other = tmp_path / "x.toml"     # the [aio] it replaces may be anything; the rest must load
    other.write_text("[aio]\nqueue_depth = 0\n\n[prefetch]\nenabled = 3\n")
    for extra, says in ((["--json", str(tmp_path / "no" / "a.json")], "does not exist"),
                        (["--json", str(tmp_path)], "is a directory"),
                        (["--write-config", str(bad)], "the existing file is not JSON"),
                        (["--write-config", str(other)], "prefetch.enabled"),
                        (["--write-config", str(binary)], "is not UTF-8 text")):
        assert bench.main(["nvme", "--path", str(tmp_path), "--size", "16MiB", "--no-progress", *extra]) == 2
        assert says in one_line_error(capsys, "infinity-bench nvme")
    with pytest.raises(SystemExit):
        bench.main(["nvme", "--path", str(tmp_path), "--block-sizes", ","])
    assert "expected comma-separated sizes" in one_line_error(capsys, "infinity-bench nvme")


def test_report_and_bench_bad_paths_are_usage_errors(tmp_path, capsys):
    assert report.main(["--path", str(tmp_path / "nope")]) == 2
    one_line_error(capsys, "infinity-report")
    assert bench.main(["nvme", "--path", str(tmp_path / "nope"), "--no-progress"]) == 2
    assert "not a directory" in one_line_error(capsys, "infinity-bench nvme")
    with pytest.raises(SystemExit) as info:
        bench.main(["nvme"])
    assert info.value.code == 2
    one_line_error(capsys, "infinity-bench nvme")


def test_installed_command_prints_no_traceback(tmp_path):
    code = "import sys; from infinity.cli.consolidate import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "none"), str(tmp_path / "m.pt")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("infinity-consolidate: error: no checkpoint at ")


def test_consolidate_onto_a_full_disk_names_the_file_the_bytes_and_cleans_up(tmp_path, checkpoint, capsys,
                                                                            monkeypatch):
    """A full disk gave only "[Errno 28]"; now the one line names the output, ENOSPC, the bytes it needs and
    the room, and no partial file stays."""
    import errno

    import importlib

    module = importlib.import_module("infinity.checkpoint.consolidate")

    def full(fd, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(module.os, "fsync", full)
    out = tmp_path / "model.safetensors"
    assert consolidate.main([str(checkpoint), str(out)]) == 1
    err = one_line_error(capsys, "infinity-consolidate")
    assert str(out) in err and "(ENOSPC)" in err and "the output needs" in err and "free" in err, err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_a_bench_stopped_by_sigterm_removes_its_test_file(tmp_path):
    """A scheduler stops a job with SIGTERM, which skipped the bench's cleanup: its test file (2 GiB by default)
    stayed on the disk. SIGTERM now unwinds as Ctrl-C does: the file goes, and the exit says so (143)."""
    import signal
    import time

    bench = subprocess.Popen([sys.executable, "-m", "infinity.cli.bench", "nvme", "--path", str(tmp_path),
                              "--size", "32MiB", "--repeats", "50", "--no-baselines", "--no-progress",
                              "--engines", "threads"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith("infinity-bench-") for p in tmp_path.iterdir()):
        assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
        time.sleep(0.05)
    bench.send_signal(signal.SIGTERM)
    _, err = bench.communicate(timeout=60)
    assert bench.returncode == 143 and "terminated" in err, (bench.returncode, err)
    assert not list(tmp_path.iterdir())


def test_a_bench_on_a_filesystem_that_refuses_o_direct_names_buffered(tmp_path, monkeypatch, capsys):
    """The error named the engine's config key and a test file already deleted, exit 1; it names the flag that
    measures such a disk, as a usage error (exit 2), and leaves nothing behind."""
    import errno as errno_mod

    from infinity.cli import bench

    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno_mod.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    code = bench.main(["nvme", "--path", str(tmp_path), "--size", "16MiB", "--repeats", "1", "--no-baselines",
                       "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "refuses O_DIRECT; measure it with --buffered" in err, (code, err)
    assert not list(tmp_path.iterdir())


def test_json_outputs_are_checked_first_and_written_whole(tmp_path, capsys):
    """--json into a missing directory printed the whole table, then failed with a bare OS error (exit 1); and the
    file was truncated before it was written, through a symlink at its name. Now it is refused first, naming
    --json (exit 2), and written beside its name and renamed over it (the symlink replaced, not followed)."""
    from infinity.cli import plan as plan_cli

    code = plan_cli.main(["table", "--params", "1B", "--ranks", "1", "--json", str(tmp_path / "none" / "x.json")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "--json" in err and "does not exist" in err, (code, out, err)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")
    assert plan_cli.main(["table", "--params", "1B", "--ranks", "1", "--json", str(link)]) == 0
    capsys.readouterr()
    assert not link.is_symlink() and not (tmp_path / "target.json").exists()
    assert json.loads(link.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json"]
