"""A save killed with SIGKILL at any point leaves the last good checkpoint loadable.

Each trial runs a child process that commits version 1, then saves versions 2, 3, ... in a loop
(every parameter set to the version number) and is killed with SIGKILL: either after a random
delay, or by itself at its n-th fsync / rename / replace / unlink / rmdir, so every phase of a
save is hit (data files, manifests, COMMIT, the renames, the removal of the old version). The
checkpoint must then verify, load, hold exactly one version, no older than the last one the
child reported committed, and accept the next save (which clears the leftovers).
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading

import torch

import infinity
from infinity.checkpoint import verify_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

CHILD = r"""
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("checkpoint_tests", sys.argv[1])
tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tests)
import torch, infinity
root, mode, kill_at = sys.argv[2], sys.argv[3], int(sys.argv[4])
with infinity.Init(tests.config_for_crash()):
    model = tests.GPT(d=64)
calls = [0]

def arm():
    for name in ("fsync", "rename", "replace", "unlink", "rmdir"):
        original = getattr(os, name)
        def wrapper(*args, _original=original, **kwargs):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return _original(*args, **kwargs)
        setattr(os, name, wrapper)

version = 0
while True:
    version += 1
    with infinity.gathered(model):
        for p in model.parameters():
            p.data.fill_(float(version))
    infinity.save_checkpoint(root, model, None, extra={"version": version})   # no optimizer: a faster child
    print(version, flush=True)
    if version == 1 and mode == "syscall":
        arm()
"""


def _trial(root: str, mode: str, value: float, out: dict) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child_file = os.path.join(HERE, "test_checkpoint.py")
    kill_at = int(value) if mode == "syscall" else 0
    proc = subprocess.Popen([sys.executable, "-c", CHILD, child_file, root, mode, str(kill_at)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        first = proc.stdout.readline()
        lines.append(first)
        if first.strip() == "1" and mode == "time":
            threading.Event().wait(value)
            proc.send_signal(signal.SIGKILL)
        rest, err = proc.communicate(timeout=120)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    lines += rest.splitlines()
    out[root] = ([int(v) for v in lines if v.strip()], proc.returncode, err[-2000:])


def test_sigkill_during_saves_leaves_the_last_good_checkpoint(tmp_path):
    from tests.unit.test_checkpoint import GPT, config_for_crash, wait_for_cleanup

    rng = random.Random(9)
    trials = [("time", rng.uniform(0.05, 0.5)) for _ in range(2)]
    trials += [("syscall", n) for n in rng.sample(range(1, 40), 3)]
    roots = [str(tmp_path / f"ckpt-{i}-{mode}-{value:.2f}") for i, (mode, value) in enumerate(trials)]
    results: dict = {}
    threads = [threading.Thread(target=_trial, args=(root, mode, value, results))
               for root, (mode, value) in zip(roots, trials)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    with infinity.Init(config_for_crash()):
        model = GPT(d=64)
    opt = infinity.AdamW(model)
    for root, (mode, value) in zip(roots, trials):
        committed, code, err = results[root]
        what = f"trial {mode}={value:.2f}: reported committed {committed[-3:]}"
        assert code == -signal.SIGKILL, f"{what}: the child was not killed (exit {code}):\n{err}"
        assert committed and committed[0] == 1, what
        verify_checkpoint(root)
        loaded = infinity.load_checkpoint(root, model, opt)["version"]
        assert committed[-1] <= loaded <= committed[-1] + 1, f"{what}, loaded {loaded}"
        with infinity.gathered(model):
            for name, p in model.named_parameters():
                assert torch.all(p == loaded), f"{what}: {name} mixes versions"
        infinity.save_checkpoint(root, model, opt, extra={"version": loaded + 1})
        wait_for_cleanup()
        assert [e for e in os.listdir(root) if e.startswith(".")] == [], what
        assert infinity.load_checkpoint(root, model, opt)["version"] == loaded + 1
