"""infinity: heterogeneous-memory offload engine for PyTorch (ZeRO-Infinity style)."""

__version__ = "0.1.0"

# Public names resolve on first use, so `import infinity` stays cheap (no torch import).
_LAZY = {"load_config": "infinity.config"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'infinity' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
