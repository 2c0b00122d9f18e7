"""How the host Adam kernels store the copies they write, chosen for a test ([Note: copies past the
caches] in optim_csrc/qadam.c): "cached" (plain stores, as calls that fit in the caches make them) or
"streamed" (non-temporal stores, as calls larger than the caches make them)."""
from __future__ import annotations

import contextlib

import pytest

from infinity.optim import moments

HOW = ("cached", "streamed")


@contextlib.contextmanager
def copies_stored(how: str):
    """Every call of the C kernels inside stores its copies ``how`` (see the module docstring)."""
    qadam = moments._qadam
    if qadam is None or not hasattr(qadam, "stream_copies"):
        if how == "streamed":
            pytest.skip("this build of the C kernel stores no copies past the caches")
        yield
        return
    saved = qadam.stream_copies()
    qadam.stream_copies({"cached": -1, "streamed": 0}[how])
    try:
        yield
    finally:
        qadam.stream_copies(saved)
