"""A preempted run (SIGTERM at a random moment) saves in its handler's ``finally`` and resumes exactly.

The child trains a small GPT with every state on NVMe, saving every third step; its SIGTERM handler raises
``SystemExit`` (what a plain ``sys.exit`` in a handler does), and a ``finally:`` saves a checkpoint. The
signal lands anywhere: in a forward, in a backward (cut short: the save closes it first), in the update
(the states then are a mixture: the save refuses, naming why, and the periodic checkpoint stands), in a
save. The next run resumes from whatever was saved, takes its place in the data from ``opt.step_count``,
and must end with the weights of a run never interrupted, bit for bit.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 8

CHILD = textwrap.dedent('''
    import faulthandler, os, signal, sys
    import torch
    import infinity
    from tests.support.tiny_gpt import TinyGPT, batches

    work, steps = sys.argv[1], int(sys.argv[2])

    def stop(signum, frame):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)    # the test asks where a stuck child is
    nvme = os.path.join(work, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme, "pool_buffer_size": "256KiB",
                     "pool_buffers": 4},
           "partition": {"sub_group_size": 4096}, "precision": {"dtype": "bfloat16"},
           "prefetch": {"nvme_bytes": "1MiB"}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = TinyGPT(d=48)
    opt = infinity.AdamW(model, lr=1e-2)
    ckpt = os.path.join(work, "ckpt")
    if os.path.isdir(ckpt) and os.listdir(ckpt):
        infinity.load_checkpoint(ckpt, model, opt)
    data = batches(2 * steps, 4)
    if len(sys.argv) > 3:   # the signal sent from inside the backward of step 2, half-way through the blocks
        def mid_backward(module, args, out):
            if opt.step_count == 2 and torch.is_grad_enabled():
                out.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGTERM))
        model.blocks[0].register_forward_hook(mid_backward)
    print("training", flush=True)
    try:
        while opt.step_count < steps:
            done = opt.step_count       # the place in the data: what the optimizer applied, not a counter of ours
            for mb in range(2):
                x, y = data[2 * done + mb]
                model(x, y).backward()
            opt.step()
            opt.zero_grad()
            if opt.step_count % 3 == 0:
                infinity.save_checkpoint(ckpt, model, opt, keep=2)
    finally:
        if opt.step_count < steps:
            infinity.save_checkpoint(ckpt, model, opt, keep=2)
    with infinity.gathered(model):
        torch.save([p.detach().float().clone() for p in model.parameters()], os.path.join(work, "weights.pt"))
    print("done", flush=True)
''')


def _start(work, *extra):
    os.makedirs(work, exist_ok=True)
    script = os.path.join(work, "child.py")
    with open(script, "w") as f:
        f.write(CHILD)
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, script, work, str(STEPS), *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(child, what):
    """The child's (stdout, stderr) once it exits; a child still running after 120 s is stuck: its threads'
    stacks (faulthandler) fail the test."""
    try:
        return child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGUSR1)
        time.sleep(2)
        child.kill()
        out, err = child.communicate()
        raise AssertionError(f"{what}: the child did not exit within 120 s; its threads:\n{err[-6000:]}")


def _until_training(child):
    line = child.stdout.readline()
    assert line.strip() == "training", (line, child.stderr.read() if child.poll() is not None else "")
    return time.perf_counter()


def test_sigterm_at_random_moments_then_resume_gives_the_uninterrupted_weights(tmp_path):
    ref = _start(str(tmp_path / "ref"))
    began = _until_training(ref)
    assert ref.stdout.readline().strip() == "done"
    span = time.perf_counter() - began      # the training, a signal's window
    out, err = _finish(ref, "the uninterrupted run")
    assert ref.returncode == 0, err
    expected = torch.load(tmp_path / "ref" / "weights.pt")
    rng = random.Random(int(os.environ.get("INFINITY_TEST_SEED", "0")))
    outcomes = []
    for trial in range(3):     # the first: the signal in the middle of a backward; then at random moments (the seed moves them)
        work = str(tmp_path / f"t{trial}")
        child = _start(work, *(("mid-backward",) if trial == 0 else ()))
        _until_training(child)
        if trial:
            time.sleep(rng.uniform(0, span))
            child.send_signal(signal.SIGTERM)
        _, err = _finish(child, f"trial {trial}, signalled")
        said = err.strip().splitlines()[-1] if err.strip() else ""
        outcomes.append((child.returncode, said))
        # The save in ``finally`` works whenever the states are intact: a backward cut short is closed first.
        assert "backward pass is still running" not in err, (trial, said)
        again = _start(work)
        _, err2 = _finish(again, f"trial {trial}, resumed")
        assert again.returncode == 0, (trial, outcomes[-1], err2)
        got = torch.load(os.path.join(work, "weights.pt"))
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), (trial, outcomes[-1])
    print("preemption outcomes (exit status, last line of stderr):", outcomes)
