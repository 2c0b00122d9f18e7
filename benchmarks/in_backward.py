"""The update during backward against the ordinary step: NVMe bytes per parameter and step time, side by side.

Two engines over the same GPT (same initial weights, same batches) in one process, one with
``[optimizer] update_in_backward = true``; their steps alternate, so both see the same machine
load, and the report gives each one's median step time, the median of the per-pair ratios, the
last step's NVMe bytes per parameter (``infinity.stats(model)["transfers"]["per_parameter"]``),
the plan's prediction of them, and whether the losses were equal at every step.

The plan is made twice: from the groups alone (``plan``, what ``infinity-plan`` sees in the
model's structure), and with each group's holders as the engine found them in the first step
(``plan_with_uses``): the example GPT's head computes with the token embedding's weight, which
the engine gathers for it too (see [Note: tied output head] in infinity/examples/gpt.py), one
more NVMe read of that weight per step than the structure shows.

    python benchmarks/in_backward.py --model 125M --steps 6 --state-dtype int8
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

import infinity
from infinity.examples.gpt import GPT, preset
from infinity.examples.train_gpt import machine, provenance
from infinity.plan import CensusGroup, ModelCensus, plan


def build(args, in_backward: bool, workdir: str):
    path = tempfile.mkdtemp(dir=workdir)
    cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "device": "cpu", "nvme_path": path},
           "precision": {"dtype": "bfloat16"},
           "optimizer": {"state_dtype": args.state_dtype, "update_in_backward": in_backward},
           "partition": {"sub_group_size": args.sub_group_size}}
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = GPT(preset(args.model, seq_len=args.seq))
    opt = infinity.AdamW(model, lr=1e-4)
    return model, opt, planned(opt.engine, with_uses=False)


def planned(engine, with_uses: bool) -> dict:
    """The plan's bytes per parameter for the engine's groups; ``with_uses``: each group counted once per
    module the engine gathers it for (known after the first forward)."""
    uses = {}
    if with_uses:
        for groups in engine.coordinator.module_groups.values():
            for g in groups:
                uses[g.index] = uses.get(g.index, 0) + 1
    census = ModelCensus("model", tuple(CensusGroup(g.name, tuple(s.numel for s in g.slots), bool(g.trainable),
                                                    uses.get(g.index, 1))
                                        for g in engine.coordinator.groups))
    return plan(census, engine.config, world_size=1, local_ranks=1, check_fit=False).per_parameter()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="125M")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per mode (after one warm-up step)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--state-dtype", default="int8")
    ap.add_argument("--sub-group-size", type=int, default=8 << 20)
    ap.add_argument("--workdir", default=None, help="directory for the NVMe files (default: a temporary one)")
    ap.add_argument("--json", help="write the figures here")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp()
    runs = {mode: build(args, mode == "in_backward", workdir) for mode in ("ordinary", "in_backward")}
    vocab = runs["ordinary"][0].cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps + 1)]
    times: dict[str, list[float]] = {m: [] for m in runs}
    losses: dict[str, list[float]] = {m: [] for m in runs}
    per_param = {}
    for i, batch in enumerate(data):
        for mode, (model, opt, _) in runs.items():
            t0 = time.perf_counter()
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
            if i:
                times[mode].append(time.perf_counter() - t0)
            losses[mode].append(loss.item())
            last = infinity.stats(model)["transfers"]   # the last closed step (forward to forward)
            if last is not None:
                per_param[mode] = last["per_parameter"]
    out = {"provenance": provenance("benchmarks/in_backward.py", argv), "settings": vars(args),
           "equal_losses": losses["ordinary"] == losses["in_backward"], "modes": {}}
    for mode, (model, opt, structure) in runs.items():
        moved = per_param[mode]["nvme_read"] + per_param[mode]["nvme_written"]
        with_uses = planned(opt.engine, with_uses=True)
        fresh = opt.engine.coordinator.shards.fresh
        out["modes"][mode] = {"median_step_s": statistics.median(times[mode]), "step_s": times[mode],
                              "per_parameter": per_param[mode], "nvme_moved_per_param": moved,
                              "plan_moved_per_param": structure["nvme_read"] + structure["nvme_written"],
                              "plan_with_uses_moved_per_param": with_uses["nvme_read"] + with_uses["nvme_written"],
                              "plan_with_uses": with_uses,
                              "fresh_shards_served": fresh.served if fresh is not None else 0,
                              "subs_in_backward": opt.stats().get("in_backward_subs", 0)}
        infinity.release(model)
    out["ratio_median"] = statistics.median(b / a for a, b in zip(times["ordinary"], times["in_backward"]))
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
