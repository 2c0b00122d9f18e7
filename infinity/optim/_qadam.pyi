"""Adam over compressed moments (optim_csrc/qadam.c); see [Note: the compressed step] in moments.py."""

def step(mode: int, n: int, lo: int, hi: int, block: int, p: int, g: int, m: int, v: int, m_scales: int,
         v_scales: int, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
         grad_mul: float, decoupled: bool, seed: int, threads: int) -> None:
    """Adam over elements [lo, hi) of one sub-group of ``n`` elements, in place.

    ``mode`` 1 is bf16 moments (``m``, ``v`` the addresses of their uint16 words), 2 is int8 (``m``, ``v``
    the codes and ``m_scales``, ``v_scales`` the fp32 scales of blocks of ``block`` elements); ``p`` and
    ``g`` are the addresses of the fp32 master weights and gradients. Raises ``ValueError`` on a bad
    mode, range or block. Releases the GIL; runs on up to ``threads`` threads.
    """
