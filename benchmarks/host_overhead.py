"""The engine's own host work per step, where a GPU run would feel it: a deep model with little compute.

    python benchmarks/host_overhead.py --layers 24 --steps 30 --json out/host.json

On a GPU the host only queues kernels; a step is as fast as plain torch's while the host stays
ahead of the device, so what the engine adds in Python per module and per group decides the
``device`` preset's ratio to plain torch (GPT 350M has 24 blocks: about 220 module calls and 150
parameter groups per forward, against a 69 ms torch step on an H100). This trains the example GPT
with that many blocks but a width of 64, so the compute is negligible and the host work shows: plain
torch and each preset built in one process, their steps alternated, on the CPU in fp32 with one
thread. Per configuration it prints the median ms per step, the engine's extra ms over torch's, the
Python function calls per step (a count, not a timing: the same on every machine for the same code),
and those calls per module call and per parameter group.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time

import torch

import infinity
from infinity import registry
from infinity.config import load_config, presets
from infinity.examples.gpt import GPT, GPTConfig


def build(name: str, shape: GPTConfig, nvme_dir: str, units: tuple = ()):
    """(model, optimizer) for ``torch`` or a preset, fp32 on the CPU (``units``: ``partition.units``)."""
    torch.manual_seed(0)
    if name == "torch":
        model = GPT(shape)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tiers = {"device": "cpu", "nvme_path": nvme_dir}
    overrides = {"tiers": tiers, "precision": {"dtype": "float32"}, "partition": {"units": list(units)}}
    with infinity.Init(load_config(name, overrides=overrides)):
        model = GPT(shape)
    return model, infinity.AdamW(model, lr=1e-4)


def calls_per_step(step, n: int = 3) -> int:
    """Python function calls (C functions included) one step makes in this thread, over ``n`` steps."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    return pstats.Stats(prof).total_calls // n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="transformer blocks (24: GPT 350M's depth)")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per configuration (after 3 warm-up)")
    ap.add_argument("--configs", default="torch," + ",".join(presets()))
    ap.add_argument("--nvme-dir", default=None, help="swap directory for the nvme preset (default: temp dir)")
    ap.add_argument("--units", default="", help="partition.units for the presets, comma-separated "
                    "(\"auto\": the model's _no_split_modules, the GPT's Block)")
    ap.add_argument("--no-lending", action="store_true",
                    help="gather by resizing storages, as a torch without UntypedStorage._swap_data_ptr_ does "
                         "(2.11 on the lent H100)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.no_lending:
        from infinity.runtime import gather_memory
        gather_memory._CAN_LEND = False
    swap = tempfile.TemporaryDirectory(prefix="host-overhead-") if args.nvme_dir is None else None
    nvme_dir = swap.name if swap is not None else args.nvme_dir
    torch.set_num_threads(1)
    shape = GPTConfig(n_layer=args.layers, d_model=args.width, n_head=4, vocab_size=512, seq_len=args.seq)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [n for n in names if n != "torch" and n not in presets()]
    if bad:
        print(f"unknown config {bad[0]!r}; choose from torch, {', '.join(presets())}", file=sys.stderr)
        return 2
    idx = torch.randint(0, shape.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name in names:
        model, opt = build(name, shape, nvme_dir, tuple(u for u in args.units.split(",") if u))

        def step(model=model, opt=opt):
            model(idx, idx).backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            step()
        modules = [0]
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: modules.__setitem__(0, modules[0] + 1))
        step()
        handle.remove()
        groups = None if name == "torch" else len(registry.engine_of(model, "host_overhead").coordinator.groups)
        runs[name] = {"model": model, "step": step, "ms": [], "module_calls": modules[0], "groups": groups,
                      "calls": calls_per_step(step)}
    for _ in range(args.steps):         # alternated, so a noisy machine slows every configuration alike
        for name in names:
            t0 = time.perf_counter()
            runs[name]["step"]()
            runs[name]["ms"].append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(runs["torch"]["ms"]) if "torch" in runs else None
    rows = []
    for name in names:
        r = runs[name]
        ms = statistics.median(r["ms"])
        rows.append({"config": name, "ms_per_step": ms, "extra_ms": None if base is None else ms - base,
                     "ratio": None if base is None else ms / base, "python_calls": r["calls"],
                     "module_calls": r["module_calls"], "groups": r["groups"],
                     "calls_per_module_call": r["calls"] / r["module_calls"],
                     "calls_per_group": r["calls"] / r["groups"] if r["groups"] else None})
    head = f"{'config':<18} {'ms/step':>8} {'extra ms':>9} {'vs torch':>8} {'py calls':>9} {'/module call':>12} {'/group':>7}"
    print(f"GPT {args.layers} x {args.width}, batch 1 x {args.seq}, fp32, CPU, 1 thread"
          f"{', partition.units = ' + args.units if args.units else ''}{', no lending' if args.no_lending else ''}; "
          f"median of {args.steps} alternated steps; module calls per forward: {rows[0]['module_calls']}")
    print(head)
    print("-" * len(head))
    for r in rows:
        extra = "-" if r["extra_ms"] is None else f"{r['extra_ms']:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        per_group = "-" if r["calls_per_group"] is None else f"{r['calls_per_group']:.0f}"
        print(f"{r['config']:<18} {r['ms_per_step']:>8.1f} {extra:>9} {ratio:>8} {r['python_calls']:>9} "
              f"{r['calls_per_module_call']:>12.0f} {per_group:>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
