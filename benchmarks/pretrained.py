"""from_pretrained benchmark: peak RSS and load time, transformers' own load vs streamed into the tiers.

``--write`` saves a Llama-shaped checkpoint of about ``--numel`` parameters (fp32, random
values) with ``save_pretrained(max_shard_size=--shard-size)``. Then, ``--repeats`` times,
alternating, each in a fresh process (a process's peak RSS only grows):

- ``plain``: ``LlamaForCausalLM.from_pretrained(dir)``;
- ``infinity``: the same call inside ``infinity.Init`` with parameters and optimizer states
  on NVMe under ``--path`` and ``tiers.host_budget = --host-budget``.

Each run reports the load's wall time, the peak RSS above the RSS just before the call
(psutil, sampled every 2 ms) and the process's peak RSS (``ru_maxrss``, file pages mapped
included), then the same peak after one forward of 16 tokens, with its time: transformers
maps the files and reads a tensor only when it is first used, so its load alone reads almost
nothing. The table shows medians beside the checkpoint's size, its largest shard file and the
host budget. Example::

    python -m benchmarks.pretrained --dir /tmp/ckpt --write --path /mnt/nvme --json pretrained.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time

GB = 1e9


def _llama_config(numel: int):
    import transformers

    # Llama-1B proportions (hidden 2048, 4x MLP, 32 heads, 8 KV heads), scaled by the layer count.
    hidden, inter, vocab = 2048, 8192, 32000
    per_layer = 2 * hidden * hidden + 2 * hidden * (hidden // 4) + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((numel - 2 * vocab * hidden) / per_layer))
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                    num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                    max_position_embeddings=256, tie_word_embeddings=False)


def write(directory: str, numel: int, shard_size: str, hidden: int | None = None) -> None:
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    config = _llama_config(numel)
    if hidden is not None:      # tiny smoke runs
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=32, tie_word_embeddings=False)
    with no_init_weights():     # random values, without the init's cost
        model = transformers.LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    model.save_pretrained(directory, max_shard_size=shard_size)


class _Peak:
    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.before = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.proc.memory_info().rss) - self.before


def load_once(mode: str, directory: str, path: str, host_budget: str) -> dict:
    """One load in this process; returns its figures."""
    import torch
    import transformers

    import infinity

    torch.set_num_threads(os.cpu_count() or 1)
    model_class = transformers.LlamaForCausalLM      # transformers imports it lazily: not in the timing
    peak = _Peak()
    t0 = time.perf_counter()
    if mode == "plain":
        model = model_class.from_pretrained(directory)
    else:
        cfg = {"tiers": {"params": "nvme", "optimizer": "nvme", "nvme_path": path, "host_budget": host_budget}}
        with infinity.Init(cfg):
            model = model_class.from_pretrained(directory)
    seconds = time.perf_counter() - t0
    growth = peak.stop()
    load_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # transformers maps the files and reads nothing until a parameter is used: one forward uses them all.
    ids = torch.zeros(1, 16, dtype=torch.long)
    t0 = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids)
    forward = time.perf_counter() - t0
    if mode != "plain":
        infinity.release(model)
    return {"mode": mode, "seconds": seconds, "rss_growth": growth, "load_max_rss": load_rss,
            "forward_seconds": forward, "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _checkpoint_files(directory: str) -> list[int]:
    return [os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors")]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory (written with --write)")
    parser.add_argument("--path", required=True, help="NVMe swap directory for the infinity runs")
    parser.add_argument("--write", action="store_true", help="write the checkpoint first")
    parser.add_argument("--numel", type=float, default=1.1e9, help="parameters of the written checkpoint")
    parser.add_argument("--shard-size", default="1GB", help="save_pretrained's max_shard_size")
    parser.add_argument("--hidden", type=int, default=None, help="a tiny model of this width (smoke runs)")
    parser.add_argument("--host-budget", default="2GiB", help="tiers.host_budget of the infinity runs")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None, help="write settings, machine and raw samples here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)     # child process: one load
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(load_once(args.one, args.dir, args.path, args.host_budget)))
        return {}
    if args.write:
        write(args.dir, int(args.numel), args.shard_size, args.hidden)
    sizes = _checkpoint_files(args.dir)
    samples = []
    for _ in range(args.repeats):
        for mode in ("plain", "infinity"):
            cmd = [sys.executable, "-m", "benchmarks.pretrained", "--dir", args.dir, "--path", args.path,
                   "--host-budget", args.host_budget, "--one", mode]
            out = subprocess.run(cmd, capture_output=True, text=True,
                                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            if out.returncode != 0:
                raise RuntimeError(f"the {mode} load failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
            samples.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"checkpoint: {sum(sizes) / GB:.2f} GB in {len(sizes)} files (largest {max(sizes) / GB:.2f} GB); "
          f"host budget {args.host_budget}; {args.repeats} runs each, medians")
    print(f"{'load':<10} {'load s':>7} {'RSS growth GB':>14} {'peak RSS GB':>12} {'1st forward s':>14} "
          f"{'peak RSS after it GB':>21}")
    table = {}
    keys = ("seconds", "rss_growth", "load_max_rss", "forward_seconds", "max_rss")
    for mode in ("plain", "infinity"):
        rows = [s for s in samples if s["mode"] == mode]
        table[mode] = {k: statistics.median(r[k] for r in rows) for k in keys}
        t = table[mode]
        print(f"{mode:<10} {t['seconds']:>7.1f} {t['rss_growth'] / GB:>14.2f} {t['load_max_rss'] / GB:>12.2f} "
              f"{t['forward_seconds']:>14.1f} {t['max_rss'] / GB:>21.2f}")
    result = {"settings": vars(args), "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "checkpoint_bytes": sum(sizes), "largest_file_bytes": max(sizes), "medians": table,
              "samples": samples}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
