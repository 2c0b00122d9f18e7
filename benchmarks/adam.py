"""Host Adam throughput against the memory-bandwidth bound, in one run.

    python benchmarks/adam.py --sizes 100M,500M --json /tmp/adam.json

For each size (fp32 parameters) it measures, in alternation (one step of each variant in
turn, ``--repeats`` times; ``--rounds`` rebuilds everything), the torch-side variants sharing one
set of arrays (16 B/param); when that and ours (20 B/param) do not fit in half the free memory
together, ours runs in a second phase against its own triad:

- ``stream triad``, ``stream copy``: STREAM's triad ``a = b + s * c`` and copy ``a = b`` over doubles in C
  (``infinity.optim._qadam.triad`` / ``copy``, [Note: the STREAM baselines] in optim_csrc/qadam.c), on the
  kernels' threads (``torch.get_num_threads()``), over three separate arrays of 4x the last-level cache
  each (``--stream-numel``), the best sample of the run: the memory bandwidth, the bound's basis;
- ``triad``: the same triad with torch (fp32, ``torch.add(b, c, alpha=s, out=a)``), the median: a second
  reference (torch's loop reaches well under the C one's bandwidth on some machines);
- ``torch fused, 1 tensor``: ``torch.optim.AdamW(fused=True)`` on one flat parameter;
- ``torch fused, 100 tensors``: the same on 100 parameters (views of the same memory);
- ``torch foreach, 100 tensors``: ``torch.optim.AdamW(foreach=True)``;
- ``deepspeed CPUAdam``: ``DeepSpeedCPUAdam`` on one flat parameter, when ``deepspeed`` imports
  (its kernel is built by DeepSpeed's JIT the first time);
- ``ours (engine step)``: ``infinity.AdamW.step()`` on a model of Linear layers built in
  ``infinity.Init`` with every state on the host: the flat sub-group pass plus the fp32 compute
  copies it writes, as training runs it (the C kernel steps; the copies go to the compute device's
  tier after it: on a GPU the host->device copy, here a memcpy of 8 B/param that is part of the row);
  ``ours (engine step, torch kernel)``: the same model stepped by torch's fused kernel instead;
- ``ours (engine step, bf16 states)``, ``ours (engine step, int8 states)``: the same with
  ``[optimizer] state_dtype`` "bf16" / "int8" (same sub-group size), stepped by the compressed
  kernel (``infinity.optim.moments``); their rows give the bytes they move (bf16 24, int8 about 20
  with the compute copy) and their rate against the fp32 engine step's (``x fp32 ours``);
- ``ours (engine step, params in host memory)`` and its bf16 and int8 states twins (``--state-dtypes``
  fp32-host, bf16-host, int8-host): the same steps with ``tiers.params`` "host": the kernel writes the
  fp32 copies into the shards in its pass (no copy after it);
- ``ours (engine step, bf16 compute)``: fp32 states, bf16 compute copies (``[precision] dtype``
  "bfloat16", as GPU training runs), stepped by the fused C pass that reads the bf16 gradient and
  writes the bf16 copy in the same pass; ``..., torch kernel``: the same model stepped by torch's
  fused kernel with the gradient widened before and the copy converted after (what the engine did
  before the C pass; [Note: the fused fp32 step] in optim_csrc/qadam.c).

- ``kernel ...`` rows: the host Adam C kernels (optim_csrc/qadam.c) called directly over one flat
  sub-group of ``n`` elements, no engine around them: ``kernel fp32`` (the fused fp32 step, fp32
  gradient: 28 B), ``kernel fp32, bf16 grad + copy`` (the bf16 gradient read and the bf16 compute
  copy written in the same pass, as bf16 training runs it: 28 B), ``kernel bf16 moments`` (20 B),
  ``kernel int8 moments`` (16 B and the block scales). ``--kernels`` picks them.

An Adam step moves 28 bytes per parameter (read parameter, gradient, m, v; write parameter,
m, v); ours also writes the compute copy (32). The baselines are counted the STREAM way (triad 24 bytes
per element, copy 16; torch's fp32 triad 12), but their stores also read each line first
(write-allocate: 32, 24, 16 bytes cross the memory bus), which Adam's in-place stores do not: an Adam
row's bytes are the bus's bytes, so it is compared with the triad's bus bytes. Each row's ``GB/s moved``
is its parameters per second times the bytes it reads and writes per parameter, and ``% triad w-a`` that
rate over the C triad's write-allocate-inclusive rate measured in the same phase (over torch's when the
extension is not built); the bound is that rate / 28 bytes. The header gives both triad figures.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time

import psutil
import torch
from torch import nn

ADAM_BYTES = 28
KW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def parse_count(text: str) -> int:
    units = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


TRIAD_MAX_NUMEL = 100_000_000
# The STREAM baselines' bytes an element (doubles), as STREAM counts them and with the write-allocate read.
STREAM_BYTES = {"stream triad": 24, "stream copy": 16}
STREAM_WRITE_ALLOCATE_BYTES = {"stream triad": 32, "stream copy": 24}
TORCH_TRIAD_BYTES = 12
TORCH_TRIAD_WRITE_ALLOCATE_BYTES = 16


class Shared:
    """One set of parameter, gradient and moment arrays that every torch-side variant steps.

    Sharing keeps the memory at 16 bytes per parameter whatever the number of variants, so
    they can be measured in alternation; the values only need to stay finite.
    """

    def __init__(self, n: int) -> None:
        self.p, self.g = torch.rand(n), torch.rand(n) * 1e-2
        self.m, self.v = torch.zeros(n), torch.zeros(n)

    def pieces(self, tensors: int):
        n = self.p.numel()
        bounds = [round(i * n / tensors) for i in range(tensors + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            p = nn.Parameter(self.p[lo:hi])
            p.grad = self.g[lo:hi]
            yield p, self.m[lo:hi], self.v[lo:hi]


def triad_step(n: int):
    n = min(n, TRIAD_MAX_NUMEL)
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    return (lambda: torch.add(b, c, alpha=3.0, out=a)), n


def stream_steps(numel: int):
    """STREAM's triad and copy in C over ``numel`` doubles an array, on the kernels' threads, or why not."""
    try:
        from infinity.optim import _qadam
    except ImportError:
        return "unavailable: infinity.optim._qadam is not built (python setup.py build_ext --inplace)"
    if not hasattr(_qadam, "triad"):
        return "unavailable: this build of infinity.optim._qadam has no triad (rebuild it)"
    # Three arrays, none aliasing another, each written before it is timed (no first-touch faults).
    a, b, c = torch.zeros(numel, dtype=torch.float64), torch.rand(numel, dtype=torch.float64), \
        torch.rand(numel, dtype=torch.float64)
    threads = torch.get_num_threads()
    return {"stream triad": lambda: _qadam.triad(numel, a.data_ptr(), b.data_ptr(), c.data_ptr(), 3.0, threads),
            "stream copy": lambda: _qadam.copy(numel, a.data_ptr(), b.data_ptr(), threads)}


def torch_adamw_step(shared: Shared, tensors: int, **flags):
    pieces = list(shared.pieces(tensors))
    opt = torch.optim.AdamW([p for p, _, _ in pieces], **KW, **flags)
    for p, m, v in pieces:
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
    return opt.step


def deepspeed_step(shared: Shared):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # not installed, or its JIT build failed: reported in the table
        return f"unavailable: {type(exc).__name__}: {str(exc)[:80]}"
    (p, m, v), = shared.pieces(1)
    opt = DeepSpeedCPUAdam([p], adamw_mode=True, **KW)
    opt.state[p] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}
    return opt.step


class _Stack(nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# The engine-step rows, by their --state-dtypes key: (row name, [optimizer] state_dtype, compute dtype,
# one pass (the C kernel reads the bf16 gradient and writes the bf16 copies; False: torch's kernel or the
# compressed one with the gradient widened before and the copies converted after), bytes a parameter the
# step moves: master and gradient read, master written (12), m and v read and written (16 fp32, 8 bf16,
# 4 and their scales int8), the compute copy written (4; with bf16 compute the gradient read is 2 and
# the copy 2, put in place 2 + 2), tiers.params: "device" (the copies go to the compute device's tier
# after the kernel: on a GPU the host->device copy, here a memcpy), or "host" (the shards in host
# memory: the kernel writes the fp32 copies into them in its pass)).
_INT8_MV = 4 + 4 * 4 / 256
OURS_ROWS = {
    "fp32": ("ours (engine step)", "fp32", "float32", True, 32, "device"),
    "fp32-torch": ("ours (engine step, torch kernel)", "fp32", "float32", False, 32, "device"),
    "bf16": ("ours (engine step, bf16 states)", "bf16", "float32", True, 24, "device"),
    "int8": ("ours (engine step, int8 states)", "int8", "float32", True, 16 + _INT8_MV, "device"),
    "bf16-compute": ("ours (engine step, bf16 compute)", "fp32", "bfloat16", True, 32, "device"),
    "bf16-compute-torch": ("ours (engine step, bf16 compute, torch kernel)", "fp32", "bfloat16", False, 32, "device"),
    "int8-bf16-compute": ("ours (engine step, int8 states, bf16 compute)", "int8", "bfloat16", True, 16 + _INT8_MV,
                          "device"),
    "int8-bf16-compute-passes": ("ours (engine step, int8 states, bf16 compute, 3 passes)", "int8", "bfloat16",
                                 False, 16 + _INT8_MV, "device"),
    "fp32-host": ("ours (engine step, params in host memory)", "fp32", "float32", True, 32, "host"),
    "bf16-host": ("ours (engine step, bf16 states, params in host memory)", "bf16", "float32", True, 24, "host"),
    "int8-host": ("ours (engine step, int8 states, params in host memory)", "int8", "float32", True,
                  16 + _INT8_MV, "host"),
}
_BYTES_OF = {row[0]: row[4] for row in OURS_ROWS.values()}
# The row each engine-step row is compared with: fp32 states with the same compute dtype and parameter tier.
_REFERENCE_OF = {row[0]: OURS_ROWS["bf16-compute" if row[2] == "bfloat16" else
                                   "fp32-host" if row[5] == "host" else "fp32"][0]
                 for row in OURS_ROWS.values()}


def ours_step(n: int, workdir: str, state_dtype: str = "fp32", compute: str = "float32", c_pass: bool = True,
              params: str = "device"):
    """``infinity.AdamW.step`` on Linear layers of about ``n`` parameters, all states on the host, the
    compute copies in ``compute`` on the ``params`` tier; ``c_pass`` False steps fp32 states with torch's
    kernel (and a conversion for bf16 copies) instead of the fused C pass ([Note: the fused fp32 step] in
    optim_csrc/qadam.c)."""
    import infinity

    d = max(64, min(4096, int(n ** 0.5) // 64 * 64))
    layers = max(1, round(n / (d * d + d)))
    cfg = {"tiers": {"params": params, "optimizer": "host", "device": "cpu", "nvme_path": workdir},
           "optimizer": {"state_dtype": state_dtype}, "precision": {"dtype": compute},
           "dpu": {"overlap": False}}
    with infinity.Init(cfg):
        model = _Stack(d, layers)
    opt = infinity.AdamW(model, **KW)
    update = opt._updates.update
    update.fused, update.c_kernel = update.fused and c_pass, update.c_kernel and c_pass
    # One real backward, so that every parameter has its gradient (as the step sees it: arrived through
    # the engine, in the compute dtype); each timed step then updates every parameter with it (no
    # zero_grad between them).
    model(torch.randn(2, d, dtype=getattr(torch, compute))).float().square().mean().backward()
    return opt.step, sum(g.numel for g in opt.engine.coordinator.groups), (model, opt)


# The direct kernel rows, by their --kernels key: (row name, bytes read and written per element).
KERNEL_ROWS = {
    "fp32": ("kernel fp32", ADAM_BYTES),
    "fp32-bf16": ("kernel fp32, bf16 grad + copy", 4 + 2 + 8 + 12 + 2),
    "bf16": ("kernel bf16 moments", 8 + 4 + 8),
    "int8": ("kernel int8 moments", 8 + 2 + 4 + 2 + 2 * 2 * 4 / 256),
}


KERNEL_BYTES = dict(KERNEL_ROWS.values())


def kernel_step(shared: Shared, kind: str):
    """One call of a host Adam C kernel over the whole flat sub-group of ``shared`` (p, g; m, v too with
    fp32 moments, else moments of its own in ``kind``'s format), or why it cannot run."""
    from infinity.optim import moments

    if not moments.native():
        return "unavailable: infinity.optim._qadam is not built (python setup.py build_ext --inplace)"
    n, p, g = shared.p.numel(), shared.p, shared.g
    counter = [0]
    if kind in ("fp32", "fp32-bf16"):
        if not moments.fused_native():
            return "unavailable: this build of infinity.optim._qadam has no fused fp32 step"
        grad = g.bfloat16() if kind == "fp32-bf16" else g
        out = torch.empty(n, dtype=torch.bfloat16) if kind == "fp32-bf16" else None

        def step():
            counter[0] += 1
            moments.fused_fp32_step(n, p.data_ptr(), grad.data_ptr(), grad.dtype == torch.bfloat16,
                                    shared.m.data_ptr(), shared.v.data_ptr(), 0 if out is None else out.data_ptr(),
                                    counter[0], KW["lr"], *KW["betas"], KW["eps"], KW["weight_decay"], 0.0, True,
                                    torch.get_num_threads())
        return step
    fmt = moments.MomentFormat(kind)
    m_raw, v_raw = torch.zeros(fmt.nbytes(n), dtype=torch.uint8), torch.zeros(fmt.nbytes(n), dtype=torch.uint8)
    kernel = moments.MomentStep(fmt, use_native=True)

    def step():
        counter[0] += 1
        hyper = moments.AdamHyper(step=counter[0], lr=KW["lr"], beta1=KW["betas"][0], beta2=KW["betas"][1],
                                  eps=KW["eps"], weight_decay=KW["weight_decay"], grad_mul=1.0, decoupled=True)
        kernel(p, g, m_raw, v_raw, 0, n, hyper, seed=counter[0])
    return step


BEFORE = " [before]"


def load_build(path: str):
    """An older build of infinity.optim._qadam, from its shared object at ``path`` (``--before``)."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader("_qadam", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("_qadam", path, loader=loader))
    loader.exec_module(module)
    if hasattr(module, "stream_copies"):      # as infinity.optim.moments sets the build in use
        from infinity.optim.moments import last_level_cache_nbytes
        module.stream_copies(2 * last_level_cache_nbytes())
    return module


def built_with(module, make):
    """``make()`` (a row's step, or a tuple that starts with it, or why not) with ``module`` as the kernels'
    extension (``infinity.optim.moments._qadam``: the update pass picks its path when built), and the step
    running with it too."""
    from infinity.optim import moments

    def swapped(fn):
        saved, moments._qadam = moments._qadam, module
        try:
            return fn()
        finally:
            moments._qadam = saved

    got = swapped(make)
    if isinstance(got, str):
        return got
    step = got[0] if isinstance(got, tuple) else got
    with_module = lambda: swapped(step)  # noqa: E731
    return (with_module, *got[1:]) if isinstance(got, tuple) else with_module


def ours_name(state_dtype: str) -> str:
    return OURS_ROWS[state_dtype][0]


def run_phase(variants: dict, repeats: int, raw: dict) -> None:
    """Warm every variant up, then time one step of each in turn, ``repeats`` times."""
    for fn in variants.values():
        fn()  # lazy state, page faults, DeepSpeed's JIT build
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            raw.setdefault(name, []).append(time.perf_counter() - t0)


def machine() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "capability": torch.backends.cpu.get_cpu_capability()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100M,500M", help="parameter counts, e.g. 100M,500M")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps of each variant per round, alternating")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each rebuilding every variant")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--skip", default="", help="comma-separated variants to leave out (foreach, deepspeed, ours, "
                    "torch: every torch-side one)")
    ap.add_argument("--state-dtypes", default="fp32,fp32-torch,bf16,int8,bf16-compute,bf16-compute-torch",
                    help="[optimizer] state_dtype of the engine-step rows (fp32 is the engine's default); "
                         "fp32-torch: fp32 states stepped by torch's kernel instead of the C one; "
                         "bf16-compute: fp32 states, bf16 compute copies, stepped by the fused C pass; "
                         "bf16-compute-torch: the same by torch's kernel and a conversion; int8-bf16-compute: "
                         "int8 states, bf16 compute copies, the kernel reading the bf16 gradient and writing "
                         "the copies; int8-bf16-compute-passes: the same with the gradient widened before "
                         "and the copies converted after; fp32-host, bf16-host, int8-host: fp32, bf16 or int8 "
                         "states with the parameters in host memory (tiers.params host), the kernel writing "
                         "the fp32 copies into them")
    ap.add_argument("--kernels", default=",".join(KERNEL_ROWS),
                    help=f"the C kernels called directly over one flat sub-group, from {', '.join(KERNEL_ROWS)} "
                         "(empty: none)")
    ap.add_argument("--stream-numel", default="0", help="doubles in each array of the C triad and copy "
                    "(0: 4x the last-level caches' bytes, as STREAM asks: arrays of 4x the cache each)")
    ap.add_argument("--before", help="an older build of infinity.optim._qadam (its .so, copied aside before "
                    "rebuilding): every kernel and engine-step row also runs with it as '<row> [before]', "
                    "alternated with the build in use, so that a change is measured before and after in one run")
    ap.add_argument("--json", help="write settings, machine and raw samples here")
    args = ap.parse_args(argv)
    unknown = [k for k in args.kernels.split(",") if k and k not in KERNEL_ROWS]
    if unknown:
        ap.error(f"--kernels: {unknown[0]!r} is not one of {', '.join(KERNEL_ROWS)}")
    unknown = [d for d in args.state_dtypes.split(",") if d and d not in OURS_ROWS]
    if unknown:
        ap.error(f"--state-dtypes: {unknown[0]!r} is not one of {', '.join(OURS_ROWS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    before = load_build(args.before) if args.before else None
    sizes = [parse_count(s) for s in args.sizes.split(",")]
    from infinity.optim.moments import last_level_cache_nbytes

    llc = last_level_cache_nbytes()
    stream_numel = parse_count(args.stream_numel) or 4 * llc // 8
    results = {"settings": vars(args), "machine": {**machine(), "llc_bytes": llc}, "sizes": {}}
    with tempfile.TemporaryDirectory() as workdir:
        for n in sizes:
            raw: dict[str, list[float]] = {}
            notes: dict[str, str] = {}
            counts = {}
            # The torch-side variants share one set of arrays (16 B/param); ours owns its states
            # (20 B/param with fp32 moments, 16 with bf16, 14 with int8). Together in one phase when
            # that fits in half the free memory.
            dtypes = [d for d in args.state_dtypes.split(",") if d] if "ours" not in skip else []
            ours_nbytes = sum({"fp32": 20, "bf16": 16, "int8": 14}[OURS_ROWS[d][1]] for d in dtypes)
            ours_nbytes *= 2 if before else 1
            together = (16 + ours_nbytes) * n < psutil.virtual_memory().available // 2
            for _ in range(args.rounds):
                triad, counts["triad"] = triad_step(n)
                stream = stream_steps(stream_numel)
                if isinstance(stream, str):
                    notes["stream triad"], stream = stream, {}
                counts["stream"] = stream_numel
                shared = Shared(n)
                phase = {**stream, "triad": triad}
                if "torch" not in skip:
                    phase["torch fused, 1 tensor"] = torch_adamw_step(shared, 1, fused=True)
                    phase["torch fused, 100 tensors"] = torch_adamw_step(shared, 100, fused=True)
                if "foreach" not in skip and "torch" not in skip:
                    phase["torch foreach, 100 tensors"] = torch_adamw_step(shared, 100, foreach=True)
                if "deepspeed" not in skip and "torch" not in skip:
                    got = deepspeed_step(shared)
                    if isinstance(got, str):
                        notes["deepspeed CPUAdam"] = got
                    else:
                        phase["deepspeed CPUAdam"] = got
                for kind in filter(None, args.kernels.split(",")):
                    got = kernel_step(shared, kind)
                    if isinstance(got, str):
                        notes[KERNEL_ROWS[kind][0]] = got
                    else:
                        phase[KERNEL_ROWS[kind][0]] = got
                        if before is not None:
                            phase[KERNEL_ROWS[kind][0] + BEFORE] = built_with(before, lambda: kernel_step(shared, kind))
                if not together:
                    run_phase(phase, args.repeats, raw)
                    del shared
                    phase = {**{f"{name} (ours' phase)": fn for name, fn in stream.items()},
                             "triad (ours' phase)": triad}
                    gc.collect()
                keep = []
                for dtype in dtypes:
                    name, state_dtype, compute, one_pass, _, params = OURS_ROWS[dtype]
                    def make():
                        return ours_step(n, workdir, state_dtype, compute, c_pass=one_pass, params=params)
                    phase[name], counts["ours"], kept = make()
                    keep.append(kept)
                    if before is not None:
                        phase[name + BEFORE], _, kept = built_with(before, make)
                        keep.append(kept)
                run_phase(phase, args.repeats, raw)
                del phase, keep, triad, stream
                shared = None
                gc.collect()
            results["sizes"][n] = {"raw_seconds": raw, "notes": notes, "numel": counts, "one_phase": together,
                                   "bytes_per_param": {name: row_bytes(name) for name in raw
                                                       if not is_baseline(name)},
                                   "triad_bytes_per_element": TORCH_TRIAD_BYTES,
                                   "stream": stream_summary(raw, stream_numel),
                                   "bandwidth_basis": "stream triad" if "stream triad" in raw else "triad",
                                   "percent_of": "the basis triad's bytes with write-allocate"}
            print_table(n, raw, notes, counts, together)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def is_baseline(name: str) -> bool:
    return name.startswith(("triad", "stream"))


def stream_summary(raw: dict, numel: int) -> dict:
    """Each C baseline's best GB/s, STREAM's count and with the write-allocate reads, per phase."""
    out = {"numel": numel, "array_nbytes": 8 * numel, "threads": torch.get_num_threads(),
           "bytes_per_element": STREAM_BYTES, "write_allocate_bytes_per_element": STREAM_WRITE_ALLOCATE_BYTES}
    for name, samples in raw.items():
        base = name.split(" (")[0]
        if base in STREAM_BYTES:
            out[name] = {"best_s": min(samples), "gbps": STREAM_BYTES[base] * numel / min(samples) / 1e9,
                         "gbps_write_allocate": STREAM_WRITE_ALLOCATE_BYTES[base] * numel / min(samples) / 1e9}
    return out


def row_bytes(name: str) -> float:
    """Bytes a row reads and writes per parameter it steps."""
    name = name.removesuffix(BEFORE)
    if name.startswith("ours"):
        return _BYTES_OF[name]
    return KERNEL_BYTES.get(name, ADAM_BYTES)


def baseline_gbps(name: str, raw: dict, counts: dict) -> float:
    """A baseline's bytes per second, STREAM's count: the C ones' best sample, torch's triad's median."""
    base = name.split(" (")[0]
    if base in STREAM_BYTES:
        return STREAM_BYTES[base] * counts["stream"] / min(raw[name])
    return TORCH_TRIAD_BYTES * counts["triad"] / statistics.median(raw[name])


def print_table(n: int, raw: dict, notes: dict, counts: dict, together: bool) -> None:
    basis = "stream triad" if "stream triad" in raw else "triad"

    counted = STREAM_BYTES.get(basis, TORCH_TRIAD_BYTES)
    bus = STREAM_WRITE_ALLOCATE_BYTES.get(basis, TORCH_TRIAD_WRITE_ALLOCATE_BYTES)

    def bound_of(phase: str) -> tuple[float, float]:
        """The basis triad's bus bytes per second (write-allocate included) and the bound it gives."""
        bw = baseline_gbps(basis + phase, raw, counts) * bus / counted
        return bw, bw / ADAM_BYTES

    bw, bound = bound_of("")
    print(f"\n{n / 1e6:.0f}M fp32 parameters, {torch.get_num_threads()} threads; {basis} "
          f"{bw * counted / bus / 1e9:.1f} GB/s (STREAM count), {bw / 1e9:.1f} GB/s with write-allocate; "
          f"bound {bound / 1e9:.2f} G params/s at {ADAM_BYTES} B/param"
          + ("" if together else "; ours measured in its own phase, against its own baselines"))
    print(f"{'baseline':56} {'s':>9} {'G elem/s':>11} {'GB/s':>11} {'GB/s w-a':>11} {'% triad w-a':>12}")
    for name, samples in raw.items():
        if not is_baseline(name):
            continue
        base = name.split(" (")[0]
        secs = min(samples) if base in STREAM_BYTES else statistics.median(samples)
        per = STREAM_BYTES.get(base, TORCH_TRIAD_BYTES)
        rate = baseline_gbps(name, raw, counts)
        rate_bus = rate * STREAM_WRITE_ALLOCATE_BYTES.get(base, TORCH_TRIAD_WRITE_ALLOCATE_BYTES) / per
        ref, _ = bound_of(" (ours' phase)" if name.endswith("(ours' phase)") else "")
        label = f"{name} (C, best)" if base in STREAM_BYTES else f"{name} (torch, median)"
        print(f"{label:56} {secs:9.4f} {rate / per / 1e9:11.2f} {rate / 1e9:11.1f} {rate_bus / 1e9:11.1f} "
              f"{100 * rate_bus / ref:12.0f}")
    print(f"{'variant':56} {'median s':>9} {'G params/s':>11} {'GB/s moved':>11} {'% triad w-a':>12} "
          f"{'x bound':>8} {'x fp32 ours':>12}")
    for name, samples in raw.items():
        if is_baseline(name):
            continue
        mine = name.startswith("ours")
        triad_bw, b = bound_of("" if together or not mine else " (ours' phase)")
        count = counts["ours"] if mine else n
        nbytes = row_bytes(name)
        med = statistics.median(samples)
        rate = count / med
        # Side by side in the same phase: the ratio of medians to the engine step's with fp32 states
        # and the same compute dtype.
        base = name.removesuffix(BEFORE)
        ref = raw.get(_REFERENCE_OF[base] + name[len(base):]) if mine else None
        ratio = f"{statistics.median(ref) / med:12.2f}" if mine and ref else ""
        print(f"{name:56} {med:9.4f} {rate / 1e9:11.2f} {rate * nbytes / 1e9:11.1f} "
              f"{100 * rate * nbytes / triad_bw:12.0f} {b / rate:8.2f} {ratio}")
    for name, why in notes.items():
        print(f"{name:30} {why}")


if __name__ == "__main__":
    main()
