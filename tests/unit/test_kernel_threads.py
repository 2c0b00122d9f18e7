"""The host Adam kernels' worker threads (optim_csrc/qadam.c, [Note: the kernels' worker threads]): a
step splits its range over the calling thread's OpenMP team (torch's runtime) or, without one, over
threads it starts itself, so the bits must not depend on which, on how many threads step it, on two
Python threads stepping at once, or on a fork after the workers started."""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import pytest
import torch

from infinity.optim import moments
from infinity.optim.moments import AdamHyper, MomentFormat, MomentStep

pytestmark = pytest.mark.skipif(not moments.fused_native() or not hasattr(moments._qadam, "workers"),
                                reason="the C kernel is not built")
KINDS = ["openmp", "threads"]

# 64 blocks of 1024 elements a thread at least: this many elements can take 7 threads, unevenly.
N = 7 * 64 * 1024 + 4099


def _states(seed: int, n: int = N):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2,
            torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-5)


def _fp32_steps(states, threads: int, steps: int = 3):
    """``steps`` fused fp32 steps of ``states`` (in place) on ``threads`` threads, the bf16 copy returned."""
    p, g, m, v = states
    out = torch.empty(p.numel(), dtype=torch.bfloat16)
    for step in range(1, steps + 1):
        moments.fused_fp32_step(p.numel(), p.data_ptr(), g.data_ptr(), False, m.data_ptr(), v.data_ptr(),
                                out.data_ptr(), step, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.0, True, threads)
    return out


def _bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes read without torch (a forked child must not enter torch's OpenMP pool)."""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


@pytest.fixture(params=KINDS)
def workers(request):
    """Each kind of workers in turn (openmp skipped where no OpenMP runtime is in the process), then the
    default again."""
    q = moments._qadam
    before = q.workers()
    try:
        q.workers(request.param)
    except ValueError:
        pytest.skip("no OpenMP runtime in this process")
    yield request.param
    q.workers(before)


def test_the_kernel_steps_on_torchs_openmp_team_when_torch_has_one():
    if torch.__config__.parallel_info().find("ATen parallel backend: OpenMP") < 0:
        pytest.skip("torch's parallel backend is not OpenMP")
    assert moments._qadam.workers() == "openmp"


@pytest.mark.parametrize("threads", [2, 3, 7, 16])
def test_the_fp32_step_gives_the_same_bits_on_any_number_of_threads(workers, threads):
    one, many = _states(1), _states(1)
    out_one, out_many = _fp32_steps(one, 1), _fp32_steps(many, threads)
    for a, b in zip(one + (out_one,), many + (out_many,)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not moments.native(), reason="the compressed kernel is not built")
@pytest.mark.parametrize("threads", [3, 7])
def test_the_int8_step_gives_the_same_bits_on_any_number_of_threads(workers, threads):
    fmt = MomentFormat("int8", 256)
    results = []
    before = torch.get_num_threads()
    for count in (1, threads):
        p, g, m, v = _states(2)
        m_raw = torch.zeros(fmt.nbytes(N), dtype=torch.uint8)
        v_raw = torch.zeros(fmt.nbytes(N), dtype=torch.uint8)
        copy = torch.empty(N - 10, dtype=torch.bfloat16)
        torch.set_num_threads(count)     # the kernel steps on torch's thread count
        try:
            for step in (1, 2):
                MomentStep(fmt)(p, g, m_raw, v_raw, 0, N, AdamHyper(step=step, lr=1e-3, beta1=0.9, beta2=0.999,
                                eps=1e-8, weight_decay=0.01, grad_mul=1.0, decoupled=True), seed=5,
                                copies=[(10, N, copy)])
        finally:
            torch.set_num_threads(before)
        results.append((p, m_raw, v_raw, copy))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_two_python_threads_stepping_at_once_get_what_each_gets_alone(workers):
    alone = [_fp32_steps(_states(s), 2, steps=4) for s in (3, 4)]
    states = [_states(3), _states(4)]
    got, errors = [None, None], []

    def work(i):
        try:
            got[i] = _fp32_steps(states[i], 2, steps=4)
        except BaseException as exc:     # reported below: a thread's exception does not fail the test
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors and not any(w.is_alive() for w in workers)
    assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_steps_on_its_own_workers(workers):
    _fp32_steps(_states(5), 3)                   # the parent's workers are running now
    expected = _bytes(_fp32_steps(_states(6), 1))
    child_states = _states(6)
    out = torch.empty(N, dtype=torch.bfloat16)
    p, g, m, v = child_states
    pid = os.fork()
    if pid == 0:                                 # the child: C calls and raw bytes only, then _exit
        code = 1
        try:
            if moments._qadam.workers() != "threads":      # no OpenMP in a child: its runtime is not fork-safe
                os._exit(3)
            for step in (1, 2, 3):
                moments.fused_fp32_step(N, p.data_ptr(), g.data_ptr(), False, m.data_ptr(), v.data_ptr(),
                                        out.data_ptr(), step, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.0, True, 3)
            code = 0 if _bytes(out) == expected else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung stepping on 3 threads (waiting for the parent's workers?)")
    assert os.waitstatus_to_exitcode(done[1]) == 0, "the forked child's step differs (2), failed (1) or used OpenMP (3)"
