"""Where one steady training step spends its time: torch.profiler over the example GPT, per preset.

    python benchmarks/gpu_profile.py --model-size 350M --config offload-host --batch 8 --seq 1024

Builds the model as ``train_gpt`` does (same preset, dtype and batch), trains ``--warmup`` steps
(trace recorded, updates landed), then times forward, backward and ``opt.step()`` separately
(the device synchronized between them) and profiles one more step. Prints those three times, the
step's transfer ledger, and the profiler's top operators by self CPU time and by device time. With
``--trace FILE`` it also writes the Chrome trace. Runs on the CPU too (no device column there).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from infinity.examples import data
from infinity.examples.train_gpt import TrainOptions, _build, load_engine_config, model_config


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(run, x, y, times: dict | None = None) -> float:
    device = run.device
    t0 = time.perf_counter()
    if run.autocast_dtype is not None:
        with torch.autocast(device.type, dtype=run.autocast_dtype):
            loss = run.model(x, y)
    else:
        loss = run.model(x, y)
    if times is not None:
        _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    if times is not None:
        _sync(device)
    t2 = time.perf_counter()
    run.optimizer.step()
    run.optimizer.zero_grad()
    value = loss.item()
    _sync(device)
    t3 = time.perf_counter()
    if times is not None:
        for name, dt in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2)):
            times.setdefault(name, []).append(dt)
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="offload-host")
    p.add_argument("--model-size", default="350M")
    p.add_argument("--engine", default="infinity", choices=("infinity", "torch"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timed", type=int, default=2, help="steps timed phase by phase before the profiled one")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--nvme-dir", default=None)
    p.add_argument("--trace", default=None, help="write the profiled step's Chrome trace here")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    options = TrainOptions(config=args.config, model_size=args.model_size, batch=args.batch, seq=args.seq,
                           engine=args.engine, nvme_dir=args.nvme_dir,
                           overrides=(f'precision.dtype="{args.dtype}"', *args.overrides))
    config = load_engine_config(options)
    model_cfg = model_config(options)
    t0 = time.perf_counter()
    run = _build(options, model_cfg, config)
    print(f"{args.engine} {args.config} {args.model_size}: built in {time.perf_counter() - t0:.1f} s on {run.device}")
    source = data.batches("random", args.batch, args.seq, model_cfg.vocab_size, seed=0, device=run.device)
    for _ in range(args.warmup):
        _step(run, *next(source))
    times: dict = {}
    for _ in range(args.timed):
        _step(run, *next(source), times)
    print("phase seconds (device synchronized after each): " +
          ", ".join(f"{k} {min(v):.3f}" for k, v in times.items()))
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = run.device.type == "cuda"
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _step(run, *next(source))
    if args.engine == "infinity":
        import infinity

        print("ledger:", json.dumps(infinity.stats(run.model).get("transfers"), default=str))
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    if cuda:
        print(averages.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
