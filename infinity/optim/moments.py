"""Adam's moments stored compressed (``[optimizer] state_dtype``): the formats and the step over them.

[Note: compressed moments]
With ``state_dtype = "fp32"`` (the default) ``exp_avg`` (m) and ``exp_avg_sq`` (v) are fp32, 4 bytes
each per parameter, and the step is torch's fused kernel. The other two formats store fewer bytes
in the optimizer tier (host memory or NVMe); master weights and gradients stay fp32.

``"bf16"``: m and v as bfloat16 (2 bytes each). Rounded *stochastically*: each value goes up or down
to a neighbouring bfloat16 with probabilities that make the rounding exact on average. Round to
nearest would lose the step's change whenever it is under half a bfloat16 step (2^-9 of the
value): with beta2 = 0.999 each step changes v by 0.1% times (g^2 / v - 1), so v would stop moving
once it came near its average. A compensation term (Kahan's, a second 16-bit word holding what
the rounding dropped) also recovers it but costs the 2 bytes saved. The random bits come from a
hash of (step, sub-group, element), so a run is reproducible and the C kernel and its torch twin
agree bit for bit.

``"int8"``: one byte per element and, per block of ``state_block_size`` elements, one fp32 scale
per state (block-wise quantization with absmax scaling, as in Dettmers et al., 2021, "8-bit
optimizers via block-wise quantization", who used blocks of 2048). Each byte is a small float
relative to its block's largest magnitude, so small values keep their relative precision instead
of rounding to zero (a dynamic, non-linear code):

- m: a sign bit and a 7-bit magnitude with 3 exponent and 4 mantissa bits (exponent bias 7,
  subnormals) of ``|m| * 1.9375 / absmax``: 4 significant bits over 7 binades below the block's
  largest value, then steps of 2^-10 of it (a linear int8 code has steps of 1/127).
- v: stored as ``w = sqrt(v)``, the quantity the update divides by, which halves v's range of
  exponents: an 8-bit code with 4 exponent and 4 mantissa bits (bias 15, subnormals) of
  ``w * 1.9375 / max(w)``: 4 significant bits over 15 binades of w (30 of v). A positive w never
  rounds to zero (it becomes the smallest code): a zero denominator would turn a small m into an
  update of m / eps, rounding up only makes the step smaller.

Rounding is to nearest, ties away from zero, exactly (tests/unit/test_int8_codes.py checks every
midpoint); m's sign is the value's sign bit, kept on nonzero codes; a NaN codes the top. Stochastic
rounding with 4-bit steps would add noise that the 0.999 average accumulates (its standard deviation grows by 1 / sqrt(1 - beta2^2), about 22x).
The step uses the fresh fp32 m and v for the update and stores their rounding, so the rounding
error never reaches the parameters directly. A block's bytes and scales are ``n`` codes followed by
``n / block`` fp32 scales in the sub-group's key (``MomentFormat.regions``).

[Note: the compressed step]
``MomentStep`` runs Adam over elements [lo, hi) of one sub-group in one pass per block: decode the
block's m and v into two small fp32 arrays (in L1), step every element with the master weight and
gradient, find the new absmax, encode. The C kernel (optim_csrc/qadam.c, ``infinity.optim._qadam``)
does this on ``torch.get_num_threads()`` threads; ``step_torch`` is its twin in torch ops, used when
the extension is not built, and tested against it. A block only partly inside [lo, hi) is decoded
and re-encoded whole, its other elements unchanged up to the new scale.

With bf16 compute the kernel also reads the gradient as it is stored (bf16, widened in registers) and
writes the stepped elements' bf16 compute copies while the block is in cache (``copies``); the update
pass ([Note: the update pass] in infinity/optim/update.py) would otherwise widen the gradient into an
fp32 buffer first and convert the masters into the copies after, two more passes over memory. With
fp32 compute and the parameters in host memory it writes the fp32 copies the same way, into the
shards themselves (a copy of the masters after the step read and wrote 8 more bytes a parameter, and
the line's write-allocate read). On AVX2 the int8 blocks are hand-written
([Note: the int8 block in AVX2] in optim_csrc/qadam.c), with the portable loops' bits.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch

try:
    from infinity.optim import _qadam
except ImportError:  # not built (a source checkout without `setup.py build_ext`): the torch twin steps
    _qadam = None

STATE_DTYPES = ("fp32", "bf16", "int8")
MOMENTS = ("exp_avg", "exp_avg_sq")
CODE_TOP = 1.9375
"""The largest code value (binary 1.1111 in the top binade): a block's absmax maps onto it."""
_M_BITS, _M_BIAS, _M_TOP = 4, 7, 0x7F      # m's magnitude: 3 exponent bits, 4 mantissa bits
_W_BITS, _W_BIAS, _W_TOP = 4, 15, 0xFF     # sqrt(v): 4 exponent bits, 4 mantissa bits
_BF16_WORK_BLOCK = 2048                    # bf16 has no blocks; the kernel shares work in these
_MODES = {"bf16": 1, "int8": 2}
_MASK32 = 0xFFFFFFFF


def last_level_cache_nbytes() -> int:
    """The bytes of the last-level caches of the CPUs this process may run on, every instance together
    (sysfs; 32 MiB where it says nothing)."""
    root, seen = "/sys/devices/system/cpu", {}
    try:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [
            int(d[3:]) for d in os.listdir(root) if d.startswith("cpu") and d[3:].isdigit()]
        for cpu in (f"cpu{i}" for i in cpus):
            base = f"{root}/{cpu}/cache"
            for index in os.listdir(base) if os.path.isdir(base) else ():
                def read(name: str) -> str:
                    with open(f"{base}/{index}/{name}") as f:
                        return f.read().strip()
                if read("type") == "Instruction":
                    continue
                size = read("size")
                nbytes = int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]] if size[-1] in "KM" else int(size)
                seen[(int(read("level")), read("shared_cpu_list"))] = nbytes
    except (OSError, ValueError, KeyError, IndexError):
        seen = {}
    if not seen:
        return 32 << 20
    top = max(level for level, _ in seen)
    return sum(nbytes for (level, _), nbytes in seen.items() if level == top)


if _qadam is not None and hasattr(_qadam, "stream_copies"):
    # A call whose arrays are twice the caches stores its copies past them ([Note: copies past the
    # caches] in optim_csrc/qadam.c).
    _qadam.stream_copies(2 * last_level_cache_nbytes())


def native() -> bool:
    """Whether the C kernel is built (else the torch twin steps, more slowly)."""
    return _qadam is not None


def fused_native() -> bool:
    """Whether the C kernel has the fused fp32 step (a build older than it has not)."""
    return _qadam is not None and hasattr(_qadam, "step_fp32")


def copies_native() -> bool:
    """Whether the C kernel's compressed step reads bf16 gradients and writes bf16 copies (a build
    older than that has not)."""
    return _qadam is not None and getattr(_qadam, "STEP_COPIES", 0) >= 1


def copies_fp32_native() -> bool:
    """Whether the C kernel's compressed step writes fp32 copies too (a build older than that does not)."""
    return _qadam is not None and getattr(_qadam, "STEP_COPIES", 0) >= 2


def fused_fp32_copies_native() -> bool:
    """Whether the fused fp32 step can write its copy in fp32 (a build older than that cannot)."""
    return _qadam is not None and getattr(_qadam, "STEP_FP32_COPIES", 0) >= 1


def fused_fp32_step(n: int, p: int, g: int, g_bf16: bool, m: int, v: int, out: int, step: int, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, grad_scale: float,
                    decoupled: bool, threads: int, out_fp32: bool = False) -> None:
    """Adam(W) over ``n`` fp32 states at addresses ``p``, ``m``, ``v`` with torch's fused CPU arithmetic,
    the gradient at ``g`` (bf16 with ``g_bf16``, else fp32) divided by ``grad_scale`` (0: none), the new
    weights' copy written at ``out`` (0: none; bf16, or fp32 with ``out_fp32``). See [Note: the fused
    fp32 step] in optim_csrc/qadam.c."""
    _qadam.step_fp32(0, n, p, g, g_bf16, m, v, out, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
                     decoupled, threads, *((True,) if out_fp32 else ()))     # (a build before out_fp32 takes 17)


@dataclass(frozen=True)
class MomentFormat:
    """How m and v are stored: ``dtype`` one of ``STATE_DTYPES``; ``block_size`` elements per int8 scale.

    Examples
    --------
    >>> MomentFormat("int8", 256).nbytes(4096), MomentFormat("bf16").nbytes(4096)
    (4160, 8192)
    """

    dtype: str = "fp32"
    block_size: int = 256

    def __post_init__(self) -> None:
        if self.dtype not in STATE_DTYPES:
            raise ValueError(f"moment format: state_dtype {self.dtype!r} is not one of {', '.join(STATE_DTYPES)}")
        b = self.block_size
        if b < 32 or b > 2048 or b & (b - 1):
            raise ValueError(f"moment format: block_size {b} is not a power of two from 32 to 2048")

    @property
    def compressed(self) -> bool:
        return self.dtype != "fp32"

    def bytes_per_element(self) -> float:
        """Stored bytes per element of one moment (int8: the byte and its share of the block's scale)."""
        return {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / self.block_size}[self.dtype]

    def nbytes(self, numel: int) -> int:
        """Bytes of one moment of a sub-group of ``numel`` elements."""
        if self.dtype == "int8":
            return numel + 4 * -(-numel // self.block_size)
        return numel * (4 if self.dtype == "fp32" else 2)

    def stored_nbytes(self, state: str, numel: int) -> int:
        """Bytes of one optimizer state of a sub-group: a moment in this format, anything else fp32."""
        return self.nbytes(numel) if state in MOMENTS else 4 * numel

    def stored_dtype(self, state: str) -> torch.dtype:
        """How the store views a state's key and buffers: fp32, or raw bytes for compressed moments."""
        return torch.uint8 if state in MOMENTS and self.compressed else torch.float32

    def covering(self, a: int, b: int, numel: int) -> tuple[int, int]:
        """The smallest range of whole blocks around elements [a, b) of a sub-group of ``numel``."""
        if self.dtype != "int8":
            return a, b
        B = self.block_size
        return a // B * B, min(-(-b // B) * B, numel)

    def regions(self, numel: int, a: int, b: int) -> list[tuple[int, int]]:
        """``(byte offset, nbytes)`` in a sub-group's key of the bytes holding elements [a, b) (whole blocks)."""
        if self.dtype == "int8":
            B = self.block_size
            if a % B or (b % B and b != numel):
                raise ValueError(f"int8 moments: elements [{a}, {b}) do not start and end on blocks of {B}")
            return [(a, b - a), (numel + 4 * (a // B), 4 * (-(-b // B) - a // B))]
        size = 4 if self.dtype == "fp32" else 2
        return [(a * size, (b - a) * size)]

    def split(self, raw: torch.Tensor, numel: int) -> list[torch.Tensor]:
        """The regions of a whole sub-group's raw bytes (uint8), as views."""
        return [raw[o:o + n] for o, n in self.regions(numel, 0, numel)]

    # -- encode / decode (loads, state dicts, checkpoints; the step has its own pass) ---------------
    def decode(self, parts: list[torch.Tensor], state: str) -> torch.Tensor:
        """fp32 values of the elements whose bytes are ``parts`` (as ``regions`` lists them)."""
        if self.dtype == "fp32":
            return parts[0].view(torch.float32).clone()
        if self.dtype == "bf16":
            return parts[0].view(torch.bfloat16).float()
        codes, scales = parts[0], parts[1].view(torch.float32)
        return _decode_int8(codes, scales, self.block_size, state == "exp_avg_sq")

    def encode(self, values: torch.Tensor, parts: list[torch.Tensor], state: str) -> None:
        """Store fp32 ``values`` into ``parts`` (round to nearest: a value loaded, not a step's average)."""
        if self.dtype == "fp32":
            parts[0].view(torch.float32).copy_(values)
        elif self.dtype == "bf16":
            parts[0].view(torch.bfloat16).copy_(values)
        else:
            codes, scales = _encode_int8(values, self.block_size, state == "exp_avg_sq")
            parts[0].copy_(codes)
            parts[1].view(torch.float32).copy_(scales)


# -- a store's compressed moments, read and written by whole blocks (pieces of shards start and end on
# multiples of 2048 elements, which whole blocks tile) ----------------------------------------------------
def read_moments(store, state: str, sub: int, a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of one compressed moment of sub-group ``sub`` of ``store``
    (``infinity.optim.flat_state.OptimizerStateStore``), decoded to fp32."""
    fmt, numel = store.moment_format, store.layout.sub_ranges[sub][1]
    a0, b0 = fmt.covering(a, b, numel)
    parts = []
    for offset, nbytes in fmt.regions(numel, a0, b0):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        store.io.read(store.sub_tiers[sub], store.keys[state][sub], buf, offset=offset).wait()
        parts.append(buf)
    return fmt.decode(parts, state)[a - a0:b - a0]


def write_moments(store, state: str, sub: int, a: int, values: torch.Tensor) -> None:
    """Encode fp32 ``values`` into elements [a, a + len) of one compressed moment of sub-group ``sub``
    (whole blocks, or a range ending at the sub-group's end)."""
    fmt, numel = store.moment_format, store.layout.sub_ranges[sub][1]
    regions = fmt.regions(numel, a, a + values.numel())
    parts = [torch.empty(nbytes, dtype=torch.uint8) for _, nbytes in regions]
    fmt.encode(values.float(), parts, state)
    for (offset, _), part in zip(regions, parts):
        store.io.write(store.sub_tiers[sub], store.keys[state][sub], part, offset=offset).wait()


def _encode_mag(u: torch.Tensor, bits: int, bias: int, top: int) -> torch.Tensor:
    """The float-like code of ``u`` in [0, CODE_TOP] (see [Note: compressed moments]); int32."""
    threshold = 2.0 ** (1 - bias)
    x = u * 2.0 ** (bias - 1 + bits)     # exact: a power of two
    whole = torch.floor(x)
    sub = (whole + (x - whole >= 0.5)).to(torch.int32)     # half up, exactly (x + 0.5 could round up)
    normal = ((u.view(torch.int32) + (1 << (22 - bits))) >> (23 - bits)) - ((127 - bias) << bits)
    return torch.where(u < threshold, sub, normal).clamp_(max=top)


def _decode_mag(c: torch.Tensor, bits: int, bias: int) -> torch.Tensor:
    normal = ((c + ((127 - bias) << bits)) << (23 - bits)).view(torch.float32)
    return torch.where(c < (1 << bits), c.float() * 2.0 ** (1 - bias - bits), normal)


def _decode_int8(codes: torch.Tensor, scales: torch.Tensor, block: int, is_v: bool) -> torch.Tensor:
    c = codes.to(torch.int32)
    per = (scales * (torch.ones((), dtype=torch.float32) / CODE_TOP)).repeat_interleave(block)[:c.numel()]
    if is_v:
        w = _decode_mag(c, _W_BITS, _W_BIAS) * per
        return w * w
    mag = _decode_mag(c & 0x7F, _M_BITS, _M_BIAS) * per
    return torch.where(c >= 0x80, -mag, mag)


def _block_max(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.numel()
    pad = -n % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, block).amax(dim=1)


def _encode_int8_parts(fm: torch.Tensor | None, fw: torch.Tensor | None, block: int):
    """Codes and scales of m (signed) and of w = sqrt(v) (unsigned), from fp32 values."""
    out = []
    if fm is not None:
        am = _block_max(fm.abs(), block)
        q = torch.where(am > 0, CODE_TOP / am, torch.zeros_like(am)).repeat_interleave(block)[:fm.numel()]
        c = _encode_mag((fm * q).abs(), _M_BITS, _M_BIAS, _M_TOP)     # |.| after: 0 * inf is a NaN, sign set
        c = c | torch.where(torch.signbit(fm) & (c != 0), 0x80, 0)     # one zero code: -0 would not re-encode alike
        out.append((c.to(torch.uint8), am))
    if fw is not None:
        aw = _block_max(fw, block)
        q = torch.where(aw > 0, CODE_TOP / aw, torch.zeros_like(aw)).repeat_interleave(block)[:fw.numel()]
        c = _encode_mag((fw * q).abs(), _W_BITS, _W_BIAS, _W_TOP)     # a NaN of either sign codes top
        c = torch.where((c == 0) & (fw > 0), 1, c)
        out.append((c.to(torch.uint8), aw))
    return out


def _encode_int8(values: torch.Tensor, block: int, is_v: bool):
    values = values.float()
    if is_v:
        return _encode_int8_parts(None, values.clamp(min=0).sqrt(), block)[0]
    return _encode_int8_parts(values, None, block)[0]


# -- bf16 stochastic rounding: the kernel's hash in int64 arithmetic ------------------------------
def _mix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _bf16_sr(x: torch.Tensor, seed: int, index: torch.Tensor) -> torch.Tensor:
    r = _mix(((index * 0x9E3779B1) & _MASK32) ^ seed) & 0xFFFF
    bits = x.view(torch.int32).to(torch.int64) & _MASK32
    return (((bits + r) & _MASK32) >> 16).to(torch.int32).to(torch.int16)


def _bf16_value(raw16: torch.Tensor) -> torch.Tensor:
    return ((raw16.to(torch.int32) & 0xFFFF) << 16).view(torch.float32)


def step_seed(step: int, sub: int) -> int:
    """The seed of stochastic rounding for one step of one sub-group (same in the C kernel and its twin)."""
    return (step * 0x9E3779B1 + sub * 0x7FEB352D + 0x165667B1) & _MASK32


@dataclass(frozen=True)
class AdamHyper:
    """One kernel call's hyper-parameters and step number (Adam's bias correction counts from 1)."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    grad_mul: float = 1.0


class MomentStep:
    """Adam over compressed moments (see [Note: the compressed step]).

    Parameters
    ----------
    fmt:
        The moments' format (``"bf16"`` or ``"int8"``).
    use_native:
        None: the C kernel when built, else the torch twin; True / False force one (tests).
    """

    def __init__(self, fmt: MomentFormat, use_native: bool | None = None) -> None:
        if not fmt.compressed:
            raise ValueError("MomentStep: fp32 moments are stepped by torch's fused kernel")
        if use_native and _qadam is None:
            raise RuntimeError("MomentStep: the C kernel infinity.optim._qadam is not built (run "
                               "`python setup.py build_ext --inplace` or `pip install -e .`)")
        self.fmt = fmt
        self.native = native() if use_native is None else use_native
        # Whether calls may pass bf16 gradients and copies to write (the torch twin converts them), and
        # fp32 copies.
        self.copies = copies_native() or not self.native
        self.copies_fp32 = copies_fp32_native() or not self.native

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, m_raw: torch.Tensor, v_raw: torch.Tensor,
                 lo: int, hi: int, hyper: AdamHyper, seed: int, copies: Sequence[tuple] = ()) -> None:
        """Step elements [lo, hi) of a sub-group: ``master`` its fp32 master weights (the sub-group's
        length), ``grad`` its gradient (fp32, or bf16 read as it is; at least ``hi`` long),
        ``m_raw``/``v_raw`` its moments' raw bytes. ``copies``: ``(start, end, out)`` with ``out`` a
        contiguous bf16 tensor of ``end - start`` elements, sorted, disjoint and within [lo, hi): each
        receives the new weights of [start, end) in bf16 (rounded to nearest even), written while the
        kernel has them in cache; or every ``out`` fp32, receiving the new weights themselves."""
        numel = master.numel()
        if grad.dtype not in (torch.float32, torch.bfloat16) or (grad.dtype == torch.bfloat16 and not self.copies):
            raise TypeError(f"MomentStep: a {grad.dtype} gradient (fp32, or bf16 with a kernel that reads it)")
        if copies and not self.copies:
            raise RuntimeError("MomentStep: this build of infinity.optim._qadam writes no copies (rebuild it: "
                               "`python setup.py build_ext --inplace`)")
        if self.native:
            fmt = self.fmt
            if fmt.dtype == "int8":
                (m, ms), (v, vs) = fmt.split(m_raw, numel), fmt.split(v_raw, numel)
                addrs = (m.data_ptr(), v.data_ptr(), ms.data_ptr(), vs.data_ptr())
                block = fmt.block_size
            else:
                addrs, block = (m_raw.data_ptr(), v_raw.data_ptr(), 0, 0), _BF16_WORK_BLOCK
            args = (_MODES[fmt.dtype], numel, lo, hi, block, master.data_ptr(), grad.data_ptr(),
                    addrs[0], addrs[1], addrs[2], addrs[3], hyper.step, hyper.lr, hyper.beta1, hyper.beta2,
                    hyper.eps, hyper.weight_decay, hyper.grad_mul, hyper.decoupled, seed, torch.get_num_threads())
            if not copies and grad.dtype == torch.float32:
                _qadam.step(*args)
                return
            outs = []
            fp32 = bool(copies) and copies[0][2].dtype == torch.float32
            if fp32 and not self.copies_fp32:
                raise RuntimeError("MomentStep: this build of infinity.optim._qadam writes no fp32 copies (rebuild "
                                   "it: `python setup.py build_ext --inplace`)")
            want, name = (torch.float32, "fp32") if fp32 else (torch.bfloat16, "bf16")
            for a, b, out in copies:
                if out.dtype != want or out.numel() != b - a or not out.is_contiguous():
                    raise ValueError(f"MomentStep: the copy of [{a}, {b}) must be {b - a} contiguous {name} "
                                     f"elements (all copies of a call one dtype), not {out.dtype} {tuple(out.shape)}")
                outs.append((a, b, out.data_ptr()))
            _qadam.step(*args, grad.dtype == torch.bfloat16, outs, *((True,) if fp32 else ()))
        else:
            step_torch(self.fmt, master, grad.float(), m_raw, v_raw, lo, hi, hyper, seed)
            for a, b, out in copies:
                out.copy_(master[a:b])


def _adam(p, g, m, v, h: AdamHyper):
    """Adam on fp32 tensors in place (the kernel's arithmetic, in float32); returns sqrt of the new v."""
    f32 = torch.float32
    g = g * torch.tensor(h.grad_mul, dtype=f32)
    if h.decoupled:
        p.mul_(torch.tensor(1.0, dtype=f32) - torch.tensor(h.lr, dtype=f32) * torch.tensor(h.weight_decay, dtype=f32))
    else:
        g = g + torch.tensor(h.weight_decay, dtype=f32) * p
    b1, b2 = torch.tensor(h.beta1, dtype=f32), torch.tensor(h.beta2, dtype=f32)
    m.copy_(b1 * m + (1 - b1) * g)
    v.copy_(b2 * v + (1 - b2) * g * g)
    w = v.sqrt()
    step_size = h.lr / (1.0 - h.beta1 ** h.step)
    inv = 1.0 / math.sqrt(1.0 - h.beta2 ** h.step)
    p.sub_(torch.tensor(step_size, dtype=f32) * m / (w * torch.tensor(inv, dtype=f32) + torch.tensor(h.eps, dtype=f32)))
    return w


def step_torch(fmt: MomentFormat, master: torch.Tensor, grad: torch.Tensor, m_raw: torch.Tensor,
               v_raw: torch.Tensor, lo: int, hi: int, hyper: AdamHyper, seed: int) -> None:
    """The C kernel's step in torch ops (see [Note: the compressed step])."""
    if lo >= hi:
        return
    numel = master.numel()
    p = master[lo:hi]
    if fmt.dtype == "bf16":
        m16, v16 = m_raw.view(torch.int16)[lo:hi], v_raw.view(torch.int16)[lo:hi]
        m, v = _bf16_value(m16), _bf16_value(v16)
        _adam(p, grad[lo:hi], m, v, hyper)
        index = torch.arange(lo, hi, dtype=torch.int64)
        m16.copy_(_bf16_sr(m, seed, index))
        v16.copy_(_bf16_sr(v, seed ^ 0x5BD1E995, index))
        return
    B = fmt.block_size
    a, b = fmt.covering(lo, hi, numel)
    (mc, ms), (vc, vs) = fmt.split(m_raw, numel), fmt.split(v_raw, numel)
    k0, k1 = a // B, -(-b // B)
    fm = _decode_int8(mc[a:b], ms.view(torch.float32)[k0:k1], B, False)
    c = vc[a:b].to(torch.int32)
    per = (vs.view(torch.float32)[k0:k1] * (torch.ones((), dtype=torch.float32) / CODE_TOP)).repeat_interleave(B)
    fw = _decode_mag(c, _W_BITS, _W_BIAS) * per[:c.numel()]
    i0, i1 = lo - a, hi - a
    fv = fw[i0:i1] * fw[i0:i1]
    fm_part = fm[i0:i1]
    fw[i0:i1] = _adam(p, grad[lo:hi], fm_part, fv, hyper)
    (cm, am), (cw, aw) = _encode_int8_parts(fm, fw, B)
    mc[a:b] = cm
    vc[a:b] = cw
    ms.view(torch.float32)[k0:k1] = am
    vs.view(torch.float32)[k0:k1] = aw
