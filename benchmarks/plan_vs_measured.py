"""The plan's predicted step against the measured one: every preset and ``auto``, CPU compute, three sizes.

For each size (a GPT of about that many parameters, ``shape_for_params``) and each preset, the model is
built under ``infinity.Init`` with the CPU as compute device (bf16 compute copies, linear layers widened
to fp32: ``precision.cpu_linear = "float32"``, the rate the FLOP probe measures; the tied head through
``widened_linear``); all of them and a plain PyTorch copy in each run's compute dtype (bf16, its linear
layers widened the same way; fp32 for the `device` preset, whose precision is fp32) are trained side by
side, step by step in turn (so each sees the same machine load), each engine step timed from the forward to the end of its update (``opt.synchronize()``; ``dpu.overlap`` is
off, since an update left running would overlap the next run's step, not its own model's forward: the
model predicts the sequential schedule the run has). ``--schedule engine`` measures the presets as shipped
instead (the overlapped update where they use it), each run alone, timed from one iteration's start to the
next, between two blocks of plain steps: less steady, since minutes pass between the figures compared. The median of
the measured steps is compared with ``infinity.plan.plan(...).prediction`` for the same census, config
and machine profile ([Note: step-time model] in infinity/plan/step_model.py). Its compute term is a plain
PyTorch forward + backward of the same model measured beside the runs (``--compute measured``: on a
shared CPU the FLOP rate of a large matmul says little about a small model's step), or FLOPs over the
probed matmul rate (``--compute flops``). Beside the ratio of medians, each step is divided by the prediction
made from the plain step measured beside it, and the median of those is reported ([Note: paired ratios] in
benchmarks/prefetch.py). The profile is this
machine's, probed at the start of the run ([Note: machine probes] in infinity/plan/probes.py), or ``--machine``;
the disk rates come from ``--bench-json`` (``infinity-bench nvme --json``). With ``--disk-beside`` the disk is
measured again just before and just after each run that uses it (the whole side-by-side block of a size,
sequentially; each run, as shipped), with that run's own ``[aio]`` settings (engine, block size, depth,
threads, O_DIRECT or buffered), and that run is predicted with the mean of the two: the disk swings
30-50% from minute to minute, and a rate read minutes before says little about a 2-second run. ``auto`` is resolved by
``Init("auto", model=census, machine=profile)`` as a user would. A preset may carry keys after a colon,
bare ones of ``tiers``, others as ``section.key``: ``nvme:params=host+optimizer_host_share=0.5`` (the optimizer
states split over tiers, [Note: optimizer states over tiers] in infinity/optim/tier_split.py), with
``+optimizer.update_in_backward=true`` the update during backward; measured and predicted like the presets.

    python benchmarks/plan_vs_measured.py --sizes 4M,8M,16M --bench-json nvme.json --json out.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import infinity
from infinity.config import load_config
from infinity.config.sections import AioConfig
from infinity.examples.gpt import GPT, shape_for_params
from infinity.examples.train_gpt import machine, provenance
from infinity.plan import plan
from infinity.plan.bandwidth import Bandwidth
from infinity.plan.census import take_census
from infinity.plan.machine import MachineProfile, Workload
from infinity.plan.units import parse_count
from infinity.tiling.widened import widen_linears, widened_linear
from tiers.aio import AioHandle

PRESETS = ("device", "offload-optimizer", "offload-host", "nvme", "auto")


def preset_keys(spec: str) -> tuple[str, dict]:
    """``preset[:key=value+...]`` as the preset's name and its keys by section: a bare key is a ``tiers`` key,
    ``section.key`` any other (numbers and true/false where they parse)."""
    name, _, rest = spec.partition(":")
    keys: dict[str, dict] = {"tiers": {}}
    for item in filter(None, rest.split("+")):
        key, _, value = item.partition("=")
        section, _, key = key.rpartition(".")
        try:
            parsed = float(value)
        except ValueError:
            parsed = {"true": True, "false": False}.get(value, value)
        keys.setdefault(section or "tiers", {})[key] = parsed
    return name, keys


def build(preset: str, shape, meta, profile, args, nvme_dir: str):
    """The engine model of ``preset`` and its optimizer, its census and config (tiers as Init resolved them)."""
    name, keys = preset_keys(preset)
    overrides = {"tiers": {"device": "cpu", "nvme_path": nvme_dir}, "precision": {"cpu_linear": "float32"},
                 "partition": {"sub_group_size": args.sub_group_size}}
    if args.schedule == "sequential":
        overrides["dpu"] = {"overlap": False}
    for section, values in keys.items():
        overrides.setdefault(section, {}).update(values)
    cfg = load_config(name, overrides=overrides)
    census = take_census(meta, cfg, cfg.precision.itemsize)
    torch.manual_seed(0)
    with infinity.Init(cfg, model=census, machine=profile) as init:
        model = GPT(shape, linear=widened_linear)
    return model, infinity.AdamW(model, lr=1e-4), census, cfg, init.config


def disk_now(path: str, aio=None, size: str = "256MiB") -> Bandwidth:
    """The disk's read and write rates at ``path`` measured now: ``infinity-bench nvme`` over ``size`` with the
    settings a run's NVMe tier uses (``aio``, its resolved ``[aio]`` section: engine, block size, queue depth,
    threads, O_DIRECT or buffered; the defaults without one), about 4 s."""
    aio = aio if aio is not None else AioConfig()
    with AioHandle(aio.block_size, aio.queue_depth, aio.threads, aio.engine, aio.direct) as handle:
        engine = handle.engine                       # "auto" as the tier's handle resolves it on this kernel
    with tempfile.TemporaryDirectory(dir=path) as where:
        out = os.path.join(where, "disk.json")
        subprocess.run([sys.executable, "-c", "import sys; from infinity.cli.bench import main; sys.exit(main())",
                        "nvme", "--path", where, "--size", size, "--block-sizes", str(aio.block_size),
                        "--queue-depths", str(aio.queue_depth), "--threads", str(aio.threads), "--engines", engine,
                        "--repeats", "2", "--no-baselines", "--no-progress", "--json", out]
                       + ([] if aio.direct else ["--buffered"]), check=True, stdout=subprocess.DEVNULL)
        return Bandwidth.from_bench_json(out)


def _aio_key(aio) -> tuple:
    return (aio.engine, aio.block_size, aio.queue_depth, aio.threads, aio.direct)


def disk_beside(profile: MachineProfile, path: str, measure, aios=(None,)):
    """``measure()``'s result, and for each of ``aios`` (the ``[aio]`` sections of the runs measured; a run
    is predicted with the disk its own settings see) ``profile`` with the disk rates measured with them just
    before and after ``measure()`` (their means) and the two readings, keyed by ``_aio_key``."""
    aios = list({_aio_key(a): a for a in (a if a is not None else AioConfig() for a in aios)}.values())
    before = [disk_now(path, aio) for aio in aios]
    result = measure()
    after = [disk_now(path, aio) for aio in aios]
    near = {}
    for aio, b, a in zip(aios, before, after):
        read, write = (b.read_gbps + a.read_gbps) / 2, (b.write_gbps + a.write_gbps) / 2
        readings = {"read_gbps": [b.read_gbps, a.read_gbps], "write_gbps": [b.write_gbps, a.write_gbps]}
        near[_aio_key(aio)] = (dataclasses.replace(profile, disk_read_gbps=read, disk_write_gbps=write), readings)
    return result, near


def _uses_disk(resolved) -> bool:
    return "nvme" in (resolved.tiers.params, resolved.tiers.optimizer, resolved.activations.offload)


def _batches(shape, args):
    g = torch.Generator().manual_seed(1)
    for _ in range(args.warmup + args.steps):
        yield torch.randint(0, shape.vocab_size, (args.batch, args.seq + 1), generator=g)


def _plain_step(plain, batch) -> float:
    start = time.perf_counter()
    plain(batch[:, :-1], batch[:, 1:]).backward()
    plain.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _plain_model(shape, dtype: str):
    """A plain PyTorch copy of the GPT in compute dtype ``dtype``, computing as the engine's runs do (linear
    layers in a 2-byte dtype widened: ``precision.cpu_linear = "float32"``)."""
    torch.manual_seed(0)
    plain = GPT(shape, linear=widened_linear).to(getattr(torch, dtype))
    widen_linears([plain])      # the engine's compute policy, in plain PyTorch
    return plain


def interleaved(runs, plain_of, shape, args):
    """Step by step, each run in turn, every step synchronized: each sees the same load (the plain compute
    included). ``plain_of``: each run's plain model (one per compute dtype, shared by the runs in it). Returns
    each run's step times and the times of its plain model's steps beside them."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    plains = {id(m): (m, []) for m in plain_of.values()}
    for batch in _batches(shape, args):
        for model, taken in plains.values():
            taken.append(_plain_step(model, batch))
        for preset, (model, opt, *_) in runs.items():
            start = time.perf_counter()
            model(batch[:, :-1], batch[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
            times[preset].append(time.perf_counter() - start)
    return ({k: v[args.warmup:] for k, v in times.items()},
            {k: plains[id(plain_of[k])][1][args.warmup:] for k in runs})


def blocks(runs, plain_of, shape, args):
    """Each run alone, as the engine schedules it (an overlapped update beside the next forward): steps timed
    from one iteration's start to the next, the last up to the end of its update, between two blocks of
    plain steps (of its plain model, ``plain_of[preset]``) whose medians' mean is its compute."""
    times: dict[str, list[float]] = {}
    plains: dict[str, list[float]] = {}
    for preset, (model, opt, *_) in runs.items():
        plain = plain_of[preset]
        before = [_plain_step(plain, b) for b in _batches(shape, args)][args.warmup:]
        starts = []
        for batch in _batches(shape, args):
            starts.append(time.perf_counter())
            model(batch[:, :-1], batch[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        starts.append(time.perf_counter())
        after = [_plain_step(plain, b) for b in _batches(shape, args)][args.warmup:]
        times[preset] = [b - a for a, b in zip(starts, starts[1:])][args.warmup:]
        middle = (statistics.median(before) + statistics.median(after)) / 2
        plains[preset] = [middle] * len(times[preset])
    return times, plains


def run(args, argv) -> dict:
    from infinity.plan.probes import machine_profile

    nvme_dir = args.workdir or tempfile.mkdtemp(prefix="plan-vs-measured-")
    if args.machine:
        profile = MachineProfile.from_file(args.machine)
    else:
        # probed now, beside the runs (a cached probe may be from a busier hour: [Note: machine probes])
        profile = machine_profile("cpu", "bfloat16", nvme_paths=(nvme_dir,), bench_json=args.bench_json, refresh=True)
    rows = []
    for size in args.sizes.split(","):
        shape = shape_for_params(parse_count(size, "--sizes"), vocab_size=args.vocab, seq_len=args.seq)
        with torch.device("meta"):
            meta = GPT(shape)
        runs = {}
        for i, preset in enumerate(args.presets.split(",")):   # each run its own swap directory
            os.makedirs(where := os.path.join(nvme_dir, f"{size}-{i}"), exist_ok=True)
            runs[preset] = build(preset, shape, meta, profile, args, where)
        dtypes = {preset: run[4].precision.dtype for preset, run in runs.items()}
        models = {dtype: _plain_model(shape, dtype) for dtype in sorted(set(dtypes.values()))}
        plain_of = {preset: models[dtype] for preset, dtype in dtypes.items()}
        # each run's profile and disk readings: the disk measured beside it with --disk-beside
        profiles, disks = {preset: profile for preset in runs}, {preset: None for preset in runs}
        beside = [p for p, r in runs.items() if args.disk_beside and _uses_disk(r[4])]
        if args.schedule == "sequential":
            if beside:
                (times, plain_times), near = disk_beside(profile, nvme_dir,
                                                         lambda: interleaved(runs, plain_of, shape, args),
                                                         [runs[p][4].aio for p in beside])
                for p in beside:
                    profiles[p], disks[p] = near[_aio_key(runs[p][4].aio)]
            else:
                times, plain_times = interleaved(runs, plain_of, shape, args)
        else:
            times, plain_times = {}, {}
            for preset in runs:
                alone = lambda: blocks({preset: runs[preset]}, plain_of, shape, args)   # noqa: E731
                if preset in beside:
                    (t, pt), near = disk_beside(profile, nvme_dir, alone, [runs[preset][4].aio])
                    profiles[preset], disks[preset] = near[_aio_key(runs[preset][4].aio)]
                else:
                    t, pt = alone()
                times.update(t)
                plain_times.update(pt)
        for preset, (model, opt, census, _, resolved) in runs.items():
            plains = plain_times[preset]
            compute_s = statistics.median(plains) if args.compute == "measured" else 0.0
            # the tiers Init resolved (``auto`` resolved again with a profile of another disk might differ)
            predict = lambda compute: plan(census, resolved, machine=profiles[preset], check_fit=False,  # noqa: E731
                                           workload=Workload(tokens=args.batch * args.seq, compute_s=compute)).prediction
            predicted = predict(compute_s)
            steps = times[preset]
            measured = statistics.median(steps)
            # [Note: paired ratios] in benchmarks/prefetch.py: each step against the plain step beside it.
            paired = (statistics.median(m / predict(c).step_s for m, c in zip(steps, plains))
                      if args.compute == "measured" and args.schedule == "sequential" else measured / predicted.step_s)
            t = resolved.tiers
            tiers = (t.params, t.optimizer + "".join(f"+{k[0]}{v:g}" for k, v in (
                ("device", t.optimizer_device_share), ("host", t.optimizer_host_share)) if v))
            ledger = (infinity.stats(model)["transfers"] or {}).get("per_parameter") or {}
            rows.append({"size": size, "params": census.num_params, "preset": preset, "tiers": list(tiers),
                         "predicted_s": predicted.step_s, "measured_s": measured, "ratio": measured / predicted.step_s,
                         "paired_ratio": paired, "compute_s": compute_s, "governing": predicted.governing,
                         "schedule": predicted.schedule, "phases_s": predicted.phases, "steps_s": steps,
                         "compute_dtype": dtypes[preset], "disk_beside": disks[preset],
                         "plain_s": plains, "shares": {"device": t.optimizer_device_share, "host": t.optimizer_host_share},
                         "nvme_bytes_per_param": ledger.get("nvme_read", 0) + ledger.get("nvme_written", 0)})
            print(f"{size:>6} {preset:<18} {tiers[0]:>6}/{tiers[1]:<10} predicted {predicted.step_s:8.3f} s  "
                  f"measured {measured:8.3f} s  ratio {rows[-1]['ratio']:5.2f}  paired {paired:5.2f}  "
                  f"({predicted.governing}; compute {compute_s:.3f} s"
                  + (f"; disk read {profiles[preset].disk_read_gbps:.2f}, write {profiles[preset].disk_write_gbps:.2f}"
                     " GB/s beside" if disks[preset] else "") + ")", flush=True)
            infinity.release(model)
    return {"provenance": {**provenance("benchmarks/plan_vs_measured.py", argv, measured_on := machine()),
                           "load_average": measured_on["load_average"]}, "settings": vars(args), "profile": profile.to_dict(), "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4M,8M,16M", help="comma-separated parameter counts (GPT shapes)")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--steps", type=int, default=5, help="measured steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--sub-group-size", type=int, default=4 << 20)
    ap.add_argument("--compute", choices=("measured", "flops"), default="measured",
                    help="the compute term: a plain PyTorch forward + backward measured before each run "
                         "(default), or FLOPs over the probed matmul rate")
    ap.add_argument("--schedule", choices=("sequential", "engine"), default="sequential",
                    help="sequential: dpu.overlap off and the runs interleaved step by step (default); engine: "
                         "the presets as shipped (an overlapped update beside the next forward), each run "
                         "alone between two blocks of plain steps")
    ap.add_argument("--machine", help="a machine profile file (default: this machine, probed and cached)")
    ap.add_argument("--bench-json", help="an infinity-bench nvme --json result for the disk rates")
    ap.add_argument("--disk-beside", action="store_true",
                    help="measure the disk just before and after each run that uses it (sequential: the side-by-side "
                         "block) and predict the run with those rates (about 8 s a run)")
    ap.add_argument("--workdir", help="directory for the NVMe files (default: a temporary one)")
    ap.add_argument("--json", help="write the settings, the profile and every sample here")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    out = run(args, argv)
    for key in ("ratio", "paired_ratio"):
        ratios = [r[key] for r in out["rows"]]
        within = sum(abs(r - 1) <= 0.15 for r in ratios)
        print(f"{key}: {within} of {len(ratios)} within 15%; measured/predicted median "
              f"{statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
