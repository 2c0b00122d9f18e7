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


_MT_WORDS = 624          # the Mersenne Twister's state: Python's and NumPy's legacy generator
_MAX_STATE_B64 = 1 << 20


def _check_b64(text, what: str, nbytes: int | None = None) -> None:
    if type(text) is not str or len(text) > _MAX_STATE_B64:
        raise ValueError(f"{what} is not a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise ValueError(f"{what} is not valid base64") from None
    if nbytes is not None and len(raw) != nbytes:
        raise ValueError(f"{what} holds {len(raw)} bytes, a generator state {nbytes}")


def _check_words(words, what: str, count: int) -> None:
    if type(words) is not list or len(words) != count or \
            any(type(w) is not int or not 0 <= w < 1 << 32 for w in words):
        raise ValueError(f"{what} is not {count} unsigned 32-bit integers")


def check(state: dict) -> None:
    """Raise ``ValueError`` saying what is wrong when ``state`` is not what :func:`capture` writes: every
    generator's type, size and ranges, before :func:`restore` applies any of it."""
    _check_b64(state.get("torch"), "torch", torch.get_rng_state().numel())
    python = state.get("python")
    if type(python) is not list or len(python) != 3 or python[0] != random.getstate()[0]:
        raise ValueError("python is not [version, internal state, gauss] of this Python's random")
    _check_words(python[1], "python's internal state", _MT_WORDS + 1)
    if python[1][-1] > _MT_WORDS or (python[2] is not None and type(python[2]) is not float):
        raise ValueError("python's position or gauss is out of range")
    cuda = state.get("cuda")
    if cuda is not None:
        if type(cuda) is not list or len(cuda) > 1024:
            raise ValueError("cuda is not a list of device states")
        for i, one in enumerate(cuda):
            _check_b64(one, f"cuda[{i}]")
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        if type(numpy_state) is not list or len(numpy_state) != 5 or numpy_state[0] != "MT19937":
            raise ValueError("numpy is not [\"MT19937\", keys, pos, has_gauss, cached]")
        _check_words(numpy_state[1], "numpy's keys", _MT_WORDS)
        pos, has_gauss, cached = numpy_state[2:]
        if type(pos) is not int or not 0 <= pos <= _MT_WORDS or has_gauss not in (0, 1) or \
                type(cached) not in (int, float):
            raise ValueError("numpy's position, has_gauss or cached value is out of range")


def restore(state: dict) -> None:
    """Set this process's generators to ``state`` (from :func:`capture`, checked by :func:`check`)."""
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
