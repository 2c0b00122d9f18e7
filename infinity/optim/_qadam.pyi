"""Host Adam kernels (optim_csrc/qadam.c): over compressed moments ([Note: the compressed step] in moments.py),
and the fused fp32 step ([Note: the fused fp32 step] in qadam.c)."""
from typing import Sequence

def step(mode: int, n: int, lo: int, hi: int, block: int, p: int, g: int, m: int, v: int, m_scales: int,
         v_scales: int, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
         grad_mul: float, decoupled: bool, seed: int, threads: int, g_bf16: bool = False,
         outs: Sequence[tuple[int, int, int]] | None = None, outs_fp32: bool = False) -> None:
    """Adam over elements [lo, hi) of one sub-group of ``n`` elements, in place.

    ``mode`` 1 is bf16 moments (``m``, ``v`` the addresses of their uint16 words), 2 is int8 (``m``, ``v``
    the codes and ``m_scales``, ``v_scales`` the fp32 scales of blocks of ``block`` elements); ``p`` and
    ``g`` are the addresses of the fp32 master weights and gradients (bf16 words with ``g_bf16``).
    ``outs``: ``(start, end, address)`` segments, sorted and disjoint in [lo, hi), that receive the new
    weights' copies, bf16 (or fp32 with ``outs_fp32``). Raises ``ValueError`` on a bad mode, range,
    block or segment. Releases the GIL; runs on up to ``threads`` threads.
    """


def step_fp32(lo: int, hi: int, p: int, g: int, g_bf16: bool, m: int, v: int, out: int, step: int, lr: float,
              beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float, decoupled: bool,
              threads: int) -> None:
    """torch's fused Adam(W) over elements [lo, hi) of fp32 states at addresses ``p``, ``m``, ``v``, the
    gradient at ``g`` (bf16 words with ``g_bf16``, else fp32) divided by ``grad_scale`` (0: none), the new
    weights' bf16 copy written at ``out`` (0: none). Releases the GIL; runs on up to ``threads`` threads.
    Raises ``ValueError`` on a bad range or step."""


def split_bf16(n: int, master: int, copy: int, remainder: int, index: int, cap: int) -> int:
    """The split master of ``n`` fp32 masters at ``master``: their bf16 rounding (nearest even, a NaN as
    0xFFFF) at ``copy``, their low 16 bits at ``remainder`` (int16), and the indices (ascending, at most
    ``cap``, int64 at ``index``) of the elements those two do not restore; returns how many there are.
    Releases the GIL."""


def copy(n: int, a: int, b: int, threads: int) -> None:
    """STREAM's copy ``a = b`` over ``n`` doubles at addresses ``a``, ``b`` ([Note: the STREAM baselines] in
    qadam.c), split over up to ``threads`` threads as a step is; for benchmarks/adam.py's bandwidth baseline.
    Releases the GIL. Raises ``ValueError`` when ``n`` < 0, an address cannot be touched or ``a`` overlaps
    ``b``."""


def triad(n: int, a: int, b: int, c: int, s: float, threads: int) -> None:
    """STREAM's triad ``a = b + s * c`` over ``n`` doubles at addresses ``a``, ``b``, ``c``, as :func:`copy`.
    Raises ``ValueError`` when ``n`` < 0, an address cannot be touched or ``a`` overlaps ``b`` or ``c``."""
