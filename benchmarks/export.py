"""Exporting a trained model's weights: ``infinity.state_dict`` (gathered a module at a time, [Note: a state
dict a module at a time] in infinity/runtime/gathered.py) against ``model.state_dict()`` inside
``infinity.gathered`` (every parameter gathered at once), each copied to host memory.

One engine over a GPT, the two ways alternating for ``--rounds``; per way the most parameter bytes gathered on
the compute device at once (the engine's ``peak_live_numel``), the median seconds, and whether the two state
dicts are equal tensor for tensor.

    python benchmarks/export.py --model 125M --preset offload-host
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import infinity
from infinity.config import load_config
from infinity.examples.gpt import GPT, preset
from infinity.registry import engine_of


def _gathered_copy(model) -> dict:
    with infinity.gathered(model):
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


WAYS = {"gathered + state_dict()": _gathered_copy, "infinity.state_dict": infinity.state_dict}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="125M", help="GPT size (infinity.examples.gpt.PRESETS)")
    ap.add_argument("--preset", default="offload-host", help="infinity config preset")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--layers", type=int, help="override the number of blocks (a smaller run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    cfg = load_config(args.preset, overrides={"tiers": {"device": "cpu"}, "precision": {"dtype": args.dtype}})
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = GPT(preset(args.model, n_layer=args.layers))
    engine = engine_of(model)
    coordinator = engine.coordinator
    element = torch.empty((), dtype=coordinator.dtype).element_size()
    seconds = {way: [] for way in WAYS}
    peak = {way: 0 for way in WAYS}
    results = {}
    for _ in range(args.rounds):
        for way, take in WAYS.items():
            coordinator.stats.reset()
            t0 = time.perf_counter()
            results[way] = take(model)
            seconds[way].append(time.perf_counter() - t0)
            peak[way] = max(peak[way], infinity.stats(model)["fetch"]["peak_live_numel"] * element)
    a, b = results.values()
    equal = list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    largest = max(g.full_nbytes for g in coordinator.groups)
    rows = {way: {"peak_gathered_bytes": peak[way], "median_s": statistics.median(seconds[way])} for way in WAYS}
    print(f"{'way':<26}{'peak gathered B':>18}{'median s':>10}")
    for way, row in rows.items():
        print(f"{way:<26}{row['peak_gathered_bytes']:>18,}{row['median_s']:>10.3f}")
    params = sum(g.numel for g in coordinator.groups)
    print(f"GPT {args.model}: {params:,} parameters in {coordinator.dtype}, largest group {largest:,} B; "
          f"state dicts equal: {equal}")
    infinity.release(model)
    report = {"model": args.model, "preset": args.preset, "dtype": args.dtype, "parameters": params,
              "largest_group_bytes": largest, "equal": equal, "ways": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
