"""The random number generators a resumed run must continue from, as plain JSON data.

Saved per rank: torch's CPU generator, every CUDA device's generator (when CUDA is
initialized), Python's ``random`` and NumPy's legacy global ``np.random`` state. A
generator the saving process did not have (no CUDA, no NumPy) is recorded as None
and left alone on restore.
"""
from __future__ import annotations

import base64
import random

import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture() -> dict:
    """This process's generator states."""
    version, internal, gauss = random.getstate()
    state = {"torch": _b64(torch.get_rng_state()), "python": [version, list(internal), gauss],
             "cuda": None, "numpy": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return state


def restore(state: dict) -> None:
    """Set this process's generators to ``state`` (from :func:`capture`)."""
    torch.set_rng_state(_unb64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        states = [_unb64(s) for s in cuda]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = numpy_state
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
