"""The fused fp32 host step (optim_csrc/qadam.c, [Note: the fused fp32 step]): torch's fused CPU
Adam/AdamW bit for bit, with the gradient read as bf16 and the bf16 compute copy written in the
same pass; and an engine that steps with it trains exactly as one that steps with torch's kernel."""
from __future__ import annotations

import pytest
import torch

from infinity.optim import moments
from infinity.optim.update import UpdatePass
from tests.support.gpt_runs import trained
from tests.support.kernels import HOW, copies_stored

pytestmark = pytest.mark.skipif(not moments.fused_native(), reason="the C kernel is not built")


def _states(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-5
    return p, g, m, v


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("clip", [None, 0.37])
@pytest.mark.parametrize("g_bf16", [False, True])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
def test_the_c_pass_is_torchs_fused_kernel_bit_for_bit(decoupled, weight_decay, clip, g_bf16, beta1):
    n = 16 * 6151        # a multiple of 16: torch's kernel runs only its vector code on it
    p, g, m, v = _states(n, seed=int(decoupled) + 2 * int(g_bf16))
    if g_bf16:
        g = g.bfloat16().float()
    ours = [t.clone() for t in (p, g, m, v)]
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for step in (1, 2, 9):
        kernel([p], [g], [m], [v], [], [torch.full((), float(step))], lr=1e-3, beta1=beta1, beta2=0.999,
               weight_decay=weight_decay, eps=1e-8, amsgrad=False, maximize=False,
               grad_scale=None if clip is None else torch.full((), 1.0 / clip), found_inf=None)
        if clip is not None:
            g.copy_(ours[1])        # torch writes the unscaled gradient back; the C pass does not
        grad = ours[1].bfloat16() if g_bf16 else ours[1]
        out = torch.zeros(n, dtype=torch.bfloat16)
        moments.fused_fp32_step(n, ours[0].data_ptr(), grad.data_ptr(), g_bf16, ours[2].data_ptr(), ours[3].data_ptr(),
                                out.data_ptr(), step, 1e-3, beta1, 0.999, 1e-8, weight_decay,
                                0.0 if clip is None else 1.0 / clip, decoupled, 2)
        assert torch.equal(ours[0], p) and torch.equal(ours[2], m) and torch.equal(ours[3], v), f"step {step}"
        assert torch.equal(out, p.bfloat16()), "the copy is round-to-nearest-even, as .to(torch.bfloat16)"


@pytest.mark.parametrize("isa", ["base", "avx2", "avx512"])
@pytest.mark.parametrize("g_bf16", [False, True])     # True: the fused bf16 loop (fp32_span_bf16 in kernels.h)
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("stored", HOW)
def test_every_compiled_variant_is_torchs_kernel_bit_for_bit(isa, g_bf16, copy_dtype, stored):
    """Each compiled copy of the pass (the portable C, AVX2, AVX-512: ``_qadam.isa``) gives torch's bits,
    so that a run resumed on another machine continues as it would have; the copy stored in the cache or
    past it, at an address that is not a cache line's, nothing written beside it."""
    try:
        moments._qadam.isa(isa)
    except ValueError:
        pytest.skip(f"{isa} is no instruction set here")
    try:
        n = 16 * 1000 + 16
        p, g, m, v = _states(n, seed=5)
        if g_bf16:
            g = g.bfloat16().float()
        ours = [t.clone() for t in (p, g, m, v)]
        grad = ours[1].bfloat16() if g_bf16 else ours[1]
        padded = torch.full((n + 4,), 7.0, dtype=copy_dtype)
        out = padded[3:3 + n]       # 6 or 12 bytes into a line, ending inside one
        for step in (1, 2):
            torch._fused_adamw_([p], [g], [m], [v], [], [torch.full((), float(step))], lr=1e-3, beta1=0.9,
                                beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
                                grad_scale=None, found_inf=None)
            with copies_stored(stored):
                moments.fused_fp32_step(n, ours[0].data_ptr(), grad.data_ptr(), g_bf16, ours[2].data_ptr(),
                                        ours[3].data_ptr(), out.data_ptr(), step, 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.0,
                                        True, 2, out_fp32=copy_dtype == torch.float32)
            assert torch.equal(ours[0], p) and torch.equal(ours[2], m) and torch.equal(ours[3], v), (isa, step)
            assert torch.equal(out, p.to(copy_dtype)), (isa, step)
            assert padded[:3].eq(7).all() and padded[-1] == 7, "only the copy's own elements are written"
    finally:
        moments._qadam.isa("auto")


@pytest.mark.parametrize("g_bf16", [False, True])     # True: the fused bf16 loop (fp32_span_bf16 in kernels.h)
def test_a_nan_weight_stays_nan_in_its_copy(g_bf16):
    n = 64
    p = torch.zeros(n)
    g = torch.zeros(n)
    g[:8] = float("nan")
    g[8:16] = float("inf")
    if g_bf16:
        g = g.bfloat16()
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.zeros(n, dtype=torch.bfloat16)
    moments.fused_fp32_step(n, p.data_ptr(), g.data_ptr(), g_bf16, m.data_ptr(), v.data_ptr(), out.data_ptr(), 1,
                            1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0, True, 1)
    assert p[:16].isnan().all() and out[:16].isnan().all()
    assert torch.equal(out[16:], p[16:].bfloat16())


def _train(tmp_path, monkeypatch, preset: str, fused: bool, sections: dict):
    """Losses and final weights of the tiny GPT over 3 steps, the C pass allowed or not; and its calls."""
    calls = [0]
    c_pass = moments.fused_fp32_step

    def counting(*args):
        calls[0] += 1
        c_pass(*args)

    monkeypatch.setattr(moments, "fused_fp32_step", counting)
    monkeypatch.setattr(moments, "fused_native", lambda: fused)
    out, params = trained(tmp_path / f"nvme-{fused}", preset, **sections)
    return out, params, calls[0]


@pytest.mark.parametrize("preset, sections", [
    ("offload-optimizer", {"dpu": {"overlap": False}}),     # compact bf16 gradients
    ("offload-host", {}),                                   # the preset as it is
    ("offload-host", {"partition": {"sub_group_size": 6144}}),  # groups cut across sub-groups
    ("nvme", {"dpu": {"overlap": False}}),                  # streamed sub-groups, compact gradients read
    ("nvme", {}),                                           # the update overlapped with the next forward
    ("offload-optimizer", {"dpu": {"enabled": True, "warmup_steps": 1}}),   # DPU: both gradient sets compact
    ("offload-host", {"precision": {"dtype": "float32"}}),  # fp32 copies written into the host shards
    ("offload-host", {"precision": {"dtype": "float32"}, "dpu": {"enabled": True, "warmup_steps": 1}}),
    ("offload-optimizer", {"precision": {"dtype": "float32"}, "dpu": {"overlap": False}}),  # copies on the device
    ("nvme", {"precision": {"dtype": "float32"}}),          # fp32 copies written to NVMe after the pass
])
def test_an_engine_stepping_with_the_c_pass_trains_exactly_as_with_torchs_kernel(tmp_path, monkeypatch, preset,
                                                                                 sections):
    """bf16 compute, states in host memory: the compute copies staged per group, the parts' tails
    stepped by torch, the other elements converted; the same losses and weights, bit for bit. fp32
    compute with host parameters: the copies written into the shards (DPU: the spare ones); elsewhere
    the C pass steps without copies, and they are written after it."""
    fused = _train(tmp_path, monkeypatch, preset, True, sections)
    plain = _train(tmp_path, monkeypatch, preset, False, sections)
    assert fused[2] > 0 and plain[2] == 0, "the first run steps with the C pass, the second without"
    assert fused[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(fused[1], plain[1]))


@pytest.mark.parametrize("preset, sections", [
    ("offload-optimizer", {"dpu": {"overlap": False}}),     # bf16 copies into the staging
    ("offload-host", {"precision": {"dtype": "float32"}}),  # fp32 copies into the host shards
    ("nvme", {}),                                           # bf16 copies staged for NVMe, overlapped
])
def test_copies_stored_past_the_caches_train_exactly_as_cached_ones(tmp_path, monkeypatch, preset, sections):
    """The stores a large call makes ([Note: copies past the caches] in optim_csrc/qadam.c), here on the
    tiny GPT's small calls: the same losses and weights as torch's kernel and a conversion."""
    with copies_stored("streamed"):
        streamed = _train(tmp_path, monkeypatch, preset, True, sections)
    plain = _train(tmp_path, monkeypatch, preset, False, sections)
    assert streamed[2] > 0 and plain[2] == 0
    assert streamed[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(streamed[1], plain[1]))


def test_calls_larger_than_twice_the_caches_store_their_copies_past_them():
    qadam = moments._qadam
    if not hasattr(qadam, "stream_copies"):
        pytest.skip("this build of the C kernel has no stores past the caches")
    assert qadam.stream_copies() == 2 * moments.last_level_cache_nbytes() > 0
    saved = qadam.stream_copies()

    def streams(call, n: int) -> bool:
        before = qadam.streamed_calls()
        call(n)
        return qadam.streamed_calls() - before == 1

    def fused(g_dtype, copy_dtype):
        def call(n):
            p, g, m, v = _states(n, seed=1)
            grad = g.to(g_dtype)
            out = None if copy_dtype is None else torch.empty(n, dtype=copy_dtype)
            moments.fused_fp32_step(n, p.data_ptr(), grad.data_ptr(), g_dtype == torch.bfloat16, m.data_ptr(),
                                    v.data_ptr(), 0 if out is None else out.data_ptr(), 1, 1e-3, 0.9, 0.999, 1e-8,
                                    0.0, 0.0, True, 1, out_fp32=copy_dtype == torch.float32)
        return call

    def compressed(fmt, copy_dtype):
        def call(n):
            p, g, _, _ = _states(n, seed=1)
            m, v = (torch.zeros(fmt.nbytes(n), dtype=torch.uint8) for _ in range(2))
            outs = [] if copy_dtype is None else [(0, n, torch.empty(n, dtype=copy_dtype))]
            hyper = moments.AdamHyper(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                      decoupled=True, grad_mul=1.0)
            moments.MomentStep(fmt, use_native=True)(p, g.bfloat16(), m, v, 0, n, hyper, 1, outs)
        return call

    # each entry point's bytes an element: the states, the gradient, the copy (none: nothing to stream)
    cases = [(fused(torch.bfloat16, torch.bfloat16), 12 + 2 + 2), (fused(torch.float32, torch.float32), 12 + 4 + 4),
             (compressed(moments.MomentFormat("bf16"), torch.bfloat16), 4 + 4 + 2 + 2),
             (compressed(moments.MomentFormat("int8", 256), torch.float32), 4 + 2 + 2 + 4),
             (fused(torch.float32, None), None), (compressed(moments.MomentFormat("bf16"), None), None)]
    try:
        for call, per_element in cases:
            qadam.stream_copies(4096 * 16)
            if per_element is None:
                assert not streams(call, 1 << 16), "a call without copies has nothing to stream"
                continue
            qadam.stream_copies(4096 * per_element)
            assert streams(call, 4096) and not streams(call, 4095), per_element
            qadam.stream_copies(-1)
            assert not streams(call, 1 << 16), "never, below 0"
    finally:
        qadam.stream_copies(saved)
