"""Compressed optimizer states: loss curves against fp32 states, and bytes per parameter per mode.

    python benchmarks/qstates.py --model 20M --seeds 0,1,2 --eval-batch 32 --threads 1 --json /tmp/qstates.json
    python benchmarks/qstates.py --model 125M --steps 100 --eval-batch 16 --threads 1
    python benchmarks/qstates.py --bytes-only

Quality: the GPT preset (``infinity.examples.gpt``) is trained on the demo corpus (byte tokens of
``tiny_corpus.txt``) with ``infinity.AdamW`` and every state on the host, once per
``[optimizer] state_dtype``, from the same initial weights and the same batches. Every
``--eval-every`` steps the loss on one fixed batch of ``--eval-batch`` sequences is recorded: the
table gives each mode's final loss (the mean of the last ``--final-evals`` records) against fp32's,
and the largest gap between the curves. Runs that differ only in rounding part chaotically, so one
run says little: ``fp32~`` (fp32 states, the loss scaled by 1 + 2^-20, the same training up to
rounding) measures that spread, and ``--seeds`` repeats everything with other initial weights,
batches and fixed batch; the summary gives each mode's difference to fp32 over the seeds.

Bytes: a small model of Linear layers with every state on NVMe (bf16 compute) steps ``--bytes-steps``
times per mode; the table gives what the NVMe tier stores per parameter and what one step reads and
writes there per parameter (measured from the tier's counters between two synchronized steps), next
to infinity-plan's figures for the same model and config.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import infinity  # noqa: E402
from infinity.examples.data import batches  # noqa: E402
from infinity.examples.gpt import GPT, preset  # noqa: E402
from infinity.examples.train_gpt import machine, provenance  # noqa: E402

MODES = ("fp32", "bf16", "int8")
PERTURBED = "fp32~"
"""fp32 states with the loss scaled by ``PERTURB_SCALE`` before backward: the same training as fp32's up to
rounding (Adam's update does not depend on the gradient's scale, but for ``eps``), so its distance from
fp32's curve is what rounding alone does to a curve, the yardstick of the compressed modes' distance."""
PERTURB_SCALE = 1.0 + 2.0 ** -20


def curve(model_name: str, state_dtype: str, steps: int, batch: int, seq: int, lr: float, seed: int = 0,
          block_size: int = 256, eval_every: int = 10, eval_batch: int = 64) -> dict[str, list[float]]:
    """Training losses of ``steps`` steps of the preset ``model_name`` with m and v stored as ``state_dtype``
    (``"train"``), and every ``eval_every`` steps the loss on one fixed batch of ``eval_batch`` sequences of
    the corpus (``"eval"``, the last after the last step): a small training batch makes each step's loss
    noisy, and the fixed batch shows how well the model fits without that noise. ``state_dtype`` may be
    ``PERTURBED``: fp32 states, the loss scaled by ``PERTURB_SCALE`` before backward. ``seed`` picks the
    initial weights, the batches and the fixed batch."""
    scale = PERTURB_SCALE if state_dtype == PERTURBED else None
    state_dtype = "fp32" if state_dtype == PERTURBED else state_dtype
    # No prefetching: the parameters stay on the device, and the fixed-batch forwards would leave the trace.
    cfg = {"tiers": {"params": "device", "optimizer": "host", "device": "cpu"}, "prefetch": {"enabled": False},
           "optimizer": {"state_dtype": state_dtype, "state_block_size": block_size}}
    torch.manual_seed(seed)
    with infinity.Init(cfg):
        model = GPT(preset(model_name, seq_len=seq))
    opt = infinity.AdamW(model, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = batches("text", batch, seq, model.cfg.vocab_size, seed=seed)
    held_x, held_y = next(batches("text", eval_batch, seq, model.cfg.vocab_size, seed=seed + 7919))
    losses, evals = [], []
    try:
        for step in range(1, steps + 1):
            x, y = next(data)
            loss = model(x, y)
            (loss if scale is None else loss * scale).backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step % eval_every == 0 or step == steps:
                with torch.no_grad():
                    evals.append(model(held_x, held_y).item())
    finally:
        infinity.release(model)
    return {"train": losses, "eval": evals}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def compare(curves: dict[str, dict], tail: int, eval_every: int = 10, final_evals: int = 5) -> dict[str, dict]:
    """Per mode, on the fixed batch's losses: the final one (mean of the last ``final_evals`` records: one
    record moves by about 1% from the next, the same in every mode), its relative difference to fp32's, and
    the largest relative gap to fp32's curve with its step; and the final training loss (mean of the last
    ``tail``)."""
    ref = curves["fp32"]["eval"]
    ref_final = sum(ref[-final_evals:]) / len(ref[-final_evals:])
    out = {}
    for mode, c in curves.items():
        gaps = [abs(a - b) / b for a, b in zip(c["eval"], ref)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        steps = len(c["train"])
        final = sum(c["eval"][-final_evals:]) / len(c["eval"][-final_evals:])
        out[mode] = {"final": final, "final_rel": (final - ref_final) / ref_final,
                     "max_gap_rel": gaps[worst], "max_gap_step": min(steps, (worst + 1) * eval_every),
                     "final_train": smooth(c["train"], tail)[-1]}
    return out


def over_seeds(figures: dict[int, dict[str, dict]]) -> dict[str, dict]:
    """Per mode, the final loss's relative difference to fp32's of the same seed, over the seeds: mean,
    sample standard deviation, smallest, largest and each seed's; and the largest gap on the way in any seed.
    Each seed is one sample of how far a mode lands from fp32 (runs that round differently part
    chaotically), so a mode's effect is its mean, told apart from chaos by the spread of ``PERTURBED``."""
    out = {}
    for mode in next(iter(figures.values())):
        rel = [f[mode]["final_rel"] for f in figures.values()]
        mean = sum(rel) / len(rel)
        std = (sum((r - mean) ** 2 for r in rel) / (len(rel) - 1)) ** 0.5 if len(rel) > 1 else 0.0
        out[mode] = {"mean": mean, "std": std, "min": min(rel), "max": max(rel), "samples": rel,
                     "max_gap_rel": max(f[mode]["max_gap_rel"] for f in figures.values())}
    return out


def mean_curves(runs: dict[int, dict[str, dict]]) -> dict[str, list[float]]:
    """Per mode, the fixed-batch losses averaged over the seeds, record by record."""
    modes = next(iter(runs.values()))
    return {m: [sum(r[m]["eval"][i] for r in runs.values()) / len(runs) for i in range(len(modes[m]["eval"]))]
            for m in modes}


def gap_curves(curves: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each curve as percent above fp32's, record by record."""
    ref = curves["fp32"]
    return {m: [100 * (a - b) / b for a, b in zip(c, ref)] for m, c in curves.items()}


def ascii_plot(curves: dict[str, list[float]], every: int = 1, width: int = 60, height: int = 14) -> str:
    """Loss curves recorded every ``every`` steps as text: one column per ``len / width`` points, a letter per mode."""
    marks = {"fp32": "o", PERTURBED: "~", "bf16": "b", "int8": "8"}
    lo = min(min(s) for s in curves.values())
    hi = max(max(s) for s in curves.values())
    steps = len(next(iter(curves.values())))
    grid = [[" "] * width for _ in range(height)]
    for mode, s in curves.items():
        for col in range(width):
            v = s[min(steps - 1, round(col * (steps - 1) / (width - 1)))]
            row = round((hi - v) / (hi - lo or 1.0) * (height - 1))
            cell = grid[row][col]
            grid[row][col] = marks.get(mode, "?") if cell == " " else "*"
    lines = [(f"{hi - (hi - lo) * r / (height - 1):6.2f} |" + "".join(row)).rstrip() for r, row in enumerate(grid)]
    lines.append("       +" + "-" * width)
    first, last = f"step {every}", f"step {steps * every}"
    lines.append(f"        {first}{' ' * (width - len(first) - len(last))}{last}")
    lines.append("        " + ", ".join(f"{marks.get(m, '?')} {m}" for m in curves) + ", * several")
    return "\n".join(lines)


def measure_bytes(state_dtype: str, steps: int, workdir: str) -> dict:
    """NVMe bytes stored and moved per parameter and step, measured and planned (see the module doc)."""
    from infinity.plan import CensusGroup, ModelCensus, plan

    path = tempfile.mkdtemp(dir=workdir)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "device": "cpu", "nvme_path": path},
           "precision": {"dtype": "bfloat16"}, "optimizer": {"state_dtype": state_dtype},
           "partition": {"sub_group_size": 1 << 20}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    opt = infinity.AdamW(model, lr=1e-3)
    engine = opt.engine
    x = torch.randn(8, 512, dtype=torch.bfloat16)
    numel = sum(g.numel for g in engine.coordinator.groups)
    census = ModelCensus("model", tuple(CensusGroup(g.name, tuple(s.numel for s in g.slots), bool(g.trainable))
                                        for g in engine.coordinator.groups))
    planned = plan(census, engine.config, world_size=1, local_ranks=1, check_fit=False)
    totals = []
    try:
        for i in range(steps + 2):
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
            nvme = infinity.stats(model)["tiers"]["nvme"]
            totals.append((nvme["bytes_read"], nvme["bytes_written"], nvme["bytes_in_use"]))
    finally:
        infinity.release(model)
    (r0, w0, _), (r1, w1, stored) = totals[1], totals[-1]
    n = steps
    return {"state_dtype": state_dtype, "numel": numel,
            "stored_per_param": stored / numel, "read_per_param_step": (r1 - r0) / n / numel,
            "written_per_param_step": (w1 - w0) / n / numel,
            "plan_stored_per_param": sum(r.nbytes for r in planned.rows if r.tier == "nvme") / numel,
            "plan_moved_per_param_step": (planned.nvme_read_bytes + planned.nvme_write_bytes) / numel}


def run_curves(args) -> dict:
    """Every mode for every seed, the table per seed and over the seeds, the plot of the seeds' mean."""
    modes = ["fp32"] + [m for m in args.modes.split(",") if m and m != "fp32"]
    seeds = [int(x) for x in args.seeds.split(",")]
    runs, seconds, figures = {}, {}, {}
    print(f"GPT {args.model}, demo corpus, {args.steps} steps of {args.batch} x {args.seq} tokens, lr {args.lr}; "
          f"loss on a fixed batch of {args.eval_batch} x {args.seq} every {args.eval_every} steps, the final loss "
          f"the mean of the last {args.final_evals}; {PERTURBED}: fp32 states, loss x (1 + 2^-20)")
    print(f"{'seed':>4} {'state_dtype':12} {'final loss':>10} {'vs fp32':>9} {'largest gap':>12} {'at step':>8} "
          f"{'train loss':>11} {'seconds':>8}")
    for seed in seeds:
        runs[seed], seconds[seed] = {}, {}
        for mode in modes:
            t0 = time.perf_counter()
            runs[seed][mode] = curve(args.model, mode, args.steps, args.batch, args.seq, args.lr, seed=seed,
                                     block_size=args.block_size, eval_every=args.eval_every,
                                     eval_batch=args.eval_batch)
            seconds[seed][mode] = time.perf_counter() - t0
        figures[seed] = compare(runs[seed], args.tail, args.eval_every, args.final_evals)
        for mode, f in figures[seed].items():
            print(f"{seed:4d} {mode:12} {f['final']:10.4f} {100 * f['final_rel']:+8.2f}% "
                  f"{100 * f['max_gap_rel']:11.2f}% {f['max_gap_step']:8d} {f['final_train']:11.4f} "
                  f"{seconds[seed][mode]:8.1f}", flush=True)
    summary = over_seeds(figures)
    print(f"\nFinal loss vs fp32's of the same seed, over {len(seeds)} seed(s)")
    print(f"{'state_dtype':12} {'mean':>8} {'std':>7} {'min':>8} {'max':>8} {'largest gap':>12}")
    for mode, f in summary.items():
        print(f"{mode:12} {100 * f['mean']:+7.2f}% {100 * f['std']:6.2f}% {100 * f['min']:+7.2f}% "
              f"{100 * f['max']:+7.2f}% {100 * f['max_gap_rel']:11.2f}%")
    mean = mean_curves(runs)
    print(f"\nLoss on the fixed batch, mean over {len(seeds)} seed(s)")
    print(ascii_plot(mean, args.eval_every))
    print(f"\nThe same, as % above fp32's mean curve")
    print(ascii_plot(gap_curves(mean), args.eval_every))
    key = str     # JSON keys are strings
    return {"runs": {key(s): r for s, r in runs.items()}, "seconds": {key(s): r for s, r in seconds.items()},
            "figures": {key(s): f for s, f in figures.items()}, "summary": summary}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="20M", help="GPT preset (infinity.examples.gpt.PRESETS): 20M, 125M, ...")
    ap.add_argument("--modes", default=f"{PERTURBED},bf16,int8",
                    help=f"state dtypes, and {PERTURBED} (the rounding-only yardstick); fp32 is always included")
    ap.add_argument("--seeds", default="0", help="comma-separated; a seed picks initial weights, batches, fixed batch")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--block-size", type=int, default=256, help="optimizer.state_block_size for int8")
    ap.add_argument("--tail", type=int, default=20, help="steps averaged for the final training loss")
    ap.add_argument("--eval-every", type=int, default=10, help="steps between losses on the fixed batch")
    ap.add_argument("--eval-batch", type=int, default=64, help="sequences in the fixed batch")
    ap.add_argument("--final-evals", type=int, default=5, help="fixed-batch losses averaged for the final loss")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's count); the count orders the matmuls' sums, so curves change "
                         "with it, and on a shared machine 1 thread avoids waiting for a descheduled peer each op")
    ap.add_argument("--bytes-steps", type=int, default=3, help="steps measured for the bytes table (0: none)")
    ap.add_argument("--bytes-only", action="store_true", help="only the bytes table")
    ap.add_argument("--json", help="write settings, machine, curves and figures here")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = ["fp32"] + [m for m in args.modes.split(",") if m and m not in ("fp32", PERTURBED)]
    result = {"provenance": provenance("benchmarks/qstates.py", argv), "settings": vars(args),
              "machine": {"platform": platform.platform(), "cores": os.cpu_count(),
                          "torch": torch.__version__, "threads": torch.get_num_threads()}}
    if not args.bytes_only:
        result.update(run_curves(args))
    if args.bytes_steps:
        rows = []
        with tempfile.TemporaryDirectory() as workdir:
            for mode in modes:
                rows.append(measure_bytes(mode, args.bytes_steps, workdir))
        print("\nNVMe bytes per parameter (bf16 compute, every state on NVMe), measured; plan in brackets")
        print(f"{'state_dtype':12} {'stored':>14} {'read/step':>10} {'written/step':>13} {'moved/step':>15}")
        for r in rows:
            moved = r["read_per_param_step"] + r["written_per_param_step"]
            plan_moved = r["plan_moved_per_param_step"]
            print(f"{r['state_dtype']:12} {r['stored_per_param']:6.2f} [{r['plan_stored_per_param']:5.2f}] "
                  f"{r['read_per_param_step']:10.2f} {r['written_per_param_step']:13.2f} {moved:6.2f} "
                  f"[{plan_moved:5.2f}]")
        result["bytes"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
