"""``make demo``: train a small GPT with its parameters and optimizer states on NVMe.

What it does, in order:
1. makes a temporary swap directory (removed at the end, even on error);
2. builds the ``20M`` example GPT inside ``infinity.Init`` with the ``nvme`` preset:
   each module's parameters go to swap files as soon as the module is built (on a CPU whose torch
   multiplies bf16 on its slow path, no AVX-512, with ``[precision] cpu_linear = "float32"``);
3. trains a few dozen steps on the bundled text (the learning rate warmed up over the first third,
   gradients clipped to norm 1 with ``torch.nn.utils.clip_grad_norm_``), showing loss, tokens/s, the
   fraction of time spent waiting for reads and the bytes held in each tier;
4. saves a checkpoint (when ``infinity.checkpoint`` is part of this build) and
   writes the JSON report, and prints where both went and a summary table:
   the step time split into compute / stall / optimizer, peak host memory, peak
   bytes per tier and the I/O rate reached.

Run ``python -m infinity.examples.demo --help`` for the few knobs; the full set is
``python -m infinity.examples.train_gpt``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from infinity.examples.console import Progress, summary_table
from infinity.examples.gpt import PRESETS, preset
from infinity.examples.meter import format_bytes
from infinity.examples.train_gpt import TrainOptions, train
from infinity.tiling.widened import slow_narrow_matmul

REPORT_NAME = "infinity-demo-report.json"


def _report_path(requested: str | None) -> str:
    """The JSON report goes where asked, else into the current directory, else into the temp dir."""
    if requested:
        return requested
    if os.access(os.getcwd(), os.W_OK):
        return os.path.join(os.getcwd(), REPORT_NAME)
    return os.path.join(tempfile.gettempdir(), REPORT_NAME)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infinity.examples.demo", description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="20M", choices=list(PRESETS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--config", default="nvme", help="preset or config file (default: nvme)")
    p.add_argument("--json", default=None, help=f"report path (default: ./{REPORT_NAME})")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint directory (default: a new directory under the system temp dir)")
    p.add_argument("--no-checkpoint", action="store_true")
    p.add_argument("--tmpdir", default=None, help="where to make the temporary swap directory")
    p.add_argument("--progress", default="auto", choices=("auto", "tqdm", "plain", "none"))
    p.add_argument("--cpu-linear", default="auto", choices=("auto", "native", "float32"),
                   help="[precision] cpu_linear; auto: float32 where torch's bf16 matmul takes its slow path "
                        "(a CPU without AVX-512), else the preset's")
    return p


def cpu_linear_overrides(choice: str) -> tuple[str, ...]:
    """The demo's ``--set`` for ``[precision] cpu_linear``: on a CPU without AVX-512, torch multiplies the
    preset's bf16 at 0.3-20 GFLOP/s, and 30 steps took 5 minutes (the tied head alone 10 s a step) instead of
    40 s (2 cores of an AMD EPYC); it is ignored on a GPU and in float32."""
    if choice == "auto":
        choice = "float32" if slow_narrow_matmul() else "native"
    return ("precision.cpu_linear=float32",) if choice == "float32" else ()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = preset(args.model_size)
    swap = tempfile.mkdtemp(prefix="infinity-demo-swap-", dir=args.tmpdir)
    made_ckpt = None
    checkpoint = None
    if not args.no_checkpoint:
        checkpoint = args.checkpoint or (made_ckpt := tempfile.mkdtemp(prefix="infinity-demo-checkpoint-"))
    options = TrainOptions(config=args.config, model_size=args.model_size, steps=args.steps, batch=args.batch,
                           seq=args.seq, nvme_dir=swap, json=_report_path(args.json), checkpoint=checkpoint,
                           data="text", lr=1e-3, seed=0, warmup_steps=max(1, args.steps // 3), max_grad_norm=1.0,
                           overrides=cpu_linear_overrides(args.cpu_linear))
    print(f"infinity demo: GPT {args.model_size} ({cfg.n_params / 1e6:.1f} M parameters, model states "
          f"{format_bytes(cfg.states_nbytes())}), {args.steps} steps of {args.batch} x {args.seq} tokens "
          f"of the bundled text\nconfig {args.config!r}{''.join(' --set ' + o for o in options.overrides)}; "
          f"swap files in {swap} (removed at the end)", flush=True)
    try:
        progress = None
        if args.progress != "none":
            progress = Progress(args.steps, use_tqdm={"auto": None, "tqdm": True, "plain": False}[args.progress])
        report = train(options, progress)
    except BaseException:
        if made_ckpt:
            shutil.rmtree(made_ckpt, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    if made_ckpt and not (report.get("checkpoint") or {}).get("path"):
        shutil.rmtree(made_ckpt, ignore_errors=True)
    print(summary_table(report), flush=True)
    if made_ckpt and os.path.isdir(made_ckpt):
        print(f"the checkpoint is in {made_ckpt}: load it with infinity.load_checkpoint, or delete it "
              f"(rm -r {made_ckpt}); --no-checkpoint skips it", flush=True)
    s = report["summary"]
    if s and s["last_loss"] >= s["first_loss"]:
        print(f"warning: the loss did not fall ({s['first_loss']:.4f} -> {s['last_loss']:.4f})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
