"""The host Adam kernels' raw entry points refuse addresses that would crash the process.

``_qadam.step``, ``step_fp32``, ``split_bf16``, ``triad`` and ``copy`` take tensors' data_ptr() as plain ints ([Note: raw
addresses] in optim_csrc/qadam.c). Before the check, 0 or -1 there was a segfault, so each case
runs in a fresh interpreter: a regression fails the test instead of killing the suite.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.optim import moments

ROOT = Path(__file__).resolve().parents[2]
N = 1000

pytestmark = pytest.mark.skipif(not moments.fused_native(), reason="the C kernel infinity.optim._qadam is not built")

# Each entry point with one address argument replaced by ADDR; the rest are valid tensors.
_CALLS = {
    "split_bf16 master": "_qadam.split_bf16(N, ADDR, ptr(copy), ptr(rem), ptr(index), 16)",
    "split_bf16 index": "_qadam.split_bf16(N, ptr(p), ptr(copy), ptr(rem), ADDR, 16)",
    "step_fp32 p": "_qadam.step_fp32(0, N, ADDR, ptr(g), False, ptr(m), ptr(v), 0, 1, *HYPER, 0.0, True, 1)",
    "step_fp32 out": "_qadam.step_fp32(0, N, ptr(p), ptr(g), False, ptr(m), ptr(v), ADDR, 1, *HYPER, 0.0, True, 1)",
    "step v": "_qadam.step(1, N, 0, N, 256, ptr(p), ptr(g), ptr(m16), ADDR, 0, 0, 1, *HYPER, 1.0, True, 5, 1)",
    "step m_scales": "_qadam.step(2, N, 0, N, 256, ptr(p), ptr(g), ptr(m8), ptr(v8), ADDR, ptr(vs), 1, *HYPER, "
                     "1.0, True, 5, 1)",
    "step outs": "_qadam.step(1, N, 0, N, 256, ptr(p), ptr(g), ptr(m16), ptr(v16), 0, 0, 1, *HYPER, 1.0, True, 5, "
                 "1, False, [(0, 10, ADDR)])",
    "triad a": "_qadam.triad(N, ADDR, ptr(db), ptr(dc), 3.0, 1)",
    "triad c": "_qadam.triad(N, ptr(da), ptr(db), ADDR, 3.0, 1)",
    "copy b": "_qadam.copy(N, ptr(da), ADDR, 1)",
}

_SETUP = f"""
import torch
from infinity.optim import _qadam
N = {N}
HYPER = (1e-3, 0.9, 0.999, 1e-8, 0.01)
ptr = lambda t: t.data_ptr()
p, g, m, v = (torch.zeros(N) for _ in range(4))
m16, v16, copy, rem = (torch.zeros(N, dtype=torch.int16) for _ in range(4))
m8, v8 = torch.zeros(N, dtype=torch.uint8), torch.zeros(N, dtype=torch.uint8)
vs = torch.zeros(4)
da, db, dc = (torch.zeros(N, dtype=torch.float64) for _ in range(3))
index = torch.zeros(16, dtype=torch.int64)
"""


_BAD = {0: "is in the null page", -1: "runs past the user address space", 1 << 40: "is not mapped memory"}


def test_bad_addresses_are_refused_by_every_entry_point() -> None:
    lines, cases = [_SETUP], []
    for address in _BAD:
        for name, call in _CALLS.items():
            if (name, address) in (("step outs", 0), ("step outs", 1 << 40), ("step_fp32 out", 0)):
                continue    # a segment at 0 was always refused, and is not probed; out 0 is "no copy"
            cases.append((name, address))
            lines.append(f"try:\n    {call.replace('ADDR', str(address))}\n    print('accepted')\n"
                         f"except ValueError as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", "\n".join(lines)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"exit status {done.returncode} (a crash?): {done.stderr[-2000:]}"
    out = done.stdout.splitlines()
    assert len(out) == len(cases), out
    for (name, address), line in zip(cases, out):
        fn, arg = name.split()
        what = "an output segment's address" if arg == "outs" else arg
        assert line.startswith(f"qadam.{fn}: {what} = ") and _BAD[address] in line, (name, address, line)


def test_valid_calls_still_step() -> None:
    import torch

    from infinity.optim import _qadam

    master = torch.randn(N)
    copy, rem = torch.empty(N, dtype=torch.int16), torch.empty(N, dtype=torch.int16)
    index = torch.empty(16, dtype=torch.int64)
    assert _qadam.split_bf16(N, master.data_ptr(), copy.data_ptr(), rem.data_ptr(), index.data_ptr(), 16) >= 0
    assert _qadam.split_bf16(0, 0, 0, 0, 0, 0) == 0          # nothing to touch: no address is looked at
