"""A benchmark script (``benchmarks/<name>.py``, not a package) loaded as a module, for its ``main``."""
from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str):
    """A fresh module of ``benchmarks/<name>.py`` (each call runs the script's top level again)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
