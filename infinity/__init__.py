"""infinity: heterogeneous-memory offload engine for PyTorch (ZeRO-Infinity style)."""

__version__ = "0.1.0"
