"""Host memory and step-time breakdown of a large model trained with everything on NVMe.

    python benchmarks/engine_step.py --nvme-dir /tmp/nvme --params 1e9 --steps 2 --json out.json

Builds a stack of MLP blocks with about ``--params`` parameters under ``infinity.Init`` with
parameters and optimizer states on NVMe, trains ``--steps`` steps on a fixed batch, and reports
peak host RSS (sampled every 10 ms in a thread, over construction and training), the model
states' size, and each step's time split into compute, waiting for parameter reads (stall) and
the optimizer pass.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import threading
import time

import psutil
import torch
from torch import nn

import infinity


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


class Stack(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.out = nn.LayerNorm(d)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x).pow(2).mean()


class RssSampler:
    """Peak resident set size of this process, sampled in a background thread."""

    def __init__(self, interval: float = 0.01) -> None:
        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e9, help="approximate parameter count")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per step (batch x sequence)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--nvme-dir", default=None, help="directory for swap files (default: a temp dir)")
    ap.add_argument("--sub-group-size", default="32Mi")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    d = args.d_model
    per_block = 8 * d * d + 7 * d
    layers = max(1, round(args.params / per_block))
    root = args.nvme_dir or tempfile.mkdtemp(prefix="infinity-engine-")
    nvme = os.path.join(root, "swap")
    os.makedirs(nvme, exist_ok=True)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": nvme},
           "partition": {"sub_group_size": args.sub_group_size}}
    torch.manual_seed(0)
    x = torch.randn(1, args.tokens, d)
    rows = []
    with RssSampler() as rss:
        base = rss.proc.memory_info().rss
        t0 = time.perf_counter()
        with infinity.Init(cfg):
            model = Stack(d, layers)
        build_s = time.perf_counter() - t0
        build_peak = rss.peak
        numel = sum(g.numel for g in infinity.registry.engine_of(model).coordinator.groups)
        opt = infinity.AdamW(model, lr=1e-4)
        for step in range(args.steps):
            before = infinity.stats(model)["fetch"]["stall_seconds"]
            t0 = time.perf_counter()
            loss = model(x)
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            # With states on NVMe, step() returns before the update ends (dpu.overlap); wait for it
            # here so the optimizer's time (and its memory, for the peak) falls in this step.
            opt.synchronize()
            t2 = time.perf_counter()
            stall = infinity.stats(model)["fetch"]["stall_seconds"] - before
            rows.append({"step": step, "loss": float(loss), "fwd_bwd_s": t1 - t0, "stall_s": stall,
                         "compute_s": (t1 - t0) - stall, "optimizer_s": t2 - t1, "step_s": t2 - t0,
                         "peak_rss_gib": rss.peak / 2**30})
            print(f"step {step}: loss {float(loss):.5f}  step {t2 - t0:.1f} s = compute {(t1 - t0) - stall:.1f} "
                  f"+ read stall {stall:.1f} + optimizer {t2 - t1:.1f}   peak RSS {rss.peak / 2**30:.2f} GiB")
    states = numel * 16
    summary = {"params": numel, "layers": layers, "d_model": d, "model_states_gb": states / 1e9,
               "build_s": build_s, "rss_before_gib": base / 2**30, "build_peak_rss_gib": build_peak / 2**30,
               "peak_rss_gib": rss.peak / 2**30, "steps": rows,
               "machine": {"cpus": os.cpu_count(), "ram_gib": psutil.virtual_memory().total / 2**30,
                           "platform": platform.platform(), "torch": torch.__version__}}
    print(f"\n{numel / 1e9:.2f} B params, model states {states / 1e9:.1f} GB (fp32 master + Adam m, v + "
          f"compute copy); built in {build_s:.0f} s")
    print(f"peak host RSS {rss.peak / 2**30:.2f} GiB (construction {build_peak / 2**30:.2f} GiB, "
          f"process start {base / 2**30:.2f} GiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    del model, opt
    if args.nvme_dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
