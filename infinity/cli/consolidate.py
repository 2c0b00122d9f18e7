"""infinity-consolidate: one ordinary PyTorch state dict from a sharded infinity checkpoint.

Streams tensor by tensor from the checkpoint's fp32 master shards (any world size), with no
model and bounded memory, into a ``torch.save`` file that the plain model loads with
``model.load_state_dict(torch.load(OUT))``, tied parameters under every name. ``--dtype``
casts parameters and floating-point buffers; ``--safetensors`` (or an OUT ending in
``.safetensors``) writes that format instead. Every chunk read is checked against its CRC-32.

Examples
--------
    infinity-consolidate ckpt/ model.pt
    infinity-consolidate ckpt/step00001200-5c0d2e4f9a1b3c77 model.safetensors --dtype bfloat16
    infinity-consolidate ckpt/ exp_avg_sq.pt --state exp_avg_sq
"""
from __future__ import annotations

import argparse
import sys

from infinity.cli.common import Parser, UsageError, run

_DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="infinity-consolidate",
        description="Write one ordinary PyTorch state dict (torch.save or safetensors) from an infinity "
                    "checkpoint, streaming tensor by tensor.")
    parser.add_argument("ckpt", metavar="CKPT", help="checkpoint directory (its latest version) or a version directory")
    parser.add_argument("out", metavar="OUT", help="file to write (replaced atomically when complete)")
    parser.add_argument("--dtype", choices=_DTYPES, default="float32",
                        help="dtype of parameters and floating-point buffers (default: float32, the masters)")
    parser.add_argument("--safetensors", action="store_true",
                        help="write safetensors (default when OUT ends in .safetensors)")
    parser.add_argument("--state", choices=("master", "exp_avg", "exp_avg_sq"), default="master",
                        help="what each parameter's tensor holds: the parameters (master, default) or Adam's "
                             "moments, fp32 whatever [optimizer] state_dtype stored them (no buffers then)")
    parser.add_argument("--buffer-size", default=None,
                        help="bytes read from the checkpoint at a time, e.g. 64MiB (default: the config default)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``infinity-consolidate``; exit 0, 1 (the checkpoint could not be read or written) or 2
    (wrong arguments); see [Note: command-line errors] in infinity/cli/common.py."""
    args = build_parser().parse_args(argv)
    return run("infinity-consolidate", args.debug, lambda: _consolidate(args))


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from infinity.config.sizes import parse_size
    from infinity.checkpoint.consolidate import check_buffer_size, consolidate

    try:
        buffer_size = parse_size(args.buffer_size) if args.buffer_size else None
    except ValueError as exc:
        raise UsageError(f"--buffer-size {args.buffer_size!r}: {exc}") from None
    safetensors = args.safetensors or args.out.endswith(".safetensors")
    if buffer_size is not None:
        try:
            check_buffer_size(buffer_size)
        except ValueError as exc:
            raise UsageError(f"--buffer-size {args.buffer_size!r}: {exc}") from None
    summary = consolidate(args.ckpt, args.out, getattr(torch, args.dtype), safetensors=safetensors,
                          buffer_size=buffer_size, state=args.state)
    seconds = summary["seconds"]
    rate = summary["nbytes"] / seconds / 1e9 if seconds > 0 else float("nan")
    rows = [("checkpoint", summary["directory"]), ("output", args.out), ("format", summary["format"]),
            ("dtype", args.dtype), ("tensors", str(summary["tensors"])),
            ("bytes", f"{summary['nbytes']:,}"), ("seconds", f"{seconds:.2f}"), ("GB/s written", f"{rate:.2f}")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
