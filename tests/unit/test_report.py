"""infinity-report: every probe runs on this machine, the screen and the JSON agree, failures are findings."""
from __future__ import annotations

import json
import sys

import pytest

from infinity.cli import report


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    return report.gather(tmp_path_factory.mktemp("report"))


def test_gather_covers_every_part(gathered):
    assert set(gathered) == {"versions", "cuda", "path", "io", "numa", "host"}
    assert gathered["versions"]["infinity"] and gathered["versions"]["torch"]
    assert gathered["versions"]["aio_core"], "the aio extension reports its version"
    assert isinstance(gathered["cuda"]["available"], bool) and isinstance(gathered["cuda"]["pinned_memory"], bool)
    assert gathered["path"]["free_bytes"] > 0 and gathered["path"]["total_bytes"] >= gathered["path"]["free_bytes"]
    assert isinstance(gathered["path"]["o_direct"], bool) and gathered["path"]["o_direct_detail"]
    assert gathered["host"]["memory_total_bytes"] > 0
    json.dumps(gathered)


def test_thread_pool_engine_really_works_here(gathered):
    # The thread pool is the fallback that must work everywhere; the report proves it with real I/O.
    threads = gathered["io"]["threads"]
    assert threads == {"allowed": True, "works": True, "detail": threads["detail"]}
    assert threads["detail"].startswith("4 KiB written and read back")
    assert gathered["io"]["io_uring"]["allowed"] in (True, False)
    assert gathered["io"]["gpudirect"]["works"] in (True, False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sysfs and /proc/mounts are Linux")
def test_linux_facts(gathered):
    assert gathered["path"]["fstype"], "the mount holding the path is found in /proc/mounts"
    assert gathered["numa"]["nodes"] and gathered["numa"]["nodes"][0]["node"] == 0
    assert isinstance(gathered["numa"]["libnuma"]["loads"], bool)


def test_screen_fits_and_names_everything(gathered):
    text = report.render(gathered)
    assert len(text.splitlines()) <= 30
    for word in ("infinity", "torch", "CUDA", "pinned mem", "io_uring", "threads", "GPUDirect", "O_DIRECT",
                 "free", "NUMA", "libnuma"):
        assert word in text, word


def test_render_shows_gpus(gathered):
    fake = json.loads(json.dumps(gathered))
    fake["cuda"].update(available=True, cuda_version="12.8", pinned_memory=True, pinned_detail="allocated",
                        gpus=[{"index": 0, "name": "NVIDIA H100", "memory_bytes": 80 << 30, "capability": "9.0",
                               "numa_node": 1}])
    text = report.render(fake)
    assert "GPU 0" in text and "NVIDIA H100, 80.0 GiB, compute 9.0, NUMA node 1" in text and "yes, CUDA 12.8" in text


def test_main_json_on_stdout_and_in_a_file(tmp_path, capsys):
    assert report.main(["--path", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["path"]["path"] == str(tmp_path.resolve())
    out_file = tmp_path / "r.json"
    assert report.main(["--path", str(tmp_path), "--json", str(out_file)]) == 0
    assert "O_DIRECT" in capsys.readouterr().out
    assert json.loads(out_file.read_text())["versions"]["infinity"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".infinity-report-")], "probe files removed"


def test_main_refuses_a_missing_path(tmp_path, capsys):
    assert report.main(["--path", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"infinity-report: error: --path {tmp_path / 'nope'} does not exist\n"
    (tmp_path / "afile").write_text("")
    assert report.main(["--path", str(tmp_path / "afile")]) == 2
    assert "afile is not a directory" in capsys.readouterr().err


def test_falls_back_to_the_extension_without_the_python_face(tmp_path, monkeypatch):
    import tiers

    monkeypatch.setitem(sys.modules, "tiers.aio", None)  # makes `from tiers import aio` raise ImportError
    monkeypatch.delattr(tiers, "aio", raising=False)
    io = report.io_engines(tmp_path, direct=False)
    assert io["listed_by"] == "tiers._aio.engines()"
    assert io["threads"] == {"allowed": True, "works": None, "detail": "allowed; not probed (tiers.aio missing)"}


def test_a_failing_engine_is_a_finding(tmp_path, monkeypatch):
    from tiers import aio

    def refuse(*args, **kwargs):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(aio, "AioHandle", refuse)
    works, detail = report._probe_engine("threads", tmp_path, direct=False)
    assert works is False and "Function not implemented" in detail
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
def test_pinned_memory_on_a_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: pinned host memory is only checked with a GPU present")
    info = report.cuda()
    assert info["available"] and info["pinned_memory"] and info["gpus"]
