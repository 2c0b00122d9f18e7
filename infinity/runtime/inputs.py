"""What the engine says when a model's forward meets its compute dtype with a tensor of another dtype.

[Note: inputs in the compute dtype]
With precision.dtype "bfloat16" or "float16" (every preset), a model's parameters are in that dtype in
forward and backward, as after ``model.to(dtype)``: a plain fp32 model given fp32 inputs fails in its
first layer ("mat1 and mat2 must have the same dtype"), as it would after ``model.to(dtype)``. The inputs
are not cast for the user: the engine cannot tell an input from a regression target, a mask of weights or
a timestep given to the same forward, and rounding those to 8 bits of mantissa would change the training
silently (a target cast to bf16 keeps 3 significant digits). So torch's dtype error stands, and infinity
adds a note to it naming precision.dtype and the ways out: give the inputs in the compute dtype
(``x.to(torch.bfloat16)``; token ids and other integer tensors need nothing), make a tensor created inside
the forward in the weights' dtype, or compute in float32 (``explain_dtype_mismatch``).
"""
from __future__ import annotations

import re

import torch

from infinity.errors import add_note

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
    add_note(error,
        f"infinity: this model computes in {name} ([precision] dtype = \"{name}\", as in every preset): its "
        f"parameters are {name} in forward and backward, as after model.to(torch.{name}), and a tensor of "
        f"another dtype met one of them. Give floating-point inputs in {name} (`x.to(torch.{name})`; token "
        "ids need nothing; infinity does not cast them for you, a target or a mask would be rounded), make a "
        "tensor created inside the forward in the weights' dtype (`t.to(self.weight.dtype)`), or compute in "
        "float32: infinity.Init(infinity.load_config(preset, overrides={\"precision\": {\"dtype\": "
        "\"float32\"}})).")
