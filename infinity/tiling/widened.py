"""Linear layers in bf16/fp16 on the CPU, multiplied in fp32 (``[precision] cpu_linear = "float32"``).

[Note: widened linear layers]
With the CPU as compute device and a 2-byte compute dtype, torch's matmul is the bottleneck on an x86
CPU without AVX-512 (which torch's fast bf16 path needs): on the AVX2 EPYC here, a 128 x 4096 by 4096 x
11008 product runs 21.6 GFLOP/s in bf16 for forward (``x @ W.T``), 0.3 for the input's gradient
(``g @ W``) and 5.4 for the weight's (``g.T @ x``), against 95 / 93 / 73 in fp32 (2 threads). A 6.7B
model's backward at 128 tokens would take hours.

So with the key set, each linear layer computes in fp32: input and weight widened exactly, one fp32
product (fp32 accumulation, which torch's bf16 kernels use too, in another order), the output rounded
to the compute dtype once; backward widens the incoming gradient and the weight again and rounds the
input's and the weight's gradients once. Nothing fp32 is saved for backward (the input and the
weight are, as ``F.linear`` saves them); the widened weight and the weight's fp32 gradient go into two
buffers per thread, kept for reuse at the largest layer's size (``_fp32``: 2 x 524 MB for a 6.7B
Llama's head), so memory is as before plus those (infinity-plan's "widened_linear" row, and
``infinity.Init``'s budget check, count them: ``widened_numel``). Results differ from "native" in
rounding only; "native" stays the default because it is bit for bit plain PyTorch.

Which layers: every module whose ``forward`` is ``nn.Linear``'s or a linear tile's (subclasses that
keep ``forward``, such as a bias-free ``nn.Linear`` subclass, included). Each is converted in place
at ``infinity.Init``'s exit, after tiling, to a subclass of its own class that differs in ``forward``
only (``isinstance``, the class name, the parameters and ``state_dict`` keys are unchanged). Other
modules calling ``F.linear`` themselves (a tied output head written as a function) are left alone.
Off the CPU, in fp32, or for an input not in the weight's dtype (autocast, mixed inputs), ``forward``
is ``F.linear`` itself.

A module that calls ``F.linear`` itself can call ``widened_linear`` instead (the example GPT's tied head
does when its script reads the key: infinity/examples/train_gpt.py). That function widens into fresh
tensors, freed when the product is done, like any activation: the two reused buffers, which the budget
counts, stay the converted layers'.
"""
from __future__ import annotations

import logging
import platform
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from infinity.tiling.layers import _LinearTile

_NARROW = (torch.bfloat16, torch.float16)
logger = logging.getLogger("infinity")
_advised = False


_scratch = threading.local()


def _fp32(slot: str | None, shape: torch.Size) -> torch.Tensor:
    """A reused fp32 tensor of ``shape`` for ``slot`` (this thread's; grown, never shrunk), or a fresh one
    for no slot: a fresh weight-sized tensor per product is page-faulted afresh each time (torch's
    ``w.float()`` of a 4096 x 11008 bf16 weight: 1.9 ns per element; into a reused buffer 0.24)."""
    if slot is None:
        return torch.empty(shape, dtype=torch.float32)
    numel = shape.numel()
    buf = getattr(_scratch, slot, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.float32)
        setattr(_scratch, slot, buf)
    return buf[:numel].view(shape)


class _WidenedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, reuse: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.slots = ("weight", "weight_grad") if reuse else (None, None)
        with torch.autocast("cpu", enabled=False):
            w32 = _fp32(ctx.slots[0], weight.shape).copy_(weight)
            y = F.linear(x.float(), w32, None if bias is None else bias.float())
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.float()
        gx = gw = gb = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                gx = (g @ _fp32(ctx.slots[0], weight.shape).copy_(weight)).to(x.dtype)
            if ctx.needs_input_grad[1]:
                gw32 = torch.mm(g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1]).float(),
                                out=_fp32(ctx.slots[1], weight.shape))
                gw = gw32.to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                gb = g.reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        return gx, gw, gb, None


def _widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, reuse: bool) -> torch.Tensor:
    if (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype in _NARROW and x.dtype == weight.dtype
            and (bias is None or bias.dtype == x.dtype) and not torch.is_autocast_enabled("cpu")):
        return _WidenedLinear.apply(x, weight, bias, reuse)
    return F.linear(x, weight, bias)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, multiplied in fp32 when all are on the CPU in one 2-byte dtype (the
    fp32 weight and weight gradient are fresh tensors, freed after the product)."""
    return _widened(x, weight, bias, reuse=False)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return _widened(x, self.weight, self.bias, reuse=True)


_LINEAR_FORWARDS = (nn.Linear.forward, _LinearTile.forward)
_widened_classes: dict[type, type] = {}


def _widened_class(cls: type) -> type:
    got = _widened_classes.get(cls)
    if got is None:
        got = type(cls.__name__, (cls,), {"forward": _forward, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, "_widened": True})
        _widened_classes[cls] = got
    return got


def widen_linears(roots) -> int:
    """Convert every linear layer under ``roots`` ([Note: widened linear layers]); returns how many."""
    count = 0
    for root in roots:
        for m in root.modules():
            cls = type(m)
            if getattr(cls, "_widened", False) or cls.forward not in _LINEAR_FORWARDS:
                continue
            m.__class__ = _widened_class(cls)
            count += 1
    return count


def widened_numel(roots, numel=torch.Tensor.numel) -> int:
    """Elements of the largest weight among the converted layers under ``roots``: the size of this
    thread's two fp32 buffers once they have all run (infinity-plan's "widened_linear" row).
    ``numel(weight)``: its element count (a partitioned weight's is its slot's, not its placeholder's)."""
    return max((numel(m.weight) for root in roots for m in root.modules() if getattr(type(m), "_widened", False)),
               default=0)


def slow_narrow_matmul() -> bool:
    """Whether torch's CPU kernels here lack AVX-512, which its fast bf16/fp16 matmul path needs on x86."""
    return platform.machine().lower() in ("x86_64", "amd64") and "AVX512" not in torch.backends.cpu.get_cpu_capability()


def apply_cpu_linear(setting: str, device: torch.device, dtype: torch.dtype, roots) -> int:
    """At ``infinity.Init``'s exit: convert the linear layers when ``[precision] cpu_linear`` asks and
    they compute on the CPU in a 2-byte dtype; with "native" on a CPU without AVX-512 (whose bf16 and
    fp16 matmul torch runs on a slow path), say once per process which key speeds them up."""
    global _advised
    if device.type != "cpu" or dtype not in _NARROW:
        return 0
    if setting == "float32":
        return widen_linears(roots)
    if not _advised and slow_narrow_matmul():
        _advised = True
        logger.warning("infinity: %s linear layers on this CPU (no AVX-512) run torch's slow path for the dtype "
                       "(0.3-20 GFLOP/s, against ~90 in float32 here); [precision] cpu_linear = \"float32\" "
                       "multiplies them in fp32 and rounds once (not bit-identical to plain PyTorch)",
                       str(dtype).replace("torch.", ""))
    return 0
