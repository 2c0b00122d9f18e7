"""The example GPT trained under DeepSpeed ZeRO with CPU or NVMe offload: the peer rows of benchmarks/gpu.py.

    python benchmarks/deepspeed_gpt.py --stage 2 --model-size 350M --batch 8 --seq 1024 \\
        --dtype bfloat16 --steps 6 --json ds.json
    python benchmarks/deepspeed_gpt.py --stage 3 --nvme-dir /mnt/nvme --model-size 350M --json ds.json

``--stage 2``: ZeRO-2 with ``offload_optimizer`` on the CPU (DeepSpeed's ZeRO-Offload: fp32
master weights and Adam states in pinned host memory, stepped by ``DeepSpeedCPUAdam``);
``--stage 3``: ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on the CPU, the model
built inside ``deepspeed.zero.Init`` as DeepSpeed's users build large models;
``--stage 3 --nvme-dir DIR``: ZeRO-Infinity, both offloads on NVMe with swap files under DIR
(see ``ds_config``), the peer of infinity's ``nvme`` preset. Same model
(infinity/examples/gpt.py), data, learning rate and step meter as ``train_gpt``, so the
report has the same ``summary`` fields; it runs in its own process (one world-1 job, its
own rendezvous port). Without a GPU, DeepSpeed's CPU accelerator is used
(``DS_ACCELERATOR=cpu``, backend gloo): that is how the peer runs on the CPU machines.

Each step also records the bytes the process read from and wrote to storage
(``/proc/self/io`` through psutil), so NVMe rows can be set beside infinity's ledger:
DeepSpeed keeps no such count of its own swapping.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
from types import SimpleNamespace


# infinity's defaults ([aio] block_size and queue_depth, [partition] sub_group_size), so both engines
# swap in pieces of the same size.
AIO_BLOCK_SIZE = 8 << 20
AIO_QUEUE_DEPTH = 32
SUB_GROUP_SIZE = 32 << 20
PARAM_BUFFER_NUMEL = 10 ** 8   # DeepSpeed's offload_param buffer_size default, in elements


def ds_config(stage: int, batch: int, dtype: str, lr: float, weight_decay: float,
              nvme_dir: str | None = None, largest_param_numel: int = 0) -> dict:
    """The DeepSpeed config of a ``stage`` run with everything offloadable on the CPU, pinned, or with
    ``nvme_dir`` (stage 3 only) on NVMe: ZeRO-Infinity, its parameter buffers large enough for a
    parameter of ``largest_param_numel`` elements."""
    if nvme_dir is not None and stage != 3:
        raise ValueError(f"--nvme-dir needs --stage 3 (ZeRO-Infinity offloads parameters), got --stage {stage}")
    if nvme_dir is None:
        offload_optimizer = offload_param = {"device": "cpu", "pin_memory": True}
    else:
        offload_optimizer = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True}
        # With offload_param on NVMe, DeepSpeed still keeps up to max_in_cpu parameter elements in host
        # memory for good (default 1e9: all of a 350M or 1.3B model; stage3.py,
        # _create_param_groups_fp16_flat_cpu_memory). 0 leaves them on NVMe, where infinity's nvme preset
        # keeps them. They pass through buffer_count (default 5) buffers of buffer_size elements, each
        # at least one whole parameter: DeepSpeed's default of 1e8 is too small for GPT 1.3B's token
        # embedding (103M elements).
        offload_param = dict(offload_optimizer, max_in_cpu=0,
                             buffer_size=max(PARAM_BUFFER_NUMEL, largest_param_numel))
    zero = {"stage": stage, "offload_optimizer": offload_optimizer, "overlap_comm": True,
            "contiguous_gradients": True}
    if stage == 3:
        zero["offload_param"] = offload_param
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}},
           "zero_optimization": zero, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if nvme_dir is not None:
        # Release each parameter after use, as infinity does (prefetch.reuse_distance 0, the key
        # infinity.config.deepspeed maps this one to). DeepSpeed's default, 1e9 elements, keeps every
        # parameter of a model under ~500M gathered from its forward use to its backward one, and each
        # parameter on NVMe holds one of the buffer_count buffers while gathered: at GPT 350M the sixth
        # fetch fails ("Not enough buffers 0 for swapping 1", partitioned_param_swapper.py:310).
        zero["stage3_max_reuse_distance"] = 0
        zero["sub_group_size"] = SUB_GROUP_SIZE
        cfg["aio"] = {"block_size": AIO_BLOCK_SIZE, "queue_depth": AIO_QUEUE_DEPTH, "single_submit": False,
                      "overlap_events": True}
    if dtype == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "float16":
        cfg["fp16"] = {"enabled": True}
    return cfg


def _disk_counters():
    """This process's bytes read from and written to storage so far (all threads: DeepSpeed's aio ones too)."""
    import psutil

    return psutil.Process(os.getpid()).io_counters()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(args) -> dict:
    """Train ``args.steps`` steps and return a report with train_gpt's ``summary`` fields."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(_free_port()))):
        os.environ.setdefault(key, value)
    import deepspeed

    from infinity.examples import data
    from infinity.examples.gpt import GPT, preset
    from infinity.examples.meter import StepMeter, io_per_step, peak_rss_bytes
    from infinity.examples.train_gpt import machine

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
    model_cfg = preset(args.model_size, seq_len=max(args.seq, preset(args.model_size).seq_len))
    with torch.device("meta"):
        largest = max(p.numel() for p in GPT(model_cfg).parameters())
    cfg = ds_config(args.stage, args.batch, args.dtype, args.lr, args.weight_decay, args.nvme_dir, largest)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    if args.stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = GPT(model_cfg)
    else:
        model = GPT(model_cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    construct_s = time.perf_counter() - t0
    device = engine.device if torch.cuda.is_available() else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    meter = StepMeter(engine, sync=sync)
    source = data.batches("random", args.batch, args.seq, model_cfg.vocab_size, seed=args.seed, device=device)
    disk = []
    for _ in range(args.steps):
        x, y = next(source)
        io0 = _disk_counters()
        meter.begin()
        loss = engine(x, y)
        engine.backward(loss)
        meter.forward_backward_done()
        engine.step()
        meter.end(loss=loss.item(), tokens=x.numel())
        io1 = _disk_counters()
        disk.append(SimpleNamespace(read_bytes=io1.read_bytes - io0.read_bytes,
                                    write_bytes=io1.write_bytes - io0.write_bytes))
    summary = meter.summary()
    summary["disk_read_bytes_per_step"] = io_per_step(disk, "read_bytes")
    summary["disk_write_bytes_per_step"] = io_per_step(disk, "write_bytes")
    engine_name = f"deepspeed-zero{args.stage}" + ("-nvme" if args.nvme_dir else "")
    return {"engine": engine_name, "deepspeed_version": deepspeed.__version__,
            "ds_config": cfg, "machine": machine(), "construct_seconds": construct_s,
            "model": {"size": args.model_size, "n_params": model_cfg.n_params, "seq": args.seq,
                      "flops_per_token": model_cfg.flops_per_token(args.seq)},
            "steps": [dict(r.as_dict(), disk_read_bytes=d.read_bytes, disk_write_bytes=d.write_bytes)
                      for r, d in zip(meter.records, disk)],
            "summary": summary,
            "peak_rss_bytes": peak_rss_bytes(),
            "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, choices=(2, 3), required=True)
    p.add_argument("--nvme-dir", default=None,
                   help="with --stage 3: offload parameters and optimizer states to NVMe, swap files here")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, help="write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = train(args)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
