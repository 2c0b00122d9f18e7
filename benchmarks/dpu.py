"""Delayed parameter update: step time against synchronous steps, and the loss it trains to.

    python benchmarks/dpu.py --json /tmp/dpu.json

Part 1 (step time). A small GPT (``infinity.examples.gpt``) is built once per configuration
in one process, optimizer states on the host (``--optimizer nvme`` adds NVMe-resident states):

- ``sync``: ordinary synchronous steps;
- ``dpu wN``: delayed parameter update, the background step bounded to N threads
  (``dpu.threads``; 0 is torch's default, every core);

each with the compute (main) thread count of ``--compute-threads``. Configurations take
turns of ``--turn`` steps, ``--rounds`` times, so a shift in the machine's load hits all of
them; the first step of each turn is not counted (the pipeline was drained between turns).
Per step it records forward+backward time and ``opt.step()`` time. The optimizer time of
a synchronous step is its ``opt.step()``; DPU's saving is ``sync step - dpu step`` (shown
over the synchronous optimizer time), and the fraction hidden is accounted directly: one minus
the time the main thread waited for the worker over the worker's time.

Part 2 (training). ``--train-steps`` steps of a smaller GPT on the bundled text, with and
without DPU, same initialisation, batches and learning-rate schedule (cosine decay to 10%,
stepped by ``torch.optim.lr_scheduler.LambdaLR``); the final loss is the mean of the last 10.
A one-step delay lowers the largest learning rate that trains well, so
the defaults follow ZeRO-Offload: a 40-step warm-up and a moderate learning rate.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time

import torch

import infinity
from infinity.examples.data import batches
from infinity.examples.gpt import GPT, GPTConfig


def build(shape: GPTConfig, optimizer: str, dpu_threads: int | None, nvme_dir: str, seed: int = 0,
          warmup: int = 1):
    """A GPT under infinity; ``dpu_threads`` None means synchronous steps (``dpu.overlap`` off too:
    the baseline DPU is measured against is the update inside ``opt.step()``)."""
    path = os.path.join(nvme_dir, f"{optimizer}-{dpu_threads}-{time.monotonic_ns()}")
    os.makedirs(path)
    cfg = {"tiers": {"params": "host", "optimizer": optimizer, "nvme_path": path, "device": "cpu"},
           "dpu": {"enabled": dpu_threads is not None, "warmup_steps": warmup, "threads": dpu_threads or 0,
                   "overlap": False}}
    torch.manual_seed(seed)
    with infinity.Init(cfg):
        model = GPT(shape)
    return model


class Config:
    """One measured configuration: its model, optimizer and samples."""

    def __init__(self, name: str, shape: GPTConfig, optimizer: str, dpu_threads: int | None,
                 compute_threads: int, nvme_dir: str, lr: float) -> None:
        self.name = name
        self.compute_threads = compute_threads
        self.model = build(shape, optimizer, dpu_threads, nvme_dir)
        self.opt = infinity.AdamW(self.model, lr=lr, weight_decay=0.1)
        self.fb: list[float] = []
        self.step: list[float] = []
        self.jobs: list[float] = []
        self.exposed: list[tuple[float, float]] = []

    def turn(self, data, steps: int) -> None:
        torch.set_num_threads(self.compute_threads)
        before = self.opt.stats()
        for i in range(steps):
            idx, tgt = next(data)
            t0 = time.perf_counter()
            self.model(idx, tgt).backward()
            t1 = time.perf_counter()
            self.opt.step()
            self.opt.zero_grad()
            t2 = time.perf_counter()
            if i:  # the first step of a turn starts with a drained pipeline
                self.fb.append(t1 - t0)
                self.step.append(t2 - t1)
        self.opt.synchronize()  # no background work may run during another configuration's turn
        after = self.opt.stats()
        jobs = (after["sync_steps"] + after["delayed_steps"]) - (before["sync_steps"] + before["delayed_steps"])
        optimizer = after["optimizer_seconds"] - before["optimizer_seconds"]
        self.jobs.append(optimizer / max(jobs, 1))
        # Main-thread waits for the worker, the final synchronize included (pessimistic by at most
        # one job per turn), over the optimizer's own time: the fraction it did not hide.
        self.exposed.append((after["exposed_seconds"] - before["exposed_seconds"], optimizer))

    def summary(self) -> dict:
        fb, st = statistics.median(self.fb), statistics.median(self.step)
        total = statistics.median([a + b for a, b in zip(self.fb, self.step)])
        exposed, optimizer = (sum(x) for x in zip(*self.exposed))
        return {"fb": fb, "step": st, "total": total, "job": statistics.median(self.jobs),
                "hidden_accounted": 1.0 - exposed / optimizer if optimizer else 0.0,
                "worker_threads": self.opt.stats()["worker_threads"]}


def step_times(args, shape: GPTConfig, optimizer: str, nvme_dir: str) -> dict:
    configs = [Config(f"sync c{c}", shape, optimizer, None, c, nvme_dir, args.lr) for c in args.compute_threads]
    configs += [Config(f"dpu w{w} c{c}", shape, optimizer, w, c, nvme_dir, args.lr)
                for c in args.compute_threads for w in args.dpu_threads]
    data = batches("random", args.batch, shape.seq_len, shape.vocab_size, seed=1)
    for c in configs:  # warm-up: first-touch of every buffer, the DPU warm-up step
        c.turn(data, 3)
        c.fb.clear(), c.step.clear(), c.jobs.clear(), c.exposed.clear()
    for _ in range(args.rounds):
        for c in configs:
            c.turn(data, args.turn)
    out = {c.name: c.summary() for c in configs}
    out_raw = {c.name: {"fb": c.fb, "step": c.step, "jobs": c.jobs, "exposed": c.exposed} for c in configs}
    print(f"\nstep time, optimizer states on {optimizer}; {shape.n_params / 1e6:.1f}M params, "
          f"batch {args.batch} x {shape.seq_len} tokens; medians of {len(configs[0].fb)} steps")
    print(f"{'config':14} {'fwd+bwd s':>10} {'step() s':>9} {'total s':>8} {'job s':>7} "
          f"{'vs sync':>8} {'saving/opt':>10} {'hidden':>7}")
    for c in configs:
        s = out[c.name]
        base = out[f"sync c{c.compute_threads}"]
        saving = base["total"] - s["total"]
        delayed = c.name.startswith("dpu")
        s.update(saving=saving, saving_over_sync_optimizer=saving / base["step"] if delayed else None)
        rel = f"{saving / base['step']:10.0%}" if delayed else f"{'-':>10}"
        hid = f"{s['hidden_accounted']:7.0%}" if delayed else f"{'-':>7}"
        print(f"{c.name:14} {s['fb']:10.4f} {s['step']:9.4f} {s['total']:8.4f} {s['job']:7.4f} "
              f"{base['total'] / s['total']:7.2f}x {rel} {hid}")
    print("saving/opt: (sync step - dpu step) / sync opt.step(); hidden: 1 - main-thread waits for the "
          "worker / worker time")
    return {"summary": out, "raw": out_raw}


def cosine(step: int, total: int) -> float:
    """Learning-rate factor: cosine decay from 1 to 0.1 over ``total`` steps."""
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, total) / total))


def train(args, shape: GPTConfig, nvme_dir: str) -> dict:
    losses = {}
    for name, threads in (("sync", None), ("dpu", args.dpu_threads[0])):
        torch.set_num_threads(args.compute_threads[0])
        model = build(shape, "host", threads, nvme_dir, seed=3, warmup=args.train_warmup)
        opt = infinity.AdamW(model, lr=args.train_lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: cosine(k, args.train_steps))
        data = batches("text", args.train_batch, shape.seq_len, shape.vocab_size, seed=2)
        run = []
        t0 = time.perf_counter()
        for _ in range(args.train_steps):
            idx, tgt = next(data)
            loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            run.append(float(loss.detach()))
        opt.synchronize()
        losses[name] = {"losses": run, "seconds": time.perf_counter() - t0,
                        "final": statistics.fmean(run[-10:])}
    ratio = losses["dpu"]["final"] / losses["sync"]["final"]
    print(f"\ntraining {args.train_steps} steps on the bundled text ({shape.n_params / 1e6:.2f}M params, "
          f"batch {args.train_batch} x {shape.seq_len}, lr {args.train_lr} cosine to 10%, "
          f"DPU warm-up {args.train_warmup} steps)")
    for name, r in losses.items():
        print(f"{name:5} first {r['losses'][0]:.4f}  final (mean of last 10) {r['final']:.4f}  "
              f"{r['seconds']:.1f} s")
    print(f"dpu / sync final loss: {ratio:.4f} ({(ratio - 1) * 100:+.2f}%)")
    return {"runs": losses, "ratio": ratio}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="sequences per step (part 1)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--optimizer", default="host", help="comma-separated optimizer tiers: host, nvme")
    ap.add_argument("--compute-threads", default="2", help="comma-separated main-thread counts")
    ap.add_argument("--dpu-threads", default="1,0", help="comma-separated dpu.threads values")
    ap.add_argument("--turn", type=int, default=6, help="steps per turn")
    ap.add_argument("--rounds", type=int, default=5, help="turns of every configuration")
    ap.add_argument("--train-steps", type=int, default=200, help="part 2 (0: skip)")
    ap.add_argument("--train-layers", type=int, default=2)
    ap.add_argument("--train-d-model", type=int, default=128)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-lr", type=float, default=3e-4, help="peak learning rate (part 2), cosine-decayed")
    ap.add_argument("--train-warmup", type=int, default=40, help="dpu.warmup_steps of the DPU run (part 2)")
    ap.add_argument("--nvme-dir", default=None, help="where NVMe tiers put swap files (default: a temp dir)")
    ap.add_argument("--json", help="write settings, machine and raw samples here")
    args = ap.parse_args(argv)
    args.compute_threads = [int(x) for x in args.compute_threads.split(",")]
    args.dpu_threads = [int(x) for x in args.dpu_threads.split(",")]
    shape = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, vocab_size=args.vocab,
                      seq_len=args.seq)
    results = {"settings": vars(args), "machine": {"platform": platform.platform(), "cores": os.cpu_count(),
                                                   "torch": torch.__version__}}
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme_dir:
        for tier in filter(None, args.optimizer.split(",")):
            results[f"step_time_{tier}"] = step_times(args, shape, tier, nvme_dir)
        if args.train_steps:
            small = GPTConfig(n_layer=args.train_layers, d_model=args.train_d_model, n_head=4,
                              vocab_size=max(256, min(args.vocab, 512)), seq_len=args.seq)
            results["train"] = train(args, small, nvme_dir)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
