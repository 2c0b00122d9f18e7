"""The compressed-moment kernel (optim_csrc/qadam.c) reading bf16 gradients and writing the new
weights' bf16 compute copies in the pass that steps them: the same bits as an fp32 gradient, the
step and a conversion; and an engine with int8 or bf16 moments that steps this way trains exactly
as one that widens and converts in passes of their own."""
from __future__ import annotations

import pytest
import torch

from infinity.optim import moments
from infinity.optim.moments import AdamHyper, MomentFormat, MomentStep
from tests.support.gpt_runs import trained
from tests.support.kernels import HOW, copies_stored

pytestmark = pytest.mark.skipif(not moments.copies_native(), reason="the C kernel is not built")

FORMATS = [MomentFormat("int8", 256), MomentFormat("int8", 64), MomentFormat("bf16")]


def _hyper(step: int, decoupled: bool = True) -> AdamHyper:
    return AdamHyper(step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=decoupled,
                     grad_mul=0.5)


def _run(fmt: MomentFormat, native: bool, with_copies: bool, n: int, calls: list, segments: list,
         copy_dtype: torch.dtype = torch.bfloat16):
    """Master, moments and copies (``copy_dtype``) after three steps over ``calls`` (lists of [lo, hi));
    the gradient passed as bf16 with copies of ``segments`` written by the kernel, or widened to fp32 and
    the copies converted afterwards."""
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen)
    g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    m = torch.zeros(fmt.nbytes(n), dtype=torch.uint8)
    v = torch.zeros(fmt.nbytes(n), dtype=torch.uint8)
    # each copy an element into a buffer of its own, one element beside it at either end (not a cache
    # line's address: the kernel's stores past the caches write partial lines apart)
    padded = {seg: torch.full((seg[1] - seg[0] + 2,), 7.0, dtype=copy_dtype) for seg in segments}
    outs = {seg: buf[1:-1] for seg, buf in padded.items()}
    step = MomentStep(fmt, use_native=native)
    for k in range(1, 4):
        for lo, hi in calls:
            mine = [(a, b, outs[(a, b)]) for a, b in segments if lo <= a and b <= hi]
            if with_copies:
                step(p, g, m, v, lo, hi, _hyper(k, decoupled=k != 2), 11 * k, mine)
            else:
                step(p, g.float(), m, v, lo, hi, _hyper(k, decoupled=k != 2), 11 * k)
                for a, b, out in mine:
                    out.copy_(p[a:b])
    assert all(buf[0] == 7 and buf[-1] == 7 for buf in padded.values()), "a copy wrote beside its elements"
    return p, m, v, [outs[seg] for seg in segments]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.dtype}-{f.block_size}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("stored", HOW)
def test_the_kernel_reads_bf16_gradients_and_writes_the_copies_it_steps(fmt, threads, stored):
    # Calls that cut blocks, segments that cut blocks and calls, elements never stepped; the copies
    # stored in the cache or past it.
    n = 70_000
    calls = [(50, 33_333), (33_333, 69_990)]
    segments = [(60, 61), (100, 900), (900, 1_000), (3_000, 33_333), (33_333, 33_400), (40_001, 69_990)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        widened = _run(fmt, True, False, n, calls, segments)
        with copies_stored(stored):
            fused = _run(fmt, True, True, n, calls, segments)
        twin = _run(fmt, False, True, n, calls, segments)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(widened[:3], fused[:3]):
        assert torch.equal(a, b)
    for a, b in zip(widened[3], fused[3]):
        assert torch.equal(a, b)
    # The torch twin (no C extension) takes the same arguments: its copies are its own master's, which
    # follows the kernel's up to rounding (an int8 code apart here and there, see test_moments.py).
    for (a, b), copy in zip(segments, twin[3]):
        assert torch.equal(copy, twin[0][a:b].bfloat16())
    assert (twin[0] - widened[0]).abs().max() < 1e-3      # lr 1e-2, three steps


def test_bad_copy_segments_are_refused_naming_them():
    fmt = MomentFormat("int8", 256)
    n = 4096
    p, g = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    m = torch.zeros(fmt.nbytes(n), dtype=torch.uint8)
    v = torch.zeros(fmt.nbytes(n), dtype=torch.uint8)
    step = MomentStep(fmt, use_native=True)
    out = torch.zeros(100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"segment 1 \[50, 150\)"):
        step(p, g, m, v, 0, 1000, _hyper(1), 1, [(100, 200, out), (50, 150, out)])
    with pytest.raises(ValueError, match=r"segment 0 \[900, 1000\).*leaves \[0, 800\)"):
        step(p, g, m, v, 0, 800, _hyper(1), 1, [(900, 1000, out)])
    with pytest.raises(ValueError, match=r"copy of \[100, 200\) must be 100 contiguous bf16"):
        step(p, g, m, v, 0, 800, _hyper(1), 1, [(0, 100, out), (100, 200, torch.zeros(100))])
    with pytest.raises(TypeError, match="float16 gradient"):
        step(p, g.half(), m, v, 0, 800, _hyper(1), 1)
    assert not p.any() and not m.any(), "a refused call changes nothing"


class _Counting:
    """The C module, counting the compressed steps that write copies."""

    def __init__(self, module) -> None:
        self.module, self.with_copies = module, 0
        self.STEP_COPIES = module.STEP_COPIES
        self.step_fp32 = module.step_fp32

    def step(self, *args):
        self.with_copies += len(args) > 21 and bool(args[22])
        return self.module.step(*args)


def _train(tmp_path, monkeypatch, preset: str, fused: bool, sections: dict):
    counting = _Counting(moments._qadam)
    monkeypatch.setattr(moments, "_qadam", counting)
    monkeypatch.setattr(moments, "copies_native", lambda: fused)
    out, params = trained(tmp_path / f"nvme-{fused}", preset, **sections)
    return out, params, counting.with_copies


@pytest.mark.parametrize("preset, sections", [
    ("offload-optimizer", {"dpu": {"overlap": False}}),                     # compact bf16 gradients
    ("offload-host", {}),                                                   # copies written in place
    ("offload-host", {"precision": {"dtype": "float32"}}),                  # fp32 copies written in place
    ("offload-host", {"partition": {"sub_group_size": 6144}, "optimizer": {"state_block_size": 64}}),
    ("nvme", {"dpu": {"overlap": False}}),                                  # split masters, streamed
    ("nvme", {}),                                                           # overlapped with the forward
    ("offload-optimizer", {"dpu": {"enabled": True, "warmup_steps": 1}}),   # DPU: fp32 gradient keys
])
@pytest.mark.parametrize("state_dtype", ["int8", "bf16"])
def test_an_engine_with_compressed_moments_trains_exactly_as_with_separate_passes(tmp_path, monkeypatch, preset,
                                                                                  sections, state_dtype):
    sections = {**sections, "optimizer": {"state_dtype": state_dtype, **sections.get("optimizer", {})}}
    if state_dtype == "bf16":
        sections["optimizer"].pop("state_block_size", None)
    fused = _train(tmp_path, monkeypatch, preset, True, sections)
    plain = _train(tmp_path, monkeypatch, preset, False, sections)
    assert fused[2] > 0 and plain[2] == 0, "the first run writes copies in the kernel, the second does not"
    assert fused[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(fused[1], plain[1]))


@pytest.fixture
def isa():
    """Choose the C kernel's compiled variant (``_qadam.isa``); back to the CPU's best afterwards."""
    yield moments._qadam.isa
    moments._qadam.isa("auto")


def _variants() -> list[str]:
    supported = []
    for name in ("avx512", "avx2"):
        try:
            moments._qadam.isa(name)
            supported.append(name)
        except ValueError:
            pass
    moments._qadam.isa("auto")
    return supported


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.dtype}-{f.block_size}")
@pytest.mark.parametrize("with_copies", [False, True])
def test_every_compiled_variant_gives_the_same_bits(isa, fmt, with_copies):
    # The AVX2 int8 blocks are hand-written ([Note: the int8 block in AVX2]): whole blocks there,
    # cut blocks through the compiled loops; both must be the portable C's bits, so that a run resumed
    # on another machine continues as it would have.
    n = 70_000
    calls = [(0, 70_000), (50, 33_333), (33_333, 69_990)]
    segments = [(100, 900), (3_000, 33_333), (40_001, 69_990)]
    isa("base")
    reference = _run(fmt, True, with_copies, n, calls, segments)
    variants = _variants()
    for name in variants:
        isa(name)
        got = _run(fmt, True, with_copies, n, calls, segments)
        assert all(torch.equal(a, b) for a, b in zip(reference[:3], got[:3])), name
        assert all(torch.equal(a, b) for a, b in zip(reference[3], got[3])), name
    with pytest.raises(ValueError, match="sse9 is no instruction set here"):
        isa("sse9")


@pytest.mark.skipif(not moments.copies_fp32_native(), reason="this build of the C kernel writes no fp32 copies")
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.dtype}-{f.block_size}")
@pytest.mark.parametrize("stored", HOW)
def test_the_kernel_writes_fp32_copies_of_the_weights_it_steps(isa, fmt, stored):
    # fp32 compute with the parameters in host memory: the copies are the new masters themselves, bit for
    # bit, on every compiled variant, stored in the cache or past it, and the step is the one without copies.
    n = 70_000
    calls = [(50, 33_333), (33_333, 69_990)]
    segments = [(60, 61), (100, 900), (900, 1_000), (3_000, 33_333), (33_333, 33_400), (40_001, 69_990)]
    for name in ["base", *_variants()]:
        isa(name)
        plain = _run(fmt, True, False, n, calls, segments, torch.float32)
        with copies_stored(stored):
            fused = _run(fmt, True, True, n, calls, segments, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(plain[:3], fused[:3])), name
        for (a, b), copy in zip(segments, fused[3]):
            assert torch.equal(copy.view(torch.int32), fused[0][a:b].view(torch.int32)), name
