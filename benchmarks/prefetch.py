"""Step time with trace-driven prefetching against no prefetching, compute only, and pure I/O.

One run builds the same GPT (a few GB of model states) once per mode and trains them
side by side, one step of each in turn, so the disk's minute-to-minute swings hit every
mode alike:

- ``prefetch``:     params and optimizer states on NVMe, prefetch on (and the default
                    overlapped step: ``opt.step()`` returns at once, each group of the
                    next forward waits for its own update; results as a synchronous step);
- ``prefetch-sync``: the same with ``dpu.overlap = false``: the update pass runs inside
                    ``opt.step()`` (what ``prefetch`` was before the overlapped step), with ``--sync``;
- ``no-prefetch``:  params and optimizer states on NVMe, prefetch off (every module waits for
                    its own reads; the overlapped step stays on);
- ``prefetch+dpu``: the same as ``prefetch`` with delayed parameter update (the optimizer
                    pass of step t runs beside step t+1), when ``--dpu`` is given;
- ``compute-only``: params and optimizer states in host memory, prefetch off (no I/O);
- ``torch``:        plain PyTorch with ``torch.optim.AdamW`` (for reference, ``--torch``).

Each round runs every mode for ``--block`` consecutive steps; the first step of a block is a
lead-in and is not measured, and at the end of a block the delayed update still running is
drained (untimed). So a measured DPU step overlaps its own forward/backward only, never
another mode's step. Between rounds the raw aio read and write bandwidth of the NVMe path is measured with the
configured I/O settings (what ``infinity-bench nvme`` measures, inline), and the pure I/O
time of a step is its NVMe bytes (read and written, from ``infinity.stats``) at those
bandwidths. The figure of merit is ``step(prefetch) / max(step(compute-only), io_time)``.

Example::

    python benchmarks/prefetch.py --path /mnt/nvme --steps 3 --json prefetch.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

# Run as a script, this folder is sys.path[0], and benchmarks/tiers.py would shadow the
# `tiers` package the engine imports: look the package up from the repository root instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

GB = 1e9
# Run order within a round (reversed every other round): the modes compared with each other
# run next to each other in time.
MODES = ("torch", "compute-only", "prefetch", "prefetch-sync", "no-prefetch", "prefetch+dpu")


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2 style decoder with tied embeddings."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def count_params(args) -> int:
    d, L = args.d_model, args.layers
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return args.vocab * d + args.seq * d + L * per_block + 2 * d


# -- one model per mode ----------------------------------------------------------------------------
class Runner:
    """A model and its optimizer for one mode; ``step()`` trains one step and times it."""

    def __init__(self, mode: str, args, root: str) -> None:
        import infinity
        from infinity.registry import engine_of

        self.mode = mode
        self.engine = None
        torch.manual_seed(0)
        t0 = time.perf_counter()
        if mode == "torch":
            self.model = GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        else:
            path = os.path.join(root, mode)
            os.makedirs(path, exist_ok=True)
            on_nvme = mode != "compute-only"
            cfg = {"tiers": {"params": "nvme" if on_nvme else "host", "optimizer": "nvme" if on_nvme else "host",
                             "nvme_path": path},
                   "prefetch": {"enabled": mode in ("prefetch", "prefetch-sync", "prefetch+dpu"),
                                "nvme_bytes": args.nvme_bytes, "device_bytes": args.device_bytes},
                   "dpu": {"enabled": mode == "prefetch+dpu", "warmup_steps": 1, "threads": args.dpu_threads,
                           "overlap": mode != "prefetch-sync"},
                   "partition": {"sub_group_size": args.sub_group_size}}
            with infinity.Init(cfg):
                self.model = GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq)
            self.engine = engine_of(self.model)
            self.opt = infinity.AdamW(self.model, lr=1e-4)
        self.build_seconds = time.perf_counter() - t0
        g = torch.Generator().manual_seed(1)
        self.idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        self.tgt = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        self.samples: list[dict] = []

    def step(self) -> dict:
        t0 = time.perf_counter()
        loss = self.model(self.idx, self.tgt)
        loss.backward()
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        t2 = time.perf_counter()
        sample = {"seconds": t2 - t0, "forward_backward": t1 - t0, "optimizer": t2 - t1, "loss": float(loss.detach()),
                  "stall_seconds": 0.0, "read_wait_seconds": 0.0, "update_wait_seconds": 0.0, "hit_rate": 0.0,
                  "nvme_read": 0,
                  "nvme_written": 0}
        if self.engine is not None:
            record = self.engine.prefetcher.current_step() or {}
            nvme = record.get("tiers", {}).get("nvme", {})
            sample.update(stall_seconds=record.get("stall_seconds", 0.0),
                          read_wait_seconds=record.get("read_wait_seconds", 0.0),
                          update_wait_seconds=record.get("update_wait_seconds", 0.0),
                          hit_rate=record.get("hit_rate", 0.0), late=record.get("late", 0),
                          misses=record.get("misses", 0), trace=record.get("trace"),
                          nvme_read=nvme.get("bytes_read", 0), nvme_written=nvme.get("bytes_written", 0))
        self.samples.append(sample)
        return sample

    def drain(self) -> None:
        """Finish a delayed update still running (between blocks, untimed)."""
        if self.engine is not None:
            self.opt.synchronize()


# -- raw bandwidth ---------------------------------------------------------------------------------
class Bandwidth:
    """Raw aio read and write bandwidth of the NVMe path with the configured I/O settings.

    Like the engine's swap files, the test file is allocated once (written untimed at
    creation) and then overwritten and read back in place, so a pass measures the drive,
    not the file system allocating extents. Direct I/O completes when the device has the
    data, as for the engine's transfers, so no fsync is timed.
    """

    def __init__(self, path: str, nbytes: int, aio_cfg) -> None:
        from tiers import aio

        self.aio = aio
        self.request = min(64 << 20, max(4096, nbytes // 4096 * 4096))
        self.nbytes = max(self.request, nbytes // self.request * self.request)
        self.buf = aio.aligned_empty(self.request)
        self.buf.fill_(7)
        self.name = os.path.join(path, "bandwidth.bin")
        self.handle = aio.AioHandle(block_size=aio_cfg.block_size, queue_depth=aio_cfg.queue_depth,
                                    threads=aio_cfg.threads, engine=aio_cfg.engine, direct=aio_cfg.direct)
        self.direct = aio_cfg.direct
        self._pass("write", create=True)

    def _pass(self, op: str, create: bool = False) -> float:
        with self.aio.open_file(self.name, "w" if op == "write" else "r", direct=self.direct,
                                create=create) as f:
            submit = self.handle.pwrite if op == "write" else self.handle.pread
            t0 = time.perf_counter()
            futures = [submit(f, self.buf, offset) for offset in range(0, self.nbytes, self.request)]
            for fut in futures:
                fut.wait()
            return self.nbytes / (time.perf_counter() - t0) / GB

    def measure(self) -> tuple[float, float]:
        """(read, write) GB/s of one pass each over the file."""
        write = self._pass("write")
        return self._pass("read"), write

    def close(self) -> None:
        self.handle.close()
        os.unlink(self.name)


# -- the run ---------------------------------------------------------------------------------------
def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def run(args) -> dict:
    from infinity.config import load_config

    if args.threads:
        torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp(prefix="infinity-prefetch-", dir=args.path)
    modes = [m for m in MODES if m in args.modes]
    aio_cfg = load_config({}).aio
    try:
        runners = {}
        for mode in modes:
            print(f"building {mode} ...", file=sys.stderr, flush=True)
            runners[mode] = Runner(mode, args, root)
            gc.collect()
        bandwidth = []
        meter = Bandwidth(root, args.bw_bytes, aio_cfg)
        for r in range(args.warmup + args.steps):
            read_bw, write_bw = meter.measure()
            bandwidth.append({"round": r, "read_GBps": read_bw, "write_GBps": write_bw})
            order = modes if r % 2 == 0 else modes[::-1]
            for mode in order:
                for i in range(args.block):
                    s = runners[mode].step()
                    s.update(round=r, lead_in=args.block > 1 and i == 0)
                    print(f"round {r} {mode:13s} {s['seconds']:7.2f} s  (fwd+bwd {s['forward_backward']:.2f}, "
                          f"optimizer {s['optimizer']:.2f}, stall {s['stall_seconds']:.2f}, "
                          f"hit {100 * s['hit_rate']:.0f}%){' lead-in' if s['lead_in'] else ''}",
                          file=sys.stderr, flush=True)
                runners[mode].drain()
        meter.close()
        results = {"settings": vars(args), "params": count_params(args),
                   "state_bytes": 16 * count_params(args), "aio": aio_cfg.to_dict() if hasattr(aio_cfg, "to_dict")
                   else str(aio_cfg), "bandwidth": bandwidth,
                   "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                               "platform": platform.platform(), "torch": torch.__version__,
                               "load_average": os.getloadavg()},
                   "modes": {}}
        for mode, runner in runners.items():
            measured = [s for s in runner.samples if s["round"] >= args.warmup and not s["lead_in"]]
            results["modes"][mode] = {"build_seconds": runner.build_seconds, "samples": runner.samples,
                                      "median": {k: median([s.get(k) for s in measured])
                                                 for k in ("seconds", "forward_backward", "optimizer",
                                                           "stall_seconds", "read_wait_seconds",
                                                           "update_wait_seconds", "hit_rate",
                                                           "nvme_read", "nvme_written")}}
        summarize(results, args)
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _io_seconds(read_bytes, written_bytes, read_bw, write_bw):
    """Pure I/O time: the bytes at the raw bandwidths, reads and writes one after the other."""
    return read_bytes / GB / read_bw + written_bytes / GB / write_bw


def summarize(results: dict, args) -> None:
    """Medians over the measured rounds, and the same ratios paired within each round.

    [Note: paired ratios]
    The disk and the shared cores swing by tens of percent from one minute to the next.
    A ratio of medians compares figures taken minutes apart; a paired ratio divides two
    figures of the same round (taken seconds apart, in alternating order), and its median
    over rounds is the steadier estimate. Both are reported.
    """
    measured_bw = [b for b in results["bandwidth"] if b["round"] >= args.warmup] or results["bandwidth"]
    read_bw = median([b["read_GBps"] for b in measured_bw])
    write_bw = median([b["write_GBps"] for b in measured_bw])
    modes = results["modes"]
    out = {"read_GBps": read_bw, "write_GBps": write_bw}
    ref = modes.get("prefetch") or modes.get("no-prefetch")
    out["io_seconds"] = (None if ref is None else
                         _io_seconds(ref["median"]["nvme_read"], ref["median"]["nvme_written"], read_bw, write_bw))
    compute = modes.get("compute-only", {}).get("median", {}).get("seconds")
    out["compute_only_seconds"] = compute
    bounds = [v for v in (compute, out["io_seconds"]) if v is not None]
    for mode in ("prefetch", "prefetch-sync", "prefetch+dpu"):
        if mode in modes and bounds:
            out[f"ratio[{mode}]"] = modes[mode]["median"]["seconds"] / max(bounds)
    if "prefetch" in modes and "no-prefetch" in modes:
        out["speedup_over_no_prefetch"] = modes["no-prefetch"]["median"]["seconds"] / modes["prefetch"]["median"]["seconds"]
    if "prefetch" in modes:
        m = modes["prefetch"]["median"]
        out["stall_fraction[prefetch]"] = m["stall_seconds"] / m["seconds"]
        out["hit_rate[prefetch]"] = m["hit_rate"]

    def per_round(mode):
        rounds = {}
        for sample in modes.get(mode, {}).get("samples", []):
            if sample["round"] >= args.warmup and not sample["lead_in"]:
                rounds.setdefault(sample["round"], []).append(sample)
        return {r: {k: median([x[k] for x in v]) for k in ("seconds", "nvme_read", "nvme_written")}
                for r, v in rounds.items()}

    bw = {b["round"]: b for b in results["bandwidth"]}
    pre, off, comp = per_round("prefetch"), per_round("no-prefetch"), per_round("compute-only")
    paired = {}
    for mode in ("prefetch", "prefetch-sync", "prefetch+dpu"):
        steps = per_round(mode)
        ratios = []
        for r, step in steps.items():
            io = pre.get(r, step)
            bound = [_io_seconds(io["nvme_read"], io["nvme_written"], bw[r]["read_GBps"], bw[r]["write_GBps"])]
            if r in comp:
                bound.append(comp[r]["seconds"])
            ratios.append(step["seconds"] / max(bound))
        if ratios:
            paired[f"ratio[{mode}]"] = median(ratios)
    speedups = [off[r]["seconds"] / pre[r]["seconds"] for r in pre if r in off]
    if speedups:
        paired["speedup_over_no_prefetch"] = median(speedups)
    out["paired"] = paired
    results["summary"] = out


def print_table(results: dict) -> None:
    s = results["summary"]
    print(f"model: {results['params'] / 1e6:.0f} M params, {results['state_bytes'] / GB:.2f} GB of model states "
          f"(16 B/param); torch threads {results['machine']['torch_threads']}, load average "
          f"{results['machine']['load_average'][0]:.1f}")
    print(f"raw aio bandwidth (median of rounds): read {s['read_GBps']:.2f} GB/s, write {s['write_GBps']:.2f} GB/s")
    head = f"{'mode':14s} {'step s':>8s} {'fwd+bwd s':>10s} {'optim s':>8s} {'stall s':>8s} {'stall %':>8s} " \
           f"{'of it upd':>9s} " \
           f"{'hit %':>6s} {'NVMe rd GB':>10s} {'NVMe wr GB':>10s} {'GB/s':>6s}"
    print(head)
    print("-" * len(head))
    for mode, r in results["modes"].items():
        m = r["median"]
        nbytes = (m["nvme_read"] or 0) + (m["nvme_written"] or 0)
        stall = m["stall_seconds"] if m["stall_seconds"] == m["stall_seconds"] else 0.0
        update_wait = m.get("update_wait_seconds") or 0.0
        update_wait = update_wait if update_wait == update_wait else 0.0
        print(f"{mode:14s} {m['seconds']:8.2f} {m['forward_backward']:10.2f} {m['optimizer']:8.2f} "
              f"{stall:8.2f} {100 * stall / m['seconds']:8.1f} {update_wait:9.2f} {100 * (m['hit_rate'] or 0):6.0f} "
              f"{(m['nvme_read'] or 0) / GB:10.2f} {(m['nvme_written'] or 0) / GB:10.2f} "
              f"{nbytes / GB / m['seconds']:6.2f}")
    if s.get("io_seconds") is not None:
        print(f"pure I/O time of a step's NVMe bytes at the raw bandwidth: {s['io_seconds']:.2f} s")
    if s.get("compute_only_seconds") is not None:
        print(f"compute-only step (everything in host memory): {s['compute_only_seconds']:.2f} s")
    paired = s.get("paired", {})
    for key, value in s.items():
        if key.startswith("ratio["):
            pair = paired.get(key)
            print(f"step({key[6:-1]}) / max(compute-only, I/O) = {value:.2f} (medians), "
                  f"{pair:.2f} (paired per round)   goal <= 1.15" if pair is not None else
                  f"step({key[6:-1]}) / max(compute-only, I/O) = {value:.2f} (medians)   goal <= 1.15")
    if "speedup_over_no_prefetch" in s:
        pair = paired.get("speedup_over_no_prefetch", float("nan"))
        print(f"speed-up of prefetch over no prefetch: {s['speedup_over_no_prefetch']:.2f}x (medians), "
              f"{pair:.2f}x (paired); stall fraction {100 * s['stall_fraction[prefetch]']:.1f}%, "
              f"hit rate {100 * s['hit_rate[prefetch]']:.0f}%")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--path", default=os.environ.get("TMPDIR", "/tmp"), help="directory on the NVMe drive")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="measured rounds (medians over them)")
    p.add_argument("--warmup", type=int, default=1, help="rounds not measured (trace recording, DPU warm-up)")
    p.add_argument("--block", type=int, default=2, help="consecutive steps per mode and round; all but the "
                   "first are measured (1: every step measured, but DPU then overlaps other modes' steps)")
    p.add_argument("--nvme-bytes", default="256MiB", help="prefetch.nvme_bytes")
    p.add_argument("--device-bytes", default="128MiB", help="prefetch.device_bytes")
    p.add_argument("--sub-group-size", type=int, default=8 << 20,
                   help="partition.sub_group_size (elements); the NVMe optimizer pass holds 2 x 4 such fp32 "
                        "buffers per model, and this run holds several models")
    p.add_argument("--bw-bytes", type=int, default=1 << 30, help="bytes per raw bandwidth pass")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--dpu", action="store_true", help="also run prefetch with delayed parameter update")
    p.add_argument("--sync", action="store_true", help="also run prefetch with the synchronous step "
                   "(dpu.overlap = false)")
    p.add_argument("--dpu-threads", type=int, default=0, help="dpu.threads: the background update's threads")
    p.add_argument("--torch", action="store_true", help="also run plain PyTorch (reference)")
    p.add_argument("--modes", nargs="*", default=None, choices=MODES, help="run only these modes")
    p.add_argument("--json", default=None, help="write settings, machine, raw samples and summary here")
    args = p.parse_args(argv)
    if args.modes is None:
        args.modes = ["prefetch", "no-prefetch", "compute-only"] + (["prefetch-sync"] if args.sync else []) \
            + (["prefetch+dpu"] if args.dpu else []) + (["torch"] if args.torch else [])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run(args)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
