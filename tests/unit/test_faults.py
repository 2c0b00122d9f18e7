"""Faults injected into a running engine, each with what must survive it (docs/how-to/checkpoints.md,
"What survives what").

Every test breaks one thing (an exception in the user's code or a hook, a swap file truncated or
overwritten, a disk that fills, a process killed) and checks that the error names what broke and that
nothing is lost: the previous checkpoint loads, the model trains on as if nothing had happened, files
and locks are given back. Small models and few steps: the whole file runs in well under a minute.
"""
from __future__ import annotations

import gc
import json
import os
import random

import pytest
import torch
from torch import nn

import infinity
from infinity.checkpoint import CheckpointCorruptError
from infinity.errors import EngineError
from infinity.optim.nonfinite import NonFiniteStepsError
from tests.support.tiny_gpt import BufferedGPT as GPT


def nvme_config(tmp_path, **sections):
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": str(nvme),
                     "pool_buffer_size": "256KiB", "pool_buffers": 4},
           "partition": {"sub_group_size": 8192}, "prefetch": {"nvme_bytes": "2MiB"},
           "aio": {"engine": "threads"}, "checkpoint": {"buffer_size": "64KiB"}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def swap_files(tmp_path):
    return sorted(p.name for p in (tmp_path / "nvme").rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------- Init


class Boom(RuntimeError):
    pass


def test_init_whose_body_raises_gives_back_files_lock_and_memory_and_a_retry_works(tmp_path):
    cfg = nvme_config(tmp_path)
    init = infinity.Init(cfg)
    allocator = None
    with pytest.raises(Boom):
        with init:
            model = GPT()
            allocator = init.engine.tiers.allocator
            assert swap_files(tmp_path)                    # swap files and the lock exist while it runs
            raise Boom("the user's code failed half-way")
    del model
    gc.collect()
    assert swap_files(tmp_path) == [], "swap files or the directory lock were left behind"
    assert allocator.stats()["bytes_allocated"] == 0, "host buffers of the failed Init are still held"
    with infinity.Init(cfg):                               # the retry, in the same process
        model = GPT()
    opt = infinity.AdamW(model, lr=1e-2)
    model(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))).backward()
    opt.step()


def test_init_whose_module_constructor_raises_gives_back_everything(tmp_path):
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(32, 32)
            raise Boom("a constructor failed after its first layer was partitioned")

    cfg = nvme_config(tmp_path)
    with pytest.raises(Boom):
        with infinity.Init(cfg):
            Broken()
    gc.collect()
    assert swap_files(tmp_path) == []
    with infinity.Init(cfg):
        nn.Linear(8, 8)


# ---------------------------------------------------------------------------------------------- loading


def build(cfg, seed=0):
    torch.manual_seed(seed)
    with infinity.Init(cfg):
        model = GPT()
    return model, infinity.AdamW(model, lr=1e-2, weight_decay=0.01)


def train(model, opt, steps):
    """Steps on batches drawn from the global RNG (a load that touched it would change them)."""
    losses = []
    for _ in range(steps):
        loss = model(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def flip_byte(path, offset=-1):
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x7F]))


def _run(tmp_path, attempt_corrupt_load: bool):
    """Train 3 steps, save, train 2 more, (try to load the save, corrupted), train 3 more: the losses."""
    random.seed(0)
    model, opt = build(nvme_config(tmp_path))
    losses = train(model, opt, 3)
    version = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    losses += train(model, opt, 2)
    if attempt_corrupt_load:
        # The last file a load writes: with the old load, params and master were in by then.
        flip_byte(os.path.join(version, "rank0", "exp_avg_sq.bin"))
        with pytest.raises(CheckpointCorruptError, match=r"exp_avg_sq.bin: bytes .* fail their CRC-32"):
            infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    losses += train(model, opt, 3)
    with infinity.gathered(model):
        params = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, params, opt.step_count, random.random()


def test_a_load_that_fails_its_checksums_changes_nothing_and_training_goes_on_identically(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    never = _run(tmp_path / "a", attempt_corrupt_load=False)
    failed = _run(tmp_path / "b", attempt_corrupt_load=True)
    assert failed[0] == never[0], "the losses after a failed load differ from a run that never tried it"
    for key in never[1]:
        assert torch.equal(failed[1][key], never[1][key]), key
    assert failed[2:] == never[2:]                # step count, RNG draws


def test_a_load_that_fails_while_writing_the_tiers_refuses_to_train_until_a_load_succeeds(tmp_path, monkeypatch):
    from infinity.checkpoint import reader

    model, opt = build(nvme_config(tmp_path))
    train(model, opt, 2)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    expected = train(model, opt, 1)
    writes = []
    real_write = reader._StateDest.write

    def failing_write(self, dest_offset, data):
        writes.append(dest_offset)
        if len(writes) == 3:
            raise OSError(5, "Input/output error (injected)")
        return real_write(self, dest_offset, data)

    monkeypatch.setattr(reader._StateDest, "write", failing_write)
    with pytest.raises(OSError, match="injected"):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    with pytest.raises(EngineError, match=r"forward: refused because loading checkpoint .* failed after its bytes "
                                          r"began to reach the tiers .* load a checkpoint"):
        model(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    with pytest.raises(EngineError, match="infinity.save_checkpoint: refused because"):
        infinity.save_checkpoint(tmp_path / "other", model, opt)
    monkeypatch.setattr(reader._StateDest, "write", real_write)
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)     # mends them: states and RNG as saved
    assert train(model, opt, 1) == expected and opt.step_count == 3


# ---------------------------------------------------------------------------------------------- saving

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def host_config(**sections):
    cfg = {"tiers": {"params": "host", "optimizer": "host"}, "partition": {"sub_group_size": 8192},
           "checkpoint": {"buffer_size": "64KiB"}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def entries(root):
    """What a checkpoint directory holds, once retired versions are deleted (a background thread)."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "infinity-checkpoint-cleanup":
            thread.join()
    return sorted(os.listdir(root))


def rlimit_child(root: str) -> None:
    """In a child process: save, then save under a file size limit smaller than one data file (EFBIG),
    then lift the limit and save again. Prints what the parent checks."""
    import resource
    import signal

    model, opt = build(host_config(), seed=3)
    train(model, opt, 1)
    first = infinity.save_checkpoint(root, model, opt, extra="first")
    train(model, opt, 1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # else the kernel kills the writer
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, hard))
    try:
        infinity.save_checkpoint(root, model, opt, extra="second")
    except infinity.checkpoint.CheckpointError as exc:
        print("ERROR", type(exc).__name__, exc, flush=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    print("AFTER", " ".join(entries(root)), flush=True)
    print("LOADS", infinity.load_checkpoint(root, model, opt), os.path.basename(first), flush=True)
    infinity.save_checkpoint(root, model, opt, extra="third")
    print("RETRY", infinity.load_checkpoint(root, model, opt), flush=True)


def test_a_save_that_hits_the_file_size_limit_names_the_file_and_bytes_and_the_retry_works(tmp_path):
    import subprocess
    import sys

    root = str(tmp_path / "ckpt")
    code = f"import tests.unit.test_faults as t; t.rlimit_child({root!r})"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.stdout.splitlines() if " " in line}
    error = lines["ERROR"]
    assert error.startswith("CheckpointWriteError checkpoint file "), error
    assert f"{root}/.tmp-" in error and ".bin: " in error and "File too large (EFBIG) writing " in error, error
    assert "bytes) in all, " in error and "free there; the file is larger than this process may write" in error
    assert "The previous checkpoint is intact" in error
    first = lines["LOADS"].split()[1]
    assert lines["AFTER"].split() == ["latest", first], "the failed save left debris behind"
    assert lines["LOADS"].split()[0] == "first"          # the previous checkpoint loads
    assert lines["RETRY"] == "third"


def test_disk_full_while_moving_latest_names_the_pointer_and_leaves_the_previous_version(tmp_path, monkeypatch):
    import errno
    from infinity.checkpoint import CheckpointWriteError, directory

    model, opt = build(host_config())
    train(model, opt, 1)
    root = tmp_path / "ckpt"
    first = infinity.save_checkpoint(root, model, opt, extra=1)
    train(model, opt, 1)
    real = directory.write_durably

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(directory, "write_durably", full)
    with pytest.raises(CheckpointWriteError, match=r"pointer to the new version .*latest\.tmp-[0-9a-f]+: No space "
                                                   r"left on device \(ENOSPC\) writing \d+ B \(\d+ bytes\); .* "
                                                   r"free there; the disk is full") as info:
        infinity.save_checkpoint(root, model, opt, extra=2)
    assert info.value.errno == errno.ENOSPC
    assert entries(root) == ["latest", os.path.basename(first)]   # no orphan version, no pointer debris
    monkeypatch.setattr(directory, "write_durably", real)
    assert infinity.load_checkpoint(root, model, opt) == 1
    train(model, opt, 1)
    assert infinity.load_checkpoint(os.path.dirname(infinity.save_checkpoint(root, model, opt, extra=3)), model,
                                    opt) == 3


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    from infinity.checkpoint import CheckpointWriteError, disk

    model, opt = build(host_config())
    root = tmp_path / "ckpt"
    monkeypatch.setattr(disk, "free_bytes", lambda path: 1000)
    with pytest.raises(CheckpointWriteError, match=r"rank 0's save needs .* its filesystem has 1000 B \(1000 bytes\)"
                                                   r" free; nothing was written"):
        infinity.save_checkpoint(root, model, opt)
    assert entries(root) == []


def test_leftovers_of_failed_saves_are_cleared_before_the_next_save_writes(tmp_path):
    model, opt = build(host_config())
    root = tmp_path / "ckpt"
    first = infinity.save_checkpoint(root, model, opt)
    (root / ".tmp-0123456789abcdef" / "rank0").mkdir(parents=True)
    (root / ".tmp-0123456789abcdef" / "rank0" / "master.bin").write_bytes(b"x" * 4096)
    (root / "latest.tmp-0123456789abcdef").write_text("junk")
    import shutil
    orphan = root / "step99999999-00000000deadbeef"         # committed after `latest`'s version, never named
    shutil.copytree(first, orphan)
    commit = json.loads((orphan / "COMMIT").read_text())
    commit["committed"] += 100
    (orphan / "COMMIT").write_text(json.dumps(commit))
    from infinity.checkpoint import directory
    assert sorted(directory.clear_leftovers(str(root))) == [".tmp-0123456789abcdef", "latest.tmp-0123456789abcdef",
                                                          orphan.name]
    assert entries(root) == ["latest", os.path.basename(first)]


def test_a_second_saver_to_the_same_directory_is_refused_naming_the_holder(tmp_path):
    import subprocess
    import sys
    from infinity.checkpoint import CheckpointLockedError

    model, opt = build(host_config())
    root = tmp_path / "ckpt"
    first = infinity.save_checkpoint(root, model, opt)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(root / '.save-lock')!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'pid %d on elsewhere since now' % os.getpid())\n"
         "print('held', flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointLockedError, match=rf"checkpoint directory {root} is being saved to by pid "
                                                        rf"{holder.pid} on elsewhere .* save elsewhere"):
            infinity.save_checkpoint(root, model, opt)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert entries(root) == [".save-lock", "latest", os.path.basename(first)]   # the refused save touched nothing
    second = infinity.save_checkpoint(root, model, opt)     # the holder is gone: the lock is free again
    assert entries(root) == ["latest", os.path.basename(second)]


# ---------------------------------------------------------------------------------------------- swap files


def swap_path(tmp_path):
    return str(tmp_path / "nvme" / "rank0" / "nvme.swap")


def one_step(model, opt):
    loss = model(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_a_swap_file_truncated_under_a_live_run_stops_the_next_step_naming_the_file(tmp_path):
    from tiers.swapfile import SwapFileDamagedError

    model, opt = build(nvme_config(tmp_path))
    train(model, opt, 2)
    opt.synchronize()
    os.truncate(swap_path(tmp_path), 64 << 10)
    with pytest.raises(SwapFileDamagedError, match=rf"truncated under this run to 65536 bytes.*"
                                                   rf"'{swap_path(tmp_path)}'"):
        one_step(model, opt)


def test_a_truncated_swap_file_refuses_saves_and_loads_before_writing_and_says_how_to_go_on(tmp_path):
    """The natural recovery, loading a checkpoint, wrote into the cut file, failed half-way and left the
    states damaged; a save failed mid-way on a short read."""
    from tiers.swapfile import SwapFileDamagedError

    model, opt = build(nvme_config(tmp_path))
    train(model, opt, 2)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    want = one_step(model, opt)
    opt.synchronize()
    os.truncate(swap_path(tmp_path), 64 << 10)
    with pytest.raises(SwapFileDamagedError, match="truncated under this run"):
        infinity.save_checkpoint(tmp_path / "other", model, opt)
    assert not (tmp_path / "other").exists()
    with pytest.raises(SwapFileDamagedError) as info:
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert "build the model again inside infinity.Init" in "\n".join(getattr(info.value, "__notes__", []))
    infinity.release(model)
    model, opt = build(nvme_config(tmp_path))        # the way on: new swap files, then the load
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert one_step(model, opt) == want


def _corrupt_swap_data(tmp_path):
    """Every byte after the swap file's header becomes 0x7f, as a stray writer would leave it."""
    path = swap_path(tmp_path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(4096)
        f.write(b"\x7f" * (size - 4096))
        f.flush()
        os.fsync(f.fileno())


def test_with_verify_bytes_changed_in_a_swap_file_are_an_error_naming_the_file(tmp_path):
    from tiers.checksums import SwapChecksumError

    model, opt = build(nvme_config(tmp_path, tiers={"verify": True}))
    train(model, opt, 2)
    opt.synchronize()
    _corrupt_swap_data(tmp_path)
    with pytest.raises(SwapChecksumError, match=rf"of key \d+ \(tag '.*'\).* fail their CRC-32 .*changed on disk "
                                                rf"under this run.*'{swap_path(tmp_path)}'"):
        one_step(model, opt)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_steps_that_stay_non_finite_stop_the_run_naming_groups_and_tier_not_fp16(tmp_path, dtype):
    from infinity.optim.nonfinite import NonFiniteStepsError

    model, opt = build(nvme_config(tmp_path, precision={"dtype": dtype, "max_nonfinite_steps": 3}))
    train(model, opt, 1)
    opt.synchronize()
    _corrupt_swap_data(tmp_path)
    with pytest.warns(RuntimeWarning, match=rf"non-finite gradient \(inf/NaN in {dtype}, which does not overflow "
                                            r"like float16; 1 in a row, the run stops at 3\)"):
        one_step(model, opt)
    with pytest.warns(RuntimeWarning, match="2 in a row"):
        one_step(model, opt)
    with pytest.raises(NonFiniteStepsError) as info:
        one_step(model, opt)
    message = str(info.value)
    assert f"3 steps in a row had an inf/NaN gradient in {dtype}" in message
    assert "group 'wte' [weight]: parameters (tier nvme), gradient (tier nvme), master (tier nvme)" in message
    assert "set [tiers] verify = true" in message and "fp16" not in message


def test_in_float16_overflows_are_skipped_while_the_loss_scale_comes_down_then_the_run_stops(tmp_path):
    model, opt = build(nvme_config(tmp_path, precision={"dtype": "float16", "max_nonfinite_steps": 3,
                                                        "initial_scale": 8.0, "min_scale": 1.0, "hysteresis": 1}))
    train(model, opt, 1)
    opt.synchronize()
    _corrupt_swap_data(tmp_path)
    one_step(model, opt)        # skipped without a word: the scale halves (8 -> 4 -> 2 -> 1)
    one_step(model, opt)
    assert opt.skipped_steps == 2
    with pytest.raises(NonFiniteStepsError, match=r"float16 with the loss scale at 1, which does not come down"):
        one_step(model, opt)


def test_in_float16_with_a_fixed_loss_scale_non_finite_steps_warn_and_stop(tmp_path):
    model, opt = build(nvme_config(tmp_path, precision={"dtype": "float16", "max_nonfinite_steps": 2,
                                                        "loss_scale": 1.0}))
    train(model, opt, 1)
    opt.synchronize()
    _corrupt_swap_data(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"inf/NaN in float16"):
        one_step(model, opt)
    with pytest.raises(NonFiniteStepsError, match=r"2 steps in a row .* float16 with the loss scale at 1"):
        one_step(model, opt)


# ---------------------------------------------------------------------------------------------- exceptions in hooks


def _batches(n):
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
            for _ in range(n)]


def _losses(model, opt, batches):
    out = []
    for idx, tgt in batches:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_exception_in_the_models_forward_or_backward_loses_nothing(tmp_path, where):
    batches = _batches(4)
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    model, opt = build(nvme_config(tmp_path / "ref"))
    reference = _losses(model, opt, batches)
    del model, opt
    gc.collect()

    model, opt = build(nvme_config(tmp_path / "run"))
    losses = _losses(model, opt, batches[:2])
    block = model.blocks[1]
    if where == "forward":
        handle = block.register_forward_pre_hook(lambda module, args: (_ for _ in ()).throw(Boom("in forward")))
    else:
        handle = block.register_full_backward_hook(lambda module, gin, gout: (_ for _ in ()).throw(Boom("in backward")))
    with pytest.raises(Boom):
        model(*batches[2]).backward()              # raises inside the engine's hooked forward or backward
    handle.remove()
    opt.zero_grad()                               # as after any failed step in plain PyTorch
    losses += _losses(model, opt, batches[2:])
    assert losses == reference


# ---------------------------------------------------------------------------------------------- kill -9

_KILLED_CHILD = r"""
import os, signal, sys
import tests.unit.test_faults as t
import infinity
model, opt = t.build(t.nvme_config(__import__("pathlib").Path(sys.argv[1])))
t.train(model, opt, 2)
infinity.save_checkpoint(os.path.join(sys.argv[1], "ckpt"), model, opt, extra="saved")
t.train(model, opt, 1)
print("training", flush=True)
while True:                                      # killed here, mid-training, swap files and locks held
    t.train(model, opt, 1)
"""


def test_kill_9_mid_training_leaves_a_directory_the_next_run_takes_over(tmp_path):
    import signal
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(tmp_path)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "training", child.stderr.read()[-3000:]
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        child.kill()
    assert "nvme.swap" in swap_files(tmp_path)                  # the killed run's swap file is still there
    with pytest.warns(RuntimeWarning, match="removed stale swap file .* left by run"):
        model, opt = build(nvme_config(tmp_path))              # same nvme_path: its lock is free, stale file gone
    assert infinity.load_checkpoint(tmp_path / "ckpt", model, opt) == "saved" and opt.step_count == 2
    train(model, opt, 2)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)


def test_messages_of_smaller_faults_say_what_happened(tmp_path, monkeypatch):
    """An interrupted load named its cause as an empty "()"; a version retired under a reader (another job saved
    with a small keep) was called corrupt ("manifest of rank 0 is missing"); the max_live_parameters refusal
    read "stage 3 < 3 keeps all"."""
    import shutil

    from infinity.checkpoint import reader
    from infinity.checkpoint.directory import SavedCheckpoint
    from infinity.checkpoint.errors import CheckpointError

    model, opt = build(nvme_config(tmp_path))
    train(model, opt, 1)
    infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    real_write = reader._StateDest.write

    def interrupted(self, dest_offset, data):
        raise KeyboardInterrupt()

    monkeypatch.setattr(reader._StateDest, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    monkeypatch.setattr(reader._StateDest, "write", real_write)
    with pytest.raises(EngineError, match=r"failed after its bytes began to reach the tiers \(KeyboardInterrupt\)"):
        opt.step()
    infinity.load_checkpoint(tmp_path / "ckpt", model, opt)

    saved = SavedCheckpoint(tmp_path / "ckpt")
    shutil.rmtree(saved.directory)      # retired by another job's save between opening and reading
    with pytest.raises(CheckpointError, match="this version was retired while it was being read") as info:
        saved.rank_manifest(0)
    assert not isinstance(info.value, CheckpointCorruptError)
    infinity.release(model)

    with pytest.raises(EngineError, match=r"stay gathered \(at stage 3, those below "
                                          r"partition.persistence_threshold = \d+\) plus") as info:
        with infinity.Init({"tiers": {"params": "host"}, "partition": {"max_live_parameters": 1}}):
            nn.Linear(8, 8)
    assert "3 < 3" not in str(info.value)
