"""STREAM's triad and copy in the host Adam extension ([Note: the STREAM baselines] in optim_csrc/qadam.c),
benchmarks/adam.py's memory-bandwidth baseline: the values they write, on one thread and split over
several, and the arguments they refuse. Their speed is the benchmark's business, not a test's."""
from __future__ import annotations

import pytest
import torch

from infinity.optim import moments

pytestmark = pytest.mark.skipif(moments._qadam is None or not hasattr(moments._qadam, "triad"),
                                reason="the C kernel infinity.optim._qadam is not built (or is older)")

# Odd sizes: one element, a block's tail, and enough blocks (64 of 1024 a thread) for three threads.
SIZES = [1, 4097, 3 * 64 * 1024 + 5]


def _arrays(n: int):
    gen = torch.Generator().manual_seed(n)
    return (torch.full((n,), float("nan"), dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64),
            torch.randn(n, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", SIZES)
def test_triad_writes_b_plus_s_times_c(n: int, threads: int) -> None:
    a, b, c = _arrays(n)
    moments._qadam.triad(n, a.data_ptr(), b.data_ptr(), c.data_ptr(), 3.0, threads)
    assert torch.equal(a, b + 3.0 * c)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", SIZES)
def test_copy_writes_b(n: int, threads: int) -> None:
    a, b, _ = _arrays(n)
    moments._qadam.copy(n, a.data_ptr(), b.data_ptr(), threads)
    assert torch.equal(a, b)


def test_nothing_to_do_touches_nothing() -> None:
    moments._qadam.triad(0, 0, 0, 0, 3.0, 1)
    moments._qadam.copy(0, 0, 0, 1)


def test_a_negative_count_is_refused() -> None:
    a, b, c = _arrays(4)
    with pytest.raises(ValueError, match=r"qadam.triad: n=-1 must be >= 0"):
        moments._qadam.triad(-1, a.data_ptr(), b.data_ptr(), c.data_ptr(), 3.0, 1)
    with pytest.raises(ValueError, match=r"qadam.copy: n=-1 must be >= 0"):
        moments._qadam.copy(-1, a.data_ptr(), b.data_ptr(), 1)


def test_an_output_overlapping_an_input_is_refused() -> None:
    a, b, c = _arrays(100)
    with pytest.raises(ValueError, match=r"qadam.triad: a = 0x[0-9a-f]+ overlaps c \(50 doubles each\)"):
        moments._qadam.triad(50, a.data_ptr(), b.data_ptr(), a[10:].data_ptr(), 3.0, 1)
    with pytest.raises(ValueError, match=r"qadam.copy: a = 0x[0-9a-f]+ overlaps b"):
        moments._qadam.copy(50, a[49:].data_ptr(), a.data_ptr(), 1)
    assert a.isnan().all()                 # refused before any store
    moments._qadam.triad(50, a.data_ptr(), b.data_ptr(), b.data_ptr(), 3.0, 1)    # b and c may be the same
    assert torch.equal(a[:50], b[:50] + 3.0 * b[:50])


def test_a_span_past_its_array_is_refused() -> None:
    a, b, c = _arrays(4)
    with pytest.raises(ValueError, match=r"qadam.triad: a = .* runs past the user address space"):
        moments._qadam.triad(1 << 60, a.data_ptr(), b.data_ptr(), c.data_ptr(), 3.0, 1)


def test_arguments_of_the_wrong_type_are_refused() -> None:
    a, b, c = _arrays(4)
    with pytest.raises(TypeError):
        moments._qadam.triad(4, a.data_ptr(), b.data_ptr(), c.data_ptr(), "3", 1)
    with pytest.raises(TypeError):
        moments._qadam.copy(4, a.data_ptr(), b.data_ptr())
