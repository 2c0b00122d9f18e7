"""The floor the CPU overhead ratio cannot go under: the copies the data path's contract requires, beside a torch step.

    python benchmarks/copy_floor.py --size 125M --batch 2 --seq 128 --json out/floor.json

On the CPU the engine runs the GPU's data path: host<->device copies are memcpys between the
tiers' host memory and the compute device's buffers (see [Note: the data path] in
infinity/runtime/datapath.py). With ``offload-host`` a step must copy every parameter to the
"device" in forward and again in backward and every gradient shard back, as its transfer ledger
books. This times exactly that many copies of those sizes (the ledger of one step of the preset,
measured here first) between fresh buffers, alternating with plain torch steps of the same GPT,
and prints ``1 + copies / torch step``: the ratio a CPU run of the preset cannot beat while it moves
the bytes a GPU run must move.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import infinity
from infinity.config import load_config
from infinity.examples.gpt import GPT, preset


def ledger(size: str, batch: int, seq: int) -> dict:
    """One steady step's transfer ledger of ``offload-host`` (fp32, CPU)."""
    cfg = load_config("offload-host", overrides={"tiers": {"device": "cpu"}, "precision": {"dtype": "float32"}})
    torch.manual_seed(0)
    shape = preset(size, seq_len=seq)
    with infinity.Init(cfg):
        model = GPT(shape)
    opt = infinity.AdamW(model, lr=1e-4)
    idx = torch.randint(0, shape.vocab_size, (batch, seq))
    for _ in range(3):
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()
    out = infinity.stats(model)["transfers"]
    infinity.release(model)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="125M")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    books = ledger(args.size, args.batch, args.seq)
    h2d, d2h = books["host_to_device"], books["device_to_host"]
    # Copies of the ledger's mean sizes, in fp32 elements, walking fresh memory as the real ones do.
    sizes = [h2d["bytes"] // h2d["copies"] // 4] * h2d["copies"] + [d2h["bytes"] // d2h["copies"] // 4] * d2h["copies"]
    src, dst = torch.randn(sum(sizes)), torch.empty(sum(sizes))

    def copies() -> None:
        offset = 0
        for n in sizes:
            dst[offset:offset + n].copy_(src[offset:offset + n])
            offset += n

    torch.manual_seed(0)
    shape = preset(args.size, seq_len=args.seq)
    model = GPT(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, shape.vocab_size, (args.batch, args.seq))

    def step() -> None:
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
        copies()
    steps, copy_times = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        copies()
        copy_times.append(time.perf_counter() - t0)
    step_s, copy_s = statistics.median(steps), statistics.median(copy_times)
    nbytes = sum(sizes) * 4
    result = {"size": args.size, "batch": args.batch, "seq": args.seq, "threads": torch.get_num_threads(),
              "ledger": books, "torch_step_s": step_s, "copies_s": copy_s, "copy_gbps": nbytes / copy_s / 1e9,
              "floor_ratio": 1 + copy_s / step_s}
    print(f"{args.size} batch {args.batch}x{args.seq}: torch step {step_s:.3f} s; the contract's copies "
          f"({len(sizes)} copies, {nbytes / 1e9:.2f} GB) {copy_s:.3f} s at {result['copy_gbps']:.1f} GB/s; "
          f"offload-host cannot beat {result['floor_ratio']:.3f}x torch here")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
