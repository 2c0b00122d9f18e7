"""Working memory and time of a forward+backward through one huge linear layer, tiled and untiled.

One layer of ``--out-features x --in-features`` fp32 weights (default 16384 x 16384,
1 GiB) is built inside ``infinity.Init`` with its parameters in the host (or NVMe)
tier, once untiled and once per ``--tiles`` count, and run forward and backward
(no optimizer step). Each mode runs in its own process (a clean resident set), and the
modes take turns for ``--rounds`` rounds, so the machine's swings hit all alike.

Measured per mode, over ``--iters`` iterations after ``--warmup``:

- peak gathered bytes: the largest sum of the full sizes of AVAILABLE parameter groups,
  sampled in hooks that run right after the engine's own (after each module's gather in
  forward and in backward), i.e. the weight bytes whole on the compute device at once:
  the tile in use plus what the prefetcher gathered ahead;
- peak RSS growth: the process's resident high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` before the timed iterations) minus its resident size then;
  this includes the gradient buffers, activations and allocator slack;
- with ``--torch``: the same layer in plain PyTorch, ``nn.Linear`` against ``TiledLinear``
  copies of it, timed alternately in one process (the cost of tiling to the computation);
- time per forward+backward: the median, and its ratio to untiled, paired round by round
  (each round's median against the untiled run of the same round; the median of those).

With ``--prefetch-tiles N`` the prefetcher's gather budget (``prefetch.device_bytes``) is
N tiles of the mode's own tile size (0 turns prefetching off), so a tiled layer holds the
tile in use plus N ahead.

Example::

    python benchmarks/tiling.py --tiles 8 16 --json tiling.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# Run as a script, this folder is sys.path[0], and benchmarks/tiers.py would shadow the
# `tiers` package the engine imports: look the package up from the repository root instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

MiB = 2**20


class GatheredPeak:
    """Largest ``coordinator.available_nbytes()`` seen right after each gather (forward and backward)."""

    def __init__(self, model: nn.Module) -> None:
        from infinity import registry

        self.coordinator = registry.engine_of(model).coordinator
        self.peak = 0
        self.handles = []
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(lambda mod, args: self.sample()))
            self.handles.append(m.register_forward_hook(self._watch))

    def sample(self, *_):
        self.peak = max(self.peak, self.coordinator.available_nbytes())

    def _watch(self, module, args, out):
        # Registered after the engine's forward hook, so in backward this tensor hook runs
        # after the engine's pre-backward gather of the same module.
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self.sample)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def status_bytes(field: str) -> int:
    """A byte count of /proc/self/status (VmRSS, VmHWM, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Start VmHWM again from the resident set now (Linux: clear_refs 5); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def tile_nbytes(out_features: int, in_features: int, tiles: int) -> int:
    """Gathered bytes of the largest tile: weight rows and bias, padded as the engine pads a group."""
    from infinity.param_group import ALIGN_NUMEL

    rows = -(-out_features // max(tiles, 1))
    return -(-rows * (in_features + 1) // ALIGN_NUMEL) * ALIGN_NUMEL * 4


def run_mode(args, tiles: int) -> dict:
    """One mode in this process: build, warm up, measure; returns the samples."""
    import infinity

    torch.manual_seed(0)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    tile = tile_nbytes(args.out_features, args.in_features, tiles or 1)
    cfg = {"tiers": {"params": args.params, "optimizer": args.optimizer, "nvme_path": args.swap_dir},
           "prefetch": {"enabled": args.prefetch_tiles > 0, "device_bytes": max(args.prefetch_tiles * tile, 1),
                        "nvme_bytes": max(args.prefetch_tiles * tile, 1) if tiles else 64 * MiB},
           "tiling": {"enabled": tiles > 0, "tiles": max(tiles, 0), "threshold": 1}}
    t0 = time.perf_counter()
    with infinity.Init(cfg):
        model = nn.Sequential(nn.Linear(args.in_features, args.out_features))
    build_s = time.perf_counter() - t0
    x = torch.randn(args.batch, args.in_features)
    peak = GatheredPeak(model)

    def step() -> float:
        t = time.perf_counter()
        model(x).pow(2).mean().backward()
        return time.perf_counter() - t

    for _ in range(args.warmup):
        step()
    peak.peak = 0
    exact = reset_peak_rss()
    rss0 = status_bytes("VmRSS")
    times = [step() for _ in range(args.iters)]
    rss_growth = status_bytes("VmHWM") - rss0 if exact else None
    stats = infinity.stats(model)
    return {"tiles": tiles, "tile_nbytes": tile if tiles else None, "build_seconds": build_s,
            "seconds": times, "peak_gathered_bytes": peak.peak, "peak_rss_growth_bytes": rss_growth,
            "layer": type(model[0]).__name__, "fetch": stats["fetch"]}


def run_torch(args) -> dict:
    """Plain PyTorch, no engine: nn.Linear and TiledLinear copies of it, fwd+bwd timed alternately.

    Isolates what tiling costs the computation itself (k smaller matmuls and the
    concatenation) from the engine's data movement.
    """
    from infinity.tiling import TiledLinear

    torch.manual_seed(0)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    plain = nn.Linear(args.in_features, args.out_features)
    x = torch.randn(args.batch, args.in_features)

    def step(layer) -> float:
        t = time.perf_counter()
        layer(x).pow(2).mean().backward()
        elapsed = time.perf_counter() - t
        layer.zero_grad(set_to_none=True)
        return elapsed

    out = {}
    for tiles in args.tiles:
        tiled = TiledLinear.from_linear(plain, tiles)
        for _ in range(args.warmup):
            step(plain), step(tiled)
        pairs = [(step(plain), step(tiled)) for _ in range(args.iters)]
        out[str(tiles)] = {"untiled_seconds": [a for a, _ in pairs], "tiled_seconds": [b for _, b in pairs]}
        del tiled
    return out


def _child(args) -> int:
    print(json.dumps(run_torch(args) if args.child < 0 else run_mode(args, args.child)))
    return 0


def _wait_for_memory(nbytes: int, timeout: float = 600.0) -> None:
    """Start a mode only when the machine has room for it (other jobs may share the host)."""
    import psutil

    deadline = time.monotonic() + timeout
    while psutil.virtual_memory().available < nbytes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout:.0f} s for {nbytes / MiB:.0f} MiB of available host memory; "
                               "free some memory or pass a smaller layer")
        time.sleep(5)


def _spawn(argv: list[str], path: str | None, tiles: int, need_nbytes: int, attempts: int = 3) -> dict:
    for attempt in range(1, attempts + 1):
        _wait_for_memory(need_nbytes)
        # The swap files (GBs) go with the mode's directory, also when the child was killed.
        with tempfile.TemporaryDirectory(prefix="tiling-", dir=path) as swap_dir:
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", str(tiles), "--swap-dir", swap_dir]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode == 0:
            break
        # SIGKILL: the kernel's OOM killer, when other jobs on a shared host grew meanwhile.
        if done.returncode != -9 or attempt == attempts:
            raise RuntimeError(f"mode tiles={tiles} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        print(f"mode tiles={tiles} was killed (out of memory?); retrying", file=sys.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: dict[int, list[dict]]) -> list[dict]:
    """Peaks (largest over rounds), median times, and time ratios paired by round (side by side)."""
    base = runs[0]
    base_gathered = max(r["peak_gathered_bytes"] for r in base)
    base_rss = [r["peak_rss_growth_bytes"] for r in base if r["peak_rss_growth_bytes"] is not None]
    rows = []
    for tiles, samples in runs.items():
        gathered = max(r["peak_gathered_bytes"] for r in samples)
        rss = [r["peak_rss_growth_bytes"] for r in samples if r["peak_rss_growth_bytes"] is not None]
        ratios = [statistics.median(r["seconds"]) / statistics.median(b["seconds"]) for r, b in zip(samples, base)]
        rows.append({
            "mode": "untiled" if tiles == 0 else f"tiles={tiles}",
            "tiles": tiles,
            "tile_MiB": samples[0]["tile_nbytes"] / MiB if tiles else None,
            "peak_gathered_MiB": gathered / MiB,
            "gathered_reduction": base_gathered / gathered if gathered else None,
            "goal_reduction": tiles / 2 if tiles else None,
            "peak_rss_growth_MiB": max(rss) / MiB if rss else None,
            "rss_reduction": max(base_rss) / max(rss) if rss and base_rss else None,
            "seconds_per_fwd_bwd": statistics.median(t for r in samples for t in r["seconds"]),
            "time_ratio": statistics.median(ratios),
            "time_ratio_per_round": ratios,
        })
    return rows


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    head = (f"{'mode':<10} {'tile MiB':>9} {'gathered MiB':>13} {'x less':>7} {'goal':>5} "
            f"{'RSS+ MiB':>9} {'x less':>7} {'s/fwd+bwd':>10} {'x time':>7}  x time per round")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['mode']:<10} {_fmt(r['tile_MiB'], '9.1f')} {r['peak_gathered_MiB']:13.1f} "
              f"{_fmt(r['gathered_reduction'], '7.2f')} {_fmt(r['goal_reduction'], '5.1f')} "
              f"{_fmt(r['peak_rss_growth_MiB'], '9.1f')} {_fmt(r['rss_reduction'], '7.2f')} "
              f"{r['seconds_per_fwd_bwd']:10.3f} {r['time_ratio']:7.2f}  "
              + " ".join(f"{x:.2f}" for x in r["time_ratio_per_round"]))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in-features", type=int, default=16384)
    p.add_argument("--out-features", type=int, default=16384)
    p.add_argument("--batch", type=int, default=16, help="rows of the input")
    p.add_argument("--tiles", type=int, nargs="+", default=[8, 16], help="tile counts to compare with untiled")
    p.add_argument("--params", choices=("host", "nvme"), default="host", help="parameter tier")
    p.add_argument("--optimizer", choices=("host", "nvme"), default="nvme",
                   help="optimizer tier (holds the fp32 master and the accumulated gradients)")
    p.add_argument("--path", default=None, help="directory for NVMe swap files (default: a temp dir)")
    p.add_argument("--prefetch-tiles", type=int, default=1, help="tiles gathered ahead (0: prefetch off)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="each mode runs once per round, in turn")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--torch", action="store_true",
                   help="also time nn.Linear against TiledLinear in plain PyTorch (no engine), alternately")
    p.add_argument("--json", default=None, help="write settings, machine, samples and summary here")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--swap-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.child is not None:
        return _child(args)
    modes = [0, *args.tiles]
    layer_nbytes = args.out_features * args.in_features * 4
    runs: dict[int, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for tiles in (modes if r % 2 == 0 else modes[::-1]):
            # Untiled, the gathered weight, its gradient, the reducer's buffer and shard and
            # autograd's copy live at once: about 8 layers' bytes, measured (building: ~4.5).
            # With the optimizer tier on the host, its four fp32 states take four layers more.
            need = (10 if tiles == 0 else 4) + (4 if args.optimizer == "host" else 0)
            runs[tiles].append(_spawn(argv, args.path, tiles, need * layer_nbytes))
    rows = summarize(runs)
    plain = _spawn(argv, args.path, -1, 4 * layer_nbytes) if args.torch else None
    weight_mib = args.out_features * args.in_features * 4 / MiB
    print(f"one Linear({args.in_features}, {args.out_features}): {weight_mib:.1f} MiB of fp32 weights, params on "
          f"{args.params}, batch {args.batch}, prefetch {args.prefetch_tiles} tile(s) ahead, "
          f"{args.rounds} rounds x {args.iters} iterations")
    print_table(rows)
    if plain is not None:
        for tiles, t in plain.items():
            ratio = statistics.median(b / a for a, b in zip(t["untiled_seconds"], t["tiled_seconds"]))
            print(f"plain PyTorch, no engine: TiledLinear({tiles} tiles) fwd+bwd "
                  f"{statistics.median(t['tiled_seconds']):.3f} s vs nn.Linear "
                  f"{statistics.median(t['untiled_seconds']):.3f} s: x{ratio:.2f} (median of paired ratios)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "child"},
                       "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                   "torch": torch.__version__, "loadavg": os.getloadavg()},
                       "runs": {str(k): v for k, v in runs.items()}, "summary": rows, "torch": plain}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
