"""ZeRO stages 1, 2 and 3 side by side at several world sizes (gloo on the CPU).

    python benchmarks/stages.py --worlds 2,4 --json out/stages.json

For each world size N, N ranks are spawned (gloo, one thread each); every rank builds the example
GPT once per stage (``[partition] stage``, the optimizer's states in ``--optimizer``), and the
stages take turns of ``--steps`` steps, ``--rounds`` times, so a drift of the machine's load
hits all of them. Per stage it prints, for rank 0: seconds per step (median of the counted
steps; the first step of each turn records the trace and is not counted), the bytes the rank
sent through collectives in the last step (``infinity.stats(model)["comm"]``) beside the ZeRO
paper's figure (``infinity.plan.comm_per_rank``: 2 Psi (N-1)/N for stages 1 and 2, 3 Psi (N-1)/N
for stage 3, in the compute dtype), and the bytes the rank holds on the compute device and in
host memory, measured (tiers, gathered parameters, stage 1's whole gradients) beside what
``infinity-plan`` says for the same model and config (less the device prefetch budget, a bound
rather than memory held). The example GPT's output layer uses the token embedding's weight as an
argument, which the plan (it counts the modules holding a parameter) does not see: at stage 3 the
measured volume is one gather of that weight above the plan's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import infinity
from infinity import Init  # before any process group: [Note: torch._dynamo and the default process group]
from infinity.config import load_config
from infinity.examples.gpt import GPT, GPTConfig
from infinity.plan import comm_per_rank, plan


def shape(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                     d_model=args.d_model)


def config(args, stage: int, nvme: str):
    return load_config(None, overrides={
        "tiers": {"params": "device" if stage < 3 else args.params, "optimizer": args.optimizer,
                  "device": "cpu", "nvme_path": nvme},
        "precision": {"dtype": args.dtype}, "partition": {"stage": stage}})


def measured_bytes(stats: dict) -> dict:
    """Device and host bytes this rank holds: the tiers' keys, the gather arena's peak, whole gradients
    (device), the host allocator's current bytes (host)."""
    tiers = stats["tiers"]
    device = tiers.get("device", {}).get("bytes_in_use", 0) + stats["gather_memory"]["peak_bytes"]
    device += stats["whole_gradient_bytes"]
    host = tiers.get("host_allocator", {}).get("bytes_allocated", 0)   # held now, not construction's peak
    return {"device": device, "host": host}


def rank_main(rank: int, world: int, workdir: str, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    try:
        gpt = shape(args)
        models = {}
        for stage in args.stages:
            nvme = os.path.join(workdir, f"nvme-{stage}-{rank}")
            os.makedirs(nvme, exist_ok=True)
            torch.manual_seed(0)
            with Init(config(args, stage, nvme)):
                model = GPT(gpt)
            models[stage] = (model, infinity.AdamW(model, lr=1e-4))
        g = torch.Generator().manual_seed(rank)
        idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        tgt = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        times = {stage: [] for stage in args.stages}
        for _ in range(args.rounds):
            for stage, (model, opt) in models.items():
                for step in range(args.steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    model(idx, tgt).backward()
                    opt.step()
                    opt.zero_grad()
                    opt.synchronize()
                    if step:
                        times[stage].append(time.perf_counter() - t0)
        if rank == 0:
            out = {}
            for stage, (model, _) in models.items():
                stats = infinity.stats(model)
                cfg = config(args, stage, workdir)
                expected = plan(GPT(gpt), cfg, world_size=world, check_fit=False)
                psi = sum(p.numel() for p in GPT(gpt).parameters())
                itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
                out[stage] = {
                    "s_per_step": statistics.median(times[stage]),
                    "comm": stats["comm"],
                    "comm_paper": comm_per_rank(psi, world, stage, itemsize, itemsize),
                    "comm_plan": expected.all_gather_bytes + expected.reduce_scatter_bytes,
                    "measured": measured_bytes(stats),
                    # The prefetch budget is a bound the prefetcher keeps under, not memory held: left out.
                    "plan": {tier: expected.tier_bytes(tier) - sum(r.nbytes for r in expected.rows
                                                                   if r.tier == tier and r.key == "device_prefetch")
                             for tier in ("device", "host")},
                    "psi": psi,
                }
            with open(os.path.join(workdir, "result.json"), "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


def mib(n: int) -> str:
    return f"{n / 2**20:8.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--optimizer", default="host", choices=("device", "host", "nvme"))
    ap.add_argument("--params", default="host", choices=("device", "host", "nvme"), help="stage 3's parameter tier")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="steps per turn (the first not counted)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.stages = [int(s) for s in args.stages.split(",")]
    results = {"machine": platform.node(), "cpus": os.cpu_count(), "args": vars(args), "worlds": {}}
    print(f"{'N':>2} {'stage':>5} {'s/step':>7} {'sent MiB':>9} {'paper MiB':>9} {'ratio':>6} "
          f"{'plan MiB':>9} {'device MiB':>10} {'plan':>8} {'host MiB':>9} {'plan':>8}")
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory(prefix="infinity-stages-") as workdir:
            mp.start_processes(rank_main, args=(world, workdir, args), nprocs=world, start_method="spawn")
            with open(os.path.join(workdir, "result.json")) as f:
                out = json.load(f)
        results["worlds"][world] = out
        for stage, r in out.items():
            comm = r["comm"]
            sent = comm["all_gather_bytes"] + comm["reduce_scatter_bytes"]
            print(f"{world:>2} {stage:>5} {r['s_per_step']:7.3f} {mib(sent):>9} {mib(r['comm_paper']):>9} "
                  f"{sent / r['comm_paper']:6.3f} {mib(r['comm_plan']):>9} {mib(r['measured']['device']):>10} "
                  f"{mib(r['plan']['device']):>8} {mib(r['measured']['host']):>9} {mib(r['plan']['host']):>8}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
