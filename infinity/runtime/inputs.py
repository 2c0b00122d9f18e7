"""What the engine does to the inputs of a model's outermost forward, and to the dtype errors they cause.

[Note: inputs in the compute dtype]
With precision.dtype "bfloat16" or "float16" (every preset), a model's parameters are in that dtype in
forward and backward, as after ``model.to(dtype)``: a plain fp32 model given fp32 inputs would fail in
its first layer ("mat1 and mat2 must have the same dtype"). So the floating-point tensors given to the
outermost forward (args and kwargs, inside lists, tuples and dicts) are cast to the compute dtype first,
as DeepSpeed's engine casts its inputs under fp16/bf16 (``auto_cast``): differentiable, so an input that
requires grad gets its gradient in its own dtype. Integer tensors (token ids, masks, labels) stay as they
are. The output is in the compute dtype; torch's losses take an fp32 target beside it. A recompute
inside backward is not cast (its inputs were the forward's). A float32 tensor made inside the forward
(a buffer, ``torch.randn``) is not the engine's to see: when one meets a compute-dtype weight, torch's
error gets a note naming precision.dtype and what to do (``explain_dtype_mismatch``).
"""
from __future__ import annotations

import re

import torch
from torch.utils._pytree import tree_map

_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def in_compute_dtype(args, kwargs, dtype: torch.dtype):
    """``(args, kwargs)`` with their floating-point tensors cast to ``dtype``; None when none needs it (see
    [Note: inputs in the compute dtype])."""
    if dtype == torch.float32:
        return None
    changed = False

    def cast(x):
        nonlocal changed
        if isinstance(x, torch.Tensor) and x.dtype in _CASTABLE and x.dtype != dtype:
            changed = True
            return x.to(dtype)
        return x

    out = tree_map(cast, (args, kwargs or {}))
    return out if changed else None


_DTYPE_MISMATCH = re.compile(r"same dtype|scalar type|should be the same|expected .*dtype", re.I)
_TORCH_NAMES = {torch.bfloat16: ("BFloat16", "bfloat16"), torch.float16: ("Half", "float16")}


def explain_dtype_mismatch(error, dtype: torch.dtype) -> None:
    """Add a note to torch's dtype-mismatch error raised in a compute-dtype model's forward: what met what,
    and what to do (see [Note: inputs in the compute dtype])."""
    names = _TORCH_NAMES.get(dtype)
    if names is None or not isinstance(error, RuntimeError) or not _DTYPE_MISMATCH.search(str(error)):
        return
    if not any(n in str(error) for n in names) or any("infinity" in n for n in getattr(error, "__notes__", ())):
        return
    name = names[1]
    error.add_note(
        f"infinity: this model computes in {name} ([precision] dtype = \"{name}\", as in every preset): its "
        f"parameters are {name} in forward and backward, and the floating-point inputs of its outermost "
        f"forward are cast to {name}, but a tensor of another dtype made inside the forward (a buffer, "
        "torch.randn, torch.zeros(..., dtype=torch.float32)) met one of them. Make it in the weights' dtype "
        f"(`t.to(self.weight.dtype)`), or compute in float32: infinity.Init(infinity.load_config(preset, "
        "overrides={\"precision\": {\"dtype\": \"float32\"}})).")
