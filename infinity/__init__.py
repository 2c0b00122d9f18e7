"""infinity: heterogeneous-memory offload engine for PyTorch (ZeRO-Infinity style).

[Note: glossary]
- rank: one data-parallel process; parameters, gradients and optimizer states are
  split over all ranks (ZeRO-3).
- shard: one rank's 1/N slice of a flattened, padded parameter group.
- tier: where bytes live: ``device`` (the compute device), ``host`` (page-aligned,
  pinned host RAM) or ``nvme`` (swap files, asynchronous direct I/O).
- parameter group: the direct parameters of one module, the unit of every transfer.
- parameter states: NOT_AVAILABLE (only shards exist), INFLIGHT (reads and the
  all-gather issued), AVAILABLE (whole on the compute device); released back to
  NOT_AVAILABLE after use.
- trace: the order in which modules asked for their parameters during a step,
  recorded once and followed by the prefetcher.
- tile: one of the k slices of a huge linear layer's weight, fetched and released
  one after another.
- sub-group: a fixed-size range of a rank's flat fp32 optimizer space, the unit of
  the host Adam step and of optimizer-state I/O.
"""

__version__ = "0.1.0"

# Public names resolve on first use, so `import infinity` stays cheap (no torch import).
_LAZY = {
    "load_config": "infinity.config",
    "Init": "infinity.runtime.init",
    "AdamW": "infinity.optim.adam",
    "Adam": "infinity.optim.adam",
    "clip_grad_norm_": "infinity.optim.adam",
    "gathered": "infinity.runtime.gathered",
    "state_dict": "infinity.runtime.gathered",
    "release": "infinity.runtime.release",
    "stats": "infinity.telemetry",
    "trace": "infinity.timeline",
    "save_checkpoint": "infinity.checkpoint",
    "load_checkpoint": "infinity.checkpoint",
    "TiledLinear": "infinity.tiling",
    "TiledEmbedding": "infinity.tiling",
    "activation_checkpoint": "infinity.runtime.checkpointing",
    "from_pretrained": "infinity.runtime.init",
    "save_pretrained": "infinity.runtime.hf_save",
    "Trainer": "infinity.checkpoint.trainer",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'infinity' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
