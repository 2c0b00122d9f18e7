"""Train the example GPT with infinity (or plain PyTorch, for comparison).

Usage::

    python -m infinity.examples.train_gpt --config nvme --model-size 125M \\
        --steps 20 --batch 4 --seq 256 --nvme-dir /mnt/nvme --json run.json

    torchrun --nproc-per-node 2 -m infinity.examples.train_gpt --config offload-host ...

``--config`` is a shipped preset (``device``, ``offload-optimizer``, ``offload-host``,
``nvme``) or a ``.toml`` / ``.json`` file; ``--set section.key=value`` changes one key
(``--set prefetch.enabled=false``). ``--engine torch`` trains the same model with
``torch.optim.AdamW`` and no offload: the baseline the benchmarks compare with.

The loop is ordinary PyTorch: ``loss.backward(); opt.step(); opt.zero_grad()``.
Everything else here is measurement (``meter.StepMeter``) and reporting.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass

import psutil
import torch
import torch.nn.functional as F

from infinity.examples import data
from infinity.examples.console import Progress, summary_table
from infinity.examples.gpt import GPT, PRESETS, preset
from infinity.examples.llama import LLAMA_PRESETS, Llama, llama_preset
from infinity.examples.meter import StepMeter, gpu_peak_flops, peak_rss_bytes

ENGINES = ("infinity", "torch")


@dataclass(frozen=True)
class TrainOptions:
    """One training run: the command-line flags, typed (``--help`` describes each).

    Attributes
    ----------
    config:
        Preset name or config file for ``infinity.Init`` (ignored by ``engine="torch"``).
    model_size:
        A key of ``gpt.PRESETS`` or ``llama.LLAMA_PRESETS``; ``layers``, ``d_model``, ``heads``,
        ``vocab``, ``seq_len`` (and ``intermediate``, Llama only) override single fields of it.
    steps, batch, seq:
        Training steps, sequences per rank per step, tokens per sequence (None: min(256, seq_len)).
    nvme_dir:
        Swap directory (sets ``tiers.nvme_path``).
    json, checkpoint, resume:
        Where the report goes, where to save a checkpoint at the end, which to load first.
    checkpoint_in_place:
        Save that checkpoint in place: the swap files become it, no copy is written
        (``save_checkpoint(..., in_place=True)``); resume it with the same ``nvme_dir``.
    data:
        ``random``, ``repeat`` or ``text`` (see ``data.py``).
    lr, weight_decay, seed:
        AdamW settings and the seed of the weights and the data.
    warmup_steps, max_grad_norm:
        Steps of linear learning-rate warm-up (a torch ``LambdaLR``; 0: none) and the gradient
        norm ``torch.nn.utils.clip_grad_norm_`` clips to (0: no clipping), for both engines.
    engine:
        ``infinity``, or ``torch`` for the plain-PyTorch baseline.
    overrides:
        ``section.key=value`` config changes (values parsed as JSON when they parse).
    progress, every, quiet:
        How the command line shows progress and whether it prints the summary table.
    """

    config: str = "nvme"
    model_size: str = "tiny"
    steps: int = 10
    batch: int = 4
    seq: int | None = None
    nvme_dir: str | None = None
    json: str | None = None
    checkpoint: str | None = None
    checkpoint_in_place: bool = False
    resume: str | None = None
    data: str = "random"
    lr: float = 3e-4
    weight_decay: float = 0.0
    seed: int = 0
    warmup_steps: int = 0
    max_grad_norm: float = 0.0
    engine: str = "infinity"
    overrides: tuple[str, ...] = ()
    layers: int | None = None
    d_model: int | None = None
    heads: int | None = None
    vocab: int | None = None
    seq_len: int | None = None
    intermediate: int | None = None
    progress: str = "auto"
    every: int = 1
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine {self.engine!r}: choose one of {', '.join(ENGINES)}")
        if self.steps < 1 or self.batch < 1:
            raise ValueError(f"--steps ({self.steps}) and --batch ({self.batch}) must be >= 1")
        if self.intermediate is not None and self.model_size not in LLAMA_PRESETS:
            raise ValueError(f"--intermediate is a Llama field; --model-size {self.model_size!r} is a GPT shape")


def parse_overrides(items: tuple[str, ...] | list[str]) -> dict:
    """``["prefetch.enabled=false", "tiers.params=nvme"]`` -> nested config overrides.

    Read as ``infinity-plan --set`` reads them (``infinity.config.parse_overrides``): values as JSON
    when they parse (``false``, ``8``, ``[\"a\"]``), else as strings.
    """
    from infinity.config import ConfigError, parse_overrides as parse

    try:
        return parse(items)
    except ConfigError as exc:
        raise ValueError(f"--set {exc}") from None


def load_engine_config(options: TrainOptions):
    """The infinity Config for ``options``: the preset or file, ``--set`` keys, ``--nvme-dir``."""
    from infinity.config import load_config

    overrides = parse_overrides(options.overrides)
    if options.engine == "torch":
        # The baseline has no tiers: only [precision] (from --set) matters; the preset is ignored.
        return load_config(None, overrides=overrides or None)
    if options.nvme_dir:
        os.makedirs(options.nvme_dir, exist_ok=True)
        overrides.setdefault("tiers", {})["nvme_path"] = options.nvme_dir
    return load_config(options.config, overrides=overrides or None)


def model_config(options: TrainOptions):
    """The model shape: the preset, with --layers/--d-model/--heads/--vocab/--seq-len applied
    (and --intermediate for a Llama preset).

    The position table (GPT) or longest input (Llama) is grown to ``--seq`` when that is longer
    than the preset's.
    """
    llama = options.model_size in LLAMA_PRESETS
    base = LLAMA_PRESETS[options.model_size] if llama else PRESETS[options.model_size]
    seq_len = options.seq_len
    if seq_len is None and options.seq is not None and options.seq > base.seq_len:
        seq_len = options.seq
    fields = dict(n_layer=options.layers, d_model=options.d_model, n_head=options.heads,
                  vocab_size=options.vocab, seq_len=seq_len)
    if llama:
        return llama_preset(options.model_size, intermediate=options.intermediate, **fields)
    return preset(options.model_size, **fields)


def build_model(model_cfg, linear=F.linear):
    """The module for a shape: ``Llama`` for a ``LlamaConfig``, else ``GPT`` with ``linear`` as its tied
    head's product (Llama's untied head is an ``nn.Linear``)."""
    return Llama(model_cfg) if hasattr(model_cfg, "intermediate") else GPT(model_cfg, linear=linear)


def _distributed(device: str) -> tuple[int, int]:
    """Join the torchrun job when launched by one (WORLD_SIZE > 1); returns (rank, world size).

    ``device`` is the compute device ("cpu" or "cuda"): NCCL for a GPU, gloo for the CPU.
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        # The engine is imported before the group, so that torch keeps no hold on it and
        # main() can destroy it: [Note: torch._dynamo and the default process group].
        from infinity import Init  # noqa: F401
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def machine() -> dict:
    """The machine a report was measured on, and the source revision it ran."""
    return {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "load_average": os.getloadavg(), "source": source_revision(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def provenance(script: str, argv: list[str], measured_on: dict | None = None) -> dict:
    """When, on what, at which commit and by which command a run was measured: what every stored run in
    docs/benchmarks/data/ carries, so a benchmark's --json file can be added there as it is
    (benchmarks/plots.py). ``script``: the benchmark's path from the repository root."""
    measured_on = measured_on or machine()
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": f"{measured_on['gpu'] or 'CPU'}, {measured_on['cpus']} cores, {measured_on['host']}",
            "commit": measured_on["source"], "command": shlex.join(["python", script, *argv])}


def source_revision() -> str | None:
    """``git describe --always --dirty`` of the checkout infinity runs from (None outside git)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


@dataclass(frozen=True)
class _Run:
    """What the loop trains: the model, its optimizer, where its inputs go, and the baseline's autocast."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    autocast_dtype: torch.dtype | None = None
    config: object = None       # the engine's config, "auto" tiers resolved (None: plain PyTorch)


def _build(options: TrainOptions, model_cfg, config) -> _Run:
    torch.manual_seed(options.seed)
    if options.engine == "torch":
        device = torch.device(config.tiers.compute_device())   # where the engine would compute
        model = build_model(model_cfg).to(device)
        fused = {"fused": True} if device.type in ("cuda", "cpu") else {}
        opt = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay, **fused)
        dtype = config.precision.torch_dtype
        return _Run(model, opt, device, None if dtype == torch.float32 else dtype)
    import infinity

    from infinity.checkpoint.in_place import saved_in_place
    from infinity.tiling.widened import widened_linear

    # A checkpoint in place is taken over while the model is built ([Note: checkpoints in place]).
    resume = options.resume if options.resume and saved_in_place(options.resume) else None
    # With [precision] cpu_linear = "float32", Init converts the linear layers; the tied head is a
    # function of the embedding weight, so it is built with the fp32 product ([Note: tied output head]).
    linear = widened_linear if config.precision.cpu_linear == "float32" else F.linear
    sized = {}
    if "auto" in (config.tiers.params, config.tiers.optimizer):
        # "auto" tiers place the states of a model of known size: the same model, on the meta device.
        with torch.device("meta"):
            sized["model"] = build_model(model_cfg, linear)
    with infinity.Init(config, resume=resume, **sized) as init:
        model = build_model(model_cfg, linear)
    opt = infinity.AdamW(model, lr=options.lr, weight_decay=options.weight_decay)
    from infinity import registry

    device = registry.engine_of(model, "train_gpt").device.device
    return _Run(model, opt, device, config=init.config)


def _resume(run: _Run, options: TrainOptions) -> None:
    """Load ``--resume`` (a checkpoint directory) into the model and optimizer before training."""
    if options.engine == "torch":
        state = torch.load(os.path.join(options.resume, "checkpoint.pt"), map_location=run.device)
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        return
    import infinity

    infinity.load_checkpoint(options.resume, run.model, run.optimizer)


def _save_checkpoint(run: _Run, options: TrainOptions, step: int) -> dict:
    """Write a checkpoint with infinity.save_checkpoint (torch.save for the baseline).

    Returns where it went (``path``: the committed version's directory), or, in a build
    without ``infinity.checkpoint``, ``path`` None and a ``note`` saying so.
    """
    path = options.checkpoint
    t0 = time.perf_counter()
    if options.engine == "torch":
        os.makedirs(path, exist_ok=True)
        torch.save({"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "step": step},
                   os.path.join(path, "checkpoint.pt"))
    else:
        try:
            import infinity.checkpoint  # noqa: F401  (written in parallel; absent in early builds)
        except ModuleNotFoundError as exc:
            if exc.name != "infinity.checkpoint":
                raise
            return {"path": None, "note": "not written: infinity.checkpoint is not part of this build yet "
                                          "(infinity.save_checkpoint unavailable)"}
        import infinity

        path = infinity.save_checkpoint(path, run.model, run.optimizer, extra={"step": step},
                                        in_place=options.checkpoint_in_place)
    out = {"path": os.path.abspath(path), "seconds": time.perf_counter() - t0, "nbytes": _tree_nbytes(path)}
    if options.checkpoint_in_place:     # the states are the sealed swap files: count them too
        sealed = [os.path.join(d, f) for d, _, files in os.walk(options.nvme_dir or ".") for f in files
                  if f.endswith(".sealed")]
        out.update(in_place=True, sealed_nbytes=sum(os.stat(f).st_blocks * 512 for f in sealed))
    return out


def _tree_nbytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def train(options: TrainOptions, progress: Progress | None = None) -> dict:
    """Build the model, train ``options.steps`` steps, and return the report (a JSON-able dict).

    Parameters
    ----------
    options:
        The run.
    progress:
        Where each step is shown (None: nothing is printed while training).

    Examples
    --------
    >>> report = train(TrainOptions(config="device", model_size="tiny", steps=3))   # doctest: +SKIP
    >>> report["summary"]["tokens_per_second"]                                      # doctest: +SKIP
    """
    config = load_engine_config(options)
    rank, world = _distributed(config.tiers.compute_device())
    model_cfg = model_config(options)
    seq = options.seq or min(model_cfg.seq_len, 256)
    rss_before = peak_rss_bytes()
    t0 = time.perf_counter()
    run = _build(options, model_cfg, config)
    config = run.config or config       # the report names the tiers "auto" chose
    construct_s = time.perf_counter() - t0
    rss_built = peak_rss_bytes()
    if options.resume:
        _resume(run, options)
    sync = torch.cuda.synchronize if run.device.type == "cuda" else None
    meter = StepMeter(run.model, sync=sync)
    source = data.batches(options.data, options.batch, seq, model_cfg.vocab_size, seed=options.seed,
                          rank=rank, device=run.device)
    warmup = options.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    for step in range(options.steps):
        x, y = next(source)
        meter.begin()
        if run.autocast_dtype is not None:
            with torch.autocast(run.device.type, dtype=run.autocast_dtype):
                loss = run.model(x, y)
        else:
            loss = run.model(x, y)
        loss.backward()
        meter.forward_backward_done()
        if options.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), options.max_grad_norm)
        run.optimizer.step()
        schedule.step()
        run.optimizer.zero_grad()
        record = meter.end(loss=loss.item(), tokens=x.numel() * world)
        if progress is not None and rank == 0:
            progress.update(record)
    if progress is not None:
        progress.close()
    checkpoint = _save_checkpoint(run, options, options.steps) if options.checkpoint else None
    summary = meter.summary()
    flops = model_cfg.flops_per_token(seq)
    peak = gpu_peak_flops(str(config.precision.dtype))
    tps = summary.get("tokens_per_second") or 0.0
    report = {
        "options": asdict(options),
        "config": config.to_dict(),
        "tiers_text": _tiers_text(options, config),
        "model": {"size": options.model_size, **asdict(model_cfg), "n_params": model_cfg.n_params,
                  "states_nbytes": model_cfg.states_nbytes(), "seq": seq, "flops_per_token": flops},
        "machine": machine(),
        "rank": rank, "world_size": world,
        "construct_seconds": construct_s,
        "peak_rss_before_build_bytes": rss_before,
        "peak_rss_after_build_bytes": rss_built,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else None,
        "steps": [r.as_dict() for r in meter.records],
        "summary": summary,
        "achieved_flops": flops * tps,
        "mfu": flops * tps / (peak * world) if peak else None,
        "checkpoint": checkpoint,
        "engine_stats": _final_stats(run.model),
    }
    if options.json and rank == 0:
        report["json_path"] = os.path.abspath(options.json)
        with open(options.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def _tiers_text(options: TrainOptions, config) -> str:
    if options.engine == "torch":
        return "plain PyTorch (torch.optim.AdamW, no offload)"
    t = config.tiers
    extra = [f"prefetch {'on' if config.prefetch.enabled else 'off'}",
             f"dpu {'on' if config.dpu.enabled else 'off'}", str(config.precision.dtype)]
    return f"params {t.params}, optimizer {t.optimizer} ({', '.join(extra)})"


def _final_stats(model) -> dict | None:
    from infinity.examples.meter import engine_stats

    stats = engine_stats(model)
    if stats is not None:
        stats = {k: v for k, v in stats.items() if k != "steps"}
    return stats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infinity.examples.train_gpt", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="nvme", help="preset name (device, offload-optimizer, offload-host, "
                                                     "nvme) or a .toml/.json file (default: nvme)")
    p.add_argument("--model-size", default="tiny", choices=[*PRESETS, *LLAMA_PRESETS],
                   help="model shape (default: tiny)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: min(256, model's))")
    p.add_argument("--nvme-dir", default=None, help="directory for the NVMe swap files (tiers.nvme_path)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--checkpoint", default=None, help="save a checkpoint into this directory at the end")
    p.add_argument("--checkpoint-in-place", action="store_true",
                   help="save it in place: the swap files become the checkpoint (no copy; training ends; "
                        "resume it with --resume and the same --nvme-dir)")
    p.add_argument("--resume", default=None, help="load this checkpoint (a --checkpoint directory) first")
    p.add_argument("--data", default="random", choices=data.SOURCES)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=0, help="steps of linear learning-rate warm-up")
    p.add_argument("--max-grad-norm", type=float, default=0.0, help="clip gradients to this norm (0: off)")
    p.add_argument("--engine", default="infinity", choices=ENGINES,
                   help="infinity, or torch: the same model with torch.optim.AdamW and no offload")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key, e.g. --set prefetch.enabled=false (repeatable)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's n_layer")
    p.add_argument("--d-model", type=int, default=None, help="override the preset's d_model")
    p.add_argument("--heads", type=int, default=None, help="override the preset's n_head")
    p.add_argument("--vocab", type=int, default=None, help="override the preset's vocab_size")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's seq_len (position table)")
    p.add_argument("--intermediate", type=int, default=None, help="override a Llama preset's MLP width")
    p.add_argument("--progress", default="auto", choices=("auto", "tqdm", "plain", "none"))
    p.add_argument("--every", type=int, default=1, help="plain progress: print every N steps")
    p.add_argument("--quiet", action="store_true", help="no summary table")
    return p


def options_from_args(argv: list[str] | None = None) -> TrainOptions:
    args = vars(build_parser().parse_args(argv))
    args["overrides"] = tuple(args["overrides"])
    return TrainOptions(**args)


def main(argv: list[str] | None = None) -> int:
    options = options_from_args(argv)
    progress = None
    # Under torchrun only rank 0 draws progress (the others' bars would interleave).
    if options.progress != "none" and int(os.environ.get("RANK", "0")) == 0:
        progress = Progress(options.steps, use_tqdm={"auto": None, "tqdm": True, "plain": False}[options.progress],
                            every=options.every)
    report = train(options, progress)
    if report["rank"] == 0 and not options.quiet:
        print(summary_table(report), flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        # Its worker threads stop here, not in the interpreter's teardown (pytorch/pytorch#190489).
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
