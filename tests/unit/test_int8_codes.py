"""The int8 moments' codes as the kernel writes them (every compiled variant of optim_csrc/qadam.c) and
as its torch twin writes them: round to nearest, ties away from zero, on each format's grid, at every
point where the rounding changes its mind and at the float32 values either side of it; and the
same codes from all of them whatever the block's scales (subnormal, huge, infinite, NaN), which take
the AVX2 block's other path ([Note: the int8 block in AVX2]).

With beta1 = beta2 = 0 a step stores m = g and w = sqrt(g * g) = |g| exactly, so the gradient chooses the
values that get encoded; a block whose largest magnitude is 1.9375 codes them unscaled."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from infinity.optim import moments
from infinity.optim.moments import AdamHyper, MomentFormat, MomentStep

pytestmark = pytest.mark.skipif(not moments.native(), reason="the C kernel infinity.optim._qadam is not built")

B = 256
TOP = 1.9375


def _grid(bias: int, codes: int) -> list[Fraction]:
    """The value of each code of a format with 4 mantissa bits and exponent bias ``bias`` (subnormals)."""
    out = []
    for c in range(codes):
        e, f = c >> 4, c & 15
        out.append(Fraction(f, 16) * Fraction(2) ** (1 - bias) if e == 0 else
                   (1 + Fraction(f, 16)) * Fraction(2) ** (e - bias))
    return out


M_GRID, W_GRID = _grid(7, 128), _grid(15, 256)


def _expected(u: float, grid: list[Fraction], positive_not_zero: bool) -> int:
    """Round half up of ``u`` on ``grid``: the number of midpoints at or below it."""
    x = Fraction(u)
    c = sum(1 for a, b in zip(grid, grid[1:]) if (a + b) / 2 <= x)
    return max(c, 1) if positive_not_zero and x > 0 else c


def _around_midpoints(grid: list[Fraction]) -> list[float]:
    out = []
    for a, b in zip(grid, grid[1:]):
        mid = np.float32(float((a + b) / 2))
        assert Fraction(float(mid)) == (a + b) / 2, "midpoints are float32 values"
        out += [float(np.nextafter(mid, np.float32(0))), float(mid), float(np.nextafter(mid, np.float32(4)))]
    return out


def _blocks(values: list[float], scale: float, seed: int) -> torch.Tensor:
    """Blocks of B: element 0 of each is ``scale`` * 1.9375 (its largest magnitude), the others
    ``scale`` * the values in random order with random signs, zeros after them."""
    gen = torch.Generator().manual_seed(seed)
    per = B - 1
    nblocks = -(-len(values) // per)
    body = torch.zeros(nblocks * per, dtype=torch.float64)
    body[:len(values)] = torch.tensor(values, dtype=torch.float64)
    body = body[torch.randperm(body.numel(), generator=gen)]
    body *= torch.where(torch.rand(body.numel(), generator=gen) < 0.5, -1.0, 1.0).double()
    g = torch.cat([torch.full((nblocks, 1), TOP, dtype=torch.float64), body.view(nblocks, per)], 1).flatten()
    return (g * scale).float()


def _step(g: torch.Tensor, native: bool):
    fmt = MomentFormat("int8", B)
    n = g.numel()
    p = torch.linspace(-1, 1, n)
    m, v = torch.zeros(fmt.nbytes(n), dtype=torch.uint8), torch.zeros(fmt.nbytes(n), dtype=torch.uint8)
    hyper = AdamHyper(step=1, lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, decoupled=True)
    MomentStep(fmt, use_native=native)(p, g, m, v, 0, n, hyper, 5)
    return p, m, v


@pytest.fixture
def variants():
    """Every compiled variant this CPU runs, then back to its best."""
    names = []
    for name in ("base", "avx2", "avx512"):
        try:
            moments._qadam.isa(name)
            names.append(name)
        except ValueError:
            pass
    yield names
    moments._qadam.isa("auto")


def test_codes_round_half_away_from_zero_at_every_midpoint(variants):
    values = _around_midpoints(M_GRID) + _around_midpoints(W_GRID) + [2.0 ** -60, 2.0 ** -30, 2.0 ** -19]
    g = _blocks(values, 1.0, 0)
    n = g.numel()
    u = g.abs().double().tolist()
    want_m = torch.tensor([_expected(x, M_GRID, False) | (0x80 if s < 0 and _expected(x, M_GRID, False) else 0)
                           for x, s in zip(u, g.tolist())], dtype=torch.uint8)
    want_w = torch.tensor([_expected(x, W_GRID, True) for x in u], dtype=torch.uint8)
    assert len({c & 0x7F for c in want_m.tolist()}) == 128 and len(set(want_w.tolist())) == 256, "every code"
    for name in variants:
        moments._qadam.isa(name)
        _, m, v = _step(g, True)
        assert torch.equal(m[:n], want_m), name
        assert torch.equal(v[:n], want_w), name
    _, m, v = _step(g, False)
    assert torch.equal(m[:n], want_m) and torch.equal(v[:n], want_w), "the torch twin"


@pytest.mark.parametrize("scale", [2.0 ** 119, 2.0 ** -130, 2.0 ** -140, 2.0 ** 70, float("inf"), float("nan")],
                         ids=["huge", "subnormal", "tiny-subnormal", "w-overflows", "inf", "nan"])
def test_every_variant_and_the_twin_code_extreme_scales_alike(variants, scale):
    values = _around_midpoints(M_GRID)[::7] + [0.0, 2.0 ** -60]
    g = torch.cat([_blocks(values, 1.0, 1), _blocks(values, scale if scale == scale else 1.0, 2)])
    if scale != scale:      # a NaN of each sign in the second half
        g[B + 3], g[B + 5] = float("nan"), -float("nan")
    if scale == float("inf"):
        g[B + 7] = -float("inf")
    n = g.numel()
    results = {}
    for name in variants:
        moments._qadam.isa(name)
        results[name] = _step(g, True)
    results["twin"] = _step(g, False)
    ref_p, ref_m, ref_v = results.pop("base")
    for name, (p, m, v) in results.items():
        assert torch.equal(m[:n], ref_m[:n]) and torch.equal(v[:n], ref_v[:n]), name
        for raw, ref in ((m, ref_m), (v, ref_v)):
            scales, want = raw[n:].view(torch.float32), ref[n:].view(torch.float32)
            assert torch.equal(scales.isnan(), want.isnan()), name
            assert torch.equal(scales[~want.isnan()], want[~want.isnan()]), name
        assert torch.equal(p.isnan(), ref_p.isnan()), name
        if name != "twin":      # the twin divides with torch's division, not the kernel's
            assert torch.equal(p[~ref_p.isnan()], ref_p[~ref_p.isnan()]), name
