"""A frozen base under trained layers: what the optimizer's tier holds when the base is frozen inside
``infinity.Init`` or after it but before the optimizer is created (its sub-groups dormant: masters only;
[Note: frozen after Init] in infinity/optim/relayout.py), against frozen after the optimizer (every
state held).

Three engines over the same GPT (same initial weights, same batches) in one process; by default only the last
``--train-blocks`` blocks and the final norm train. Their steps alternate, so all see the same
machine load. The report gives, per engine, the optimizer tier's bytes in use, the bytes per frozen
parameter it saves against the last, the median step time and whether the losses were equal at every
step; then the base is unfrozen in all for ``--unfrozen-steps`` steps (the dormant ones wake) and the
tiers compared again (see [Note: dormant sub-groups] in infinity/optim/flat_state.py).

    python benchmarks/frozen.py --model 125M --preset nvme --steps 6

``--freeze bitfit`` freezes every matrix instead, training the biases and norms (BitFit): frozen inside
``Init`` each block's group is split in two at its exit and the frozen half is dormant ([Note: frozen
inside a group] in infinity/runtime/construction.py); frozen after it the groups train whole.

``--bf16-values`` rounds the initial weights to bf16 in both engines, as a base loaded from a bf16
checkpoint has them: its masters need no remainders ([Note: zero remainders] in
infinity/optim/split_master.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import infinity
from infinity.config import load_config
from infinity.examples.data import batches
from infinity.examples.gpt import GPT, preset
from infinity.param_group import ParamState
from infinity.registry import engine_of


def _freeze(model, args) -> None:
    if args.freeze == "bitfit":
        for p in model.parameters():
            p.requires_grad_(p.dim() < 2)
        return
    model.requires_grad_(False)
    for block in model.blocks[len(model.blocks) - args.train_blocks:]:
        block.requires_grad_(True)
    model.ln_f.requires_grad_(True)


_WHEN = ("in Init", "before the optimizer", "after the optimizer")
_created_s: dict[str, float] = {}


def build(args, when: str, workdir: str):
    cfg = load_config(args.preset, overrides={"tiers": {"device": "cpu", "nvme_path": tempfile.mkdtemp(dir=workdir)},
                                              "precision": {"dtype": args.dtype},
                                              "partition": {"max_live_parameters": args.max_live}})
    torch.manual_seed(0)
    with infinity.Init(cfg):
        model = GPT(preset(args.model, seq_len=args.seq))
        if args.bf16_values:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.bfloat16().float())
        if when == "in Init":
            _freeze(model, args)
    if when == "before the optimizer":
        _freeze(model, args)
    start = time.perf_counter()
    opt = infinity.AdamW(model, lr=1e-4)
    _created_s[when] = time.perf_counter() - start    # with a base frozen before it: the store built again
    if when == "after the optimizer":
        _freeze(model, args)
    return model, opt


def _watch_held(model) -> dict:
    """Sample, as each module's backward gathers its groups, the bytes of the groups held for backward or in
    use; returns the dict whose "peak" it keeps (frozen groups are released as their module's backward ends:
    [Note: a module's backward is over] in infinity/runtime/backward_holds.py)."""
    coordinator = engine_of(model).coordinator
    hold = coordinator.hold_for_backward
    seen = {"peak": 0}

    def sampled(module):
        hold(module)
        busy = [g for g in coordinator.groups if coordinator.busy(g) and g.state is ParamState.AVAILABLE]
        seen["peak"] = max(seen["peak"], sum(g.full_nbytes for g in busy))

    coordinator.hold_for_backward = sampled
    return seen


def _tier_bytes(model, tier: str) -> int:
    return infinity.stats(model)["tiers"][tier]["bytes_in_use"]


def _steps(runs, count: int, data) -> tuple[dict, bool]:
    times = {name: [] for name in runs}
    equal = True
    for _ in range(count):
        x, y = next(data)
        losses = []
        for name, (model, opt) in runs.items():
            start = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            opt.synchronize()
            times[name].append(time.perf_counter() - start)
            losses.append(loss.item())
        equal = equal and len(set(losses)) == 1
    return times, equal


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="125M")
    ap.add_argument("--preset", default="nvme", help="a preset with the optimizer off the device")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--freeze", choices=("base", "bitfit"), default="base",
                    help="base: all but the last --train-blocks blocks and the final norm; bitfit: every matrix")
    ap.add_argument("--train-blocks", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--unfrozen-steps", type=int, default=2)
    ap.add_argument("--bf16-values", action="store_true",
                    help="initial weights rounded to bf16 (as loaded from a bf16 checkpoint)")
    ap.add_argument("--max-live", type=int, default=0,
                    help="partition.max_live_parameters (elements; 0: no bound); the report gives the peak")
    ap.add_argument("--workdir", default=None, help="where the swap files go (default: the system's temp dir)")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.unfrozen_steps < 1:
        ap.error("--steps must be at least 2 and --unfrozen-steps at least 1")

    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        runs = {f"frozen {when}": build(args, when, workdir) for when in _WHEN}
        model = runs["frozen in Init"][0]
        backward = {name: _watch_held(m) for name, (m, _) in runs.items()}
        tier = load_config(args.preset).tiers.optimizer
        params = sum(p.numel() for p in model.parameters())
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        data = batches("random", args.batch, args.seq, preset(args.model).vocab_size, seed=0)
        times, equal = _steps(runs, args.steps, data)
        held = {name: _tier_bytes(m, tier) for name, (m, _) in runs.items()}
        held_backward = {name: seen["peak"] for name, seen in backward.items()}
        peak_live = {name: infinity.stats(m)["fetch"]["peak_live_numel"] for name, (m, _) in runs.items()}
        for m, _ in runs.values():
            m.requires_grad_(True)
        _, equal_after = _steps(runs, args.unfrozen_steps, data)
        unfrozen = {name: _tier_bytes(m, tier) for name, (m, _) in runs.items()}
        for m, _ in runs.values():
            infinity.release(m)

    names = list(runs)
    last = names[-1]

    def ratio(name: str) -> float:
        return statistics.median(a / b for a, b in zip(times[name][1:], times[last][1:]))

    report = {
        "model": args.model, "preset": args.preset, "freeze": args.freeze, "dtype": args.dtype,
        "bf16_values": args.bf16_values, "max_live_parameters": args.max_live,
        "optimizer_tier": tier,
        "params": params, "frozen_params": frozen,
        "rows": [{"run": name, "tier_bytes": held[name], "tier_bytes_unfrozen": unfrozen[name],
                  "saved_bytes_per_frozen_param": (held[last] - held[name]) / max(frozen, 1),
                  "backward_held_peak_bytes": held_backward[name], "peak_live_numel": peak_live[name],
                  "step_s": statistics.median(times[name][1:]), "step_ratio": ratio(name),
                  "optimizer_created_s": _created_s[name.removeprefix("frozen ")]} for name in names],
        "losses_equal": equal, "losses_equal_unfrozen": equal_after,
    }
    print(f"GPT {args.model}, {args.preset}, {args.dtype}{', bf16 values' if args.bf16_values else ''}, "
          f"frozen: {args.freeze}: "
          f"{params:,} parameters, {frozen:,} frozen; "
          f"optimizer tier: {tier}")
    print(f"{'run':<28}{'tier bytes':>16}{'saved B/frozen param':>22}{'after unfreezing':>18}{'step s':>9}"
          f"{'vs last':>9}{'AdamW() s':>11}{'held in bwd':>14}{'peak live':>13}")
    for row in report["rows"]:
        print(f"{row['run']:<28}{row['tier_bytes']:>16,}{row['saved_bytes_per_frozen_param']:>22.2f}"
              f"{row['tier_bytes_unfrozen']:>18,}{row['step_s']:>9.3f}{row['step_ratio']:>8.2f}x"
              f"{row['optimizer_created_s']:>11.3f}{row['backward_held_peak_bytes']:>14,}{row['peak_live_numel']:>13,}")
    print(f"step ratios: medians of pairs; losses equal: {equal} (frozen), {equal_after} (unfrozen); held in bwd: "
          "the most bytes gathered at once for running modules and backward, in the frozen steps; peak live: "
          f"the most parameter elements gathered at once then, read-aheads included (bound: {args.max_live or 'none'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
