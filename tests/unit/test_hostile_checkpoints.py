"""A checkpoint is data, never code ([Note: a checkpoint is data] in infinity/checkpoint/reader.py).

A checkpoint whose ``extra`` names code (a pickle that calls a function when loaded, as a downloaded or
edited checkpoint can: its CRC-32s are recomputed by anyone) is refused before anything is loaded, and the
code does not run; only ``trust_extra=True`` unpickles it in full. Plain ``extra`` round-trips unchanged.
"""
from __future__ import annotations

import os
import stat

import pytest
import torch

import infinity
from infinity.checkpoint.errors import CheckpointUntrustedError
from tests.support.tiny_gpt import TinyGPT, trained_on_host


class _Planted:
    """What an attacker's pickle does on load: here, make a directory (a shell command in the wild)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _trained(tmp_path):
    return trained_on_host()


def test_an_extra_that_names_code_is_refused_and_runs_nothing(tmp_path):
    model, opt = _trained(tmp_path)
    marker = str(tmp_path / "code-ran")
    with pytest.warns(RuntimeWarning, match="will refuse it unless called with trust_extra=True"):
        infinity.save_checkpoint(tmp_path / "ckpt", model, opt, extra=_Planted(marker))
    infinity.checkpoint.verify_checkpoint(tmp_path / "ckpt")      # valid bytes: the CRCs cannot tell
    steps = opt.step_count
    with pytest.raises(CheckpointUntrustedError, match=r"extra\.pt: the saved `extra` is not plain data .* "
                                                       r"trust_extra=True"):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert not os.path.exists(marker), "the checkpoint's code ran on load"
    assert opt.step_count == steps and not infinity.registry.engine_of(model, "test").damaged
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt, trust_extra=True)     # the documented opt-in
    assert os.path.isdir(marker)
    infinity.release(model)


def test_a_plain_extra_round_trips_unchanged(tmp_path):
    model, opt = _trained(tmp_path)
    extra = {"epoch": 3, "lr": 0.25, "name": "run-7", "seen": [1, 2, 3], "pair": (4, "x"),
             "rng": torch.arange(5), "nested": {"best": 1.5, "none": None, "flag": True}}
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt, extra=extra)
    got = infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert got.keys() == extra.keys()
    for key, value in extra.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value)
        else:
            assert got[key] == value, key
    infinity.release(model)


def _edit(version, rel, change):
    """Change the JSON manifest ``rel`` of a checkpoint version as an attacker would, CRC-32 recomputed in COMMIT."""
    import json
    import zlib

    path = os.path.join(version, rel)
    with open(path) as f:
        data = json.load(f)
    change(data)
    raw = (json.dumps(data) + "\n").encode()
    with open(path, "wb") as f:
        f.write(raw)
    commit_path = os.path.join(version, "COMMIT")
    with open(commit_path) as f:
        commit = json.load(f)
    if rel in commit.get("manifests", {}):
        commit["manifests"][rel] = zlib.crc32(raw)
    with open(commit_path, "w") as f:
        json.dump(commit, f)


@pytest.mark.parametrize("field,value,said", [
    ("path", "../../secret", "is not rank<N>/<name> inside the checkpoint"),
    ("path", "/etc/passwd", "is not rank<N>/<name> inside the checkpoint"),
    ("path", "rank0/../../secret", "is not rank<N>/<name> inside the checkpoint"),
    ("chunk_nbytes", 1, "chunk size 1 is not one a save writes"),
    ("nbytes", -5, "size -5 out of range"),
    ("nbytes", "12", "str where an integer belongs"),
])
def test_a_manifest_field_that_leaves_the_checkpoint_or_is_out_of_range_is_refused(tmp_path, field, value, said):
    """Record paths were joined to the version directory unchecked (``../../x`` read any file the process could,
    and with ``chunk_nbytes = 1`` the CRC messages leaked it a byte per run); every field of a file record is now
    checked before use, and no error echoes bytes found in a file."""
    import time

    model, opt = _trained(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef")
    version = infinity.save_checkpoint(tmp_path / "a" / "b" / "ckpt", model, opt, extra={"epoch": 1})

    def change(manifest):
        manifest["files"]["extra"][field] = value

    _edit(version, os.path.join("rank0", "manifest.json"), change)
    for call in (lambda: infinity.load_checkpoint(version, model, opt),
                 lambda: infinity.checkpoint.verify_checkpoint(version)):
        started = time.perf_counter()
        with pytest.raises(infinity.checkpoint.CheckpointCorruptError, match=said) as info:
            call()
        assert time.perf_counter() - started < 1.0
        assert "found" not in str(info.value) and "0123456789" not in str(info.value)
    infinity.release(model)


def test_a_symlink_planted_in_a_checkpoint_is_not_followed_out_of_it(tmp_path):
    model, opt = _trained(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef")
    version = infinity.save_checkpoint(tmp_path / "ckpt", model, opt, extra={"epoch": 1})
    target = os.path.join(version, "rank0", "extra.pt")
    os.unlink(target)
    os.symlink(secret, target)
    with pytest.raises(infinity.checkpoint.CheckpointCorruptError, match="leads outside the checkpoint"):
        infinity.load_checkpoint(version, model, opt)
    infinity.release(model)


def test_an_absurd_world_size_is_refused_before_anything_is_built(tmp_path):
    """``world_size = 10**9`` in COMMIT built a list of a billion manifest paths first (20 s, 2.6 GiB)."""
    import json
    import time

    model, opt = _trained(tmp_path)
    version = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    commit_path = os.path.join(version, "COMMIT")
    with open(commit_path) as f:
        commit = json.load(f)
    commit["world_size"] = 10 ** 9
    with open(commit_path, "w") as f:
        json.dump(commit, f)
    started = time.perf_counter()
    with pytest.raises(infinity.checkpoint.CheckpointCorruptError, match="world size 1000000000 is not 1 to"):
        infinity.load_checkpoint(version, model, opt)
    assert time.perf_counter() - started < 1.0
    infinity.release(model)


# -- files on a shared disk --------------------------------------------------------------------------------

def _nvme_cfg(path):
    return {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(path), "pool_buffer_size": "256KiB",
                      "pool_buffers": 4}, "aio": {"engine": "threads"}}


def test_a_lock_file_planted_as_a_symlink_is_not_followed(tmp_path):
    """Another user who pre-creates ``nvme_path/rank0/`` with a ``.nvme.lock`` symlink made the trainer truncate
    the link's target (a file of the trainer's); the checkpoint's ``.save-lock`` the same."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    rank = tmp_path / "nvme" / "rank0"
    rank.mkdir(parents=True)
    os.symlink(victim, rank / ".nvme.lock")
    with pytest.raises(Exception, match="symbolic link"):
        with infinity.Init(_nvme_cfg(tmp_path / "nvme")):
            TinyGPT()
    assert victim.read_bytes() == b"precious"
    model, opt = _trained(tmp_path)
    (tmp_path / "ckpt").mkdir()
    os.symlink(victim, tmp_path / "ckpt" / ".save-lock")
    with pytest.raises(Exception, match="symbolic link"):
        infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    assert victim.read_bytes() == b"precious"
    infinity.release(model)


def test_swap_directories_and_files_are_this_users_only(tmp_path):
    """Swap files and locks were 0644 and directories 0755: another user read the weights from a swap file. They
    are 0600 and 0700 now, and a rank directory others can write is refused."""
    import stat

    (tmp_path / "nvme").mkdir()
    with infinity.Init(_nvme_cfg(tmp_path / "nvme")):
        model = TinyGPT()
    rank = tmp_path / "nvme" / "rank0"
    assert stat.S_IMODE(os.stat(rank).st_mode) == 0o700
    files = [p for p in rank.iterdir() if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), \
        [(p.name, oct(p.stat().st_mode)) for p in files]
    infinity.release(model)
    open_rank = tmp_path / "shared" / "rank0"
    open_rank.mkdir(parents=True)
    open_rank.chmod(0o777)
    with pytest.raises(infinity.errors.EngineError, match=r"rank0: writable by others \(mode 777\)"):
        with infinity.Init(_nvme_cfg(tmp_path / "shared")):
            TinyGPT()


def test_a_fifo_or_a_device_inside_a_checkpoint_fails_at_once(tmp_path):
    """A FIFO as extra.pt blocked the load forever; a manifest linked to /dev/zero was read without end."""
    import time

    model, opt = _trained(tmp_path)
    version = infinity.save_checkpoint(tmp_path / "ckpt", model, opt, extra={"epoch": 1})
    extra = os.path.join(version, "rank0", "extra.pt")
    os.unlink(extra)
    os.mkfifo(extra)
    started = time.perf_counter()
    with pytest.raises(infinity.checkpoint.CheckpointCorruptError, match="not a regular file"):
        infinity.load_checkpoint(version, model, opt)
    manifest = os.path.join(version, "rank0", "manifest.json")
    os.unlink(manifest)
    os.symlink("/dev/zero", manifest)
    with pytest.raises(infinity.checkpoint.CheckpointCorruptError, match="symbolic link; not followed"):
        infinity.load_checkpoint(version, model, opt)
    assert time.perf_counter() - started < 2.0
    infinity.release(model)


def _plant(directory, names, victim):
    """Symlinks to ``victim`` under each name a temporary output used to take (``<pid>`` was the only secret)."""
    for name in names:
        os.symlink(victim, os.path.join(directory, name))


@pytest.mark.parametrize("safetensors", [False, True])
def test_temporary_outputs_do_not_follow_names_planted_on_a_shared_disk(tmp_path, safetensors):
    """``infinity-consolidate`` wrote ``OUT.tmp-<pid>`` and the config writer ``.NAME.tmp<pid>``, opened following
    links: another user's links there truncated and overwrote the victim's file (399 links did it in the
    review). Now a random name is created anew (O_EXCL, O_NOFOLLOW) and written through its descriptor; the
    output then gets the umask's mode, as ``torch.save`` gives it."""
    from infinity.checkpoint.consolidate import consolidate

    model, opt = _trained(tmp_path)
    version = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    infinity.release(model)
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's own bytes")
    shared = tmp_path / "shared"
    shared.mkdir()
    out = shared / ("model.safetensors" if safetensors else "model.pt")
    pid = os.getpid()
    _plant(shared, [f"{out.name}.tmp-{pid}", f".{out.name}.tmp-{pid}", f"{out.name}.tmp{pid}"], victim)
    consolidate(version, out, safetensors=safetensors)
    assert victim.read_bytes() == b"the victim's own bytes"
    assert out.is_file() and not out.is_symlink()
    mask = os.umask(0o022)
    os.umask(mask)
    assert (out.stat().st_mode & 0o777) == 0o666 & ~mask
    assert sorted(p.name for p in shared.iterdir() if not p.is_symlink()) == [out.name]     # nothing left over

    config_out = shared / "run.toml"
    _plant(shared, [f".run.toml.tmp{pid}", f".run.toml.tmp-{pid}"], victim)
    infinity.config.dump({"aio": {"queue_depth": 8}}, config_out)
    assert victim.read_bytes() == b"the victim's own bytes"
    assert infinity.config.load_config(config_out).aio.queue_depth == 8


def test_a_hyper_parameter_a_load_would_refuse_fails_the_save_and_one_it_takes_round_trips(tmp_path):
    """The manifest schema and the writer agree: an infinite ``max_norm`` in a param group saves and loads;
    a value no checkpoint holds (a nested list) fails the save, naming it, not the load as "damaged"."""
    import math

    model, opt = _trained(tmp_path)
    opt.param_groups[0]["max_norm"] = math.inf
    opt.param_groups[0]["note"] = "run-7"
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert opt.param_groups[0]["max_norm"] == math.inf and opt.param_groups[0]["note"] == "run-7"
    opt.param_groups[0]["schedule"] = [[1, 2], [3, 4]]
    with pytest.raises(infinity.checkpoint.CheckpointError, match=r"hyper-parameter 'schedule' .* cannot be "
                                                                  r"recorded: it holds list"):
        infinity.save_checkpoint(tmp_path / "ckpt2", model, opt)
    infinity.release(model)


def test_a_name_given_to_two_parameters_is_refused(tmp_path):
    """A manifest naming one parameter twice (another's name given to a second, CRC recomputed) loaded and
    consolidated with exit 0: the second's values under the first's name, the first's key missing. Refused."""
    from infinity.checkpoint.consolidate import consolidate

    model, opt = _trained(tmp_path)
    version = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)

    def change(manifest):
        manifest["groups"][-1]["params"][0]["names"] = list(manifest["groups"][0]["params"][0]["names"])

    _edit(version, "manifest.json", change)
    said = r"names '[^']+', which groups\[0\]\.params\[0\] names too"
    for call in (lambda: infinity.load_checkpoint(version, model, opt),
                 lambda: consolidate(version, str(tmp_path / "out.pt"))):
        with pytest.raises(infinity.checkpoint.CheckpointCorruptError, match=said):
            call()
    assert not (tmp_path / "out.pt").exists()
    infinity.release(model)


def test_consolidating_onto_a_fifo_or_a_device_is_refused(tmp_path):
    """The output is written to a temporary file renamed over OUT: a FIFO there became a regular file (as root, so
    would /dev/null). Anything at OUT that is not a regular file is refused before anything is read."""
    from infinity.checkpoint.consolidate import consolidate

    model, opt = _trained(tmp_path)
    version = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    with pytest.raises(infinity.checkpoint.CheckpointError, match=r"fifo.pt exists and is not a regular file"):
        consolidate(version, str(fifo))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    infinity.release(model)
