"""Saving a transformers model trained with infinity: ``infinity.save_pretrained`` (the files planned first,
each module's tensors written as it is gathered, [Note: save_pretrained streamed] in
infinity/runtime/hf_save.py) against ``model.save_pretrained(d, state_dict=infinity.state_dict(model))``
(the whole state dict in host memory first).

One engine over a Llama-shaped model of about ``--numel`` parameters (compute dtype bf16, values as
built), the two ways alternating for ``--rounds`` (each first in every other round) into two directories
under ``--dir``; per way the peak RSS above the RSS before the call (the C heap trimmed first; psutil,
sampled every 2 ms), the median seconds, and whether the two directories hold the same tensors.

    python benchmarks/save_pretrained.py --dir /tmp/save --numel 1.1e9 --preset offload-host
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

import torch  # noqa: E402
import transformers  # noqa: E402

import infinity  # noqa: E402
from benchmarks.pretrained import _llama_config, _Peak  # noqa: E402
from infinity.config import load_config  # noqa: E402
from tiers.host_alloc import trim_c_heap  # noqa: E402

GB = 1e9


def _whole(model, directory: str, shard_size: str) -> None:
    model.save_pretrained(directory, state_dict=infinity.state_dict(model), max_shard_size=shard_size)


def _streamed(model, directory: str, shard_size: str) -> None:
    infinity.save_pretrained(model, directory, max_shard_size=shard_size)


WAYS = {"save_pretrained(state_dict=infinity.state_dict)": _whole, "infinity.save_pretrained": _streamed}


def _tensors(directory: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="the two output directories go under it (removed at the end)")
    ap.add_argument("--numel", type=float, default=1.1e9, help="parameters of the Llama-shaped model")
    ap.add_argument("--hidden", type=int, default=None, help="a tiny model of this width (smoke runs)")
    ap.add_argument("--preset", default="offload-host", help="infinity config preset")
    ap.add_argument("--path", default=None, help="nvme_path, for presets with NVMe tiers")
    ap.add_argument("--shard-size", default="5GB", help="max_shard_size of both ways")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    config = _llama_config(int(args.numel))
    if args.hidden is not None:
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=32, tie_word_embeddings=False)
    overrides = {"tiers": {"device": "cpu", **({"nvme_path": args.path} if args.path else {})},
                 "precision": {"dtype": "bfloat16"}}
    torch.manual_seed(0)
    with infinity.Init(load_config(args.preset, overrides=overrides)):
        model = transformers.LlamaForCausalLM(config)
    params = model.num_parameters()
    dirs = {way: os.path.join(args.dir, f"way{i}") for i, way in enumerate(WAYS)}
    seconds = {way: [] for way in WAYS}
    growth = {way: [] for way in WAYS}
    for round_ in range(args.rounds):
        for way in list(WAYS)[::-1] if round_ % 2 else WAYS:     # each way first in every other round
            trim_c_heap()       # what an earlier call freed is not counted against the next
            peak = _Peak()
            t0 = time.perf_counter()
            WAYS[way](model, dirs[way], args.shard_size)
            seconds[way].append(time.perf_counter() - t0)
            growth[way].append(peak.stop())
    infinity.release(model)
    a, b = (_tensors(d) for d in dirs.values())
    equal = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    files = sum(os.path.getsize(os.path.join(dirs["infinity.save_pretrained"], n))
                for n in os.listdir(dirs["infinity.save_pretrained"]) if n.endswith(".safetensors"))
    del a, b
    shutil.rmtree(args.dir, ignore_errors=True)
    rows = {way: {"rss_growth_bytes": statistics.median(growth[way]), "median_s": statistics.median(seconds[way])}
            for way in WAYS}
    print(f"{'way':<50}{'RSS growth GB':>14}{'median s':>10}")
    for way, row in rows.items():
        print(f"{way:<50}{row['rss_growth_bytes'] / GB:>14.2f}{row['median_s']:>10.2f}")
    print(f"Llama {params / 1e9:.2f}B parameters in bfloat16, {files / GB:.2f} GB of safetensors, preset "
          f"{args.preset}; same tensors: {equal}")
    report = {"parameters": params, "preset": args.preset, "files_bytes": files, "equal": equal, "ways": rows,
              "samples": {"seconds": seconds, "rss_growth_bytes": growth}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
