"""The safetensors file format, written without the library: a header the writer streams tensors behind.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range in the data that follows (``__metadata__``: strings), then the tensors' bytes. The
header is written first, from shapes and dtypes alone, so a writer can place each tensor's bytes at its
offset as the tensor becomes available, never holding the file's tensors at once
(infinity/checkpoint/consolidate.py from a checkpoint's shards, infinity/runtime/hf_save.py from a live
model's gathered modules).
"""
from __future__ import annotations

import json
import struct

import torch

DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def header(tensors, metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The bytes a file starts with, and where each tensor's data begins in the file.

    ``tensors``: ``(key, dtype, shape, nbytes)`` in the order their bytes follow, back to back.
    """
    fields, starts, position = {}, {}, 0
    for key, dtype, shape, nbytes in tensors:
        fields[key] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [position, position + nbytes]}
        starts[key] = position
        position += nbytes
    fields["__metadata__"] = metadata
    raw = json.dumps(fields, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)    # the data 8-byte aligned, as the library writes it
    data_start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {key: data_start + start for key, start in starts.items()}
