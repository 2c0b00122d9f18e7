"""``infinity-plan``: model-state arithmetic and per-rank plans, before step 0.

Usage::

    infinity-plan table --params 7.5e9,128e9,1e12 --ranks 1,4,16,64,256,1024
    infinity-plan model --model mypkg.models:build --config offload.toml --ranks 4 \\
        --bench-json nvme.json
    infinity-plan model --params 1.3e9 --config offload.toml --read-gbps 2.4 --write-gbps 3 --json
    infinity-plan model --model mymodels:build --config nvme --set tiers.nvme_path=/mnt/nvme
    infinity-plan model --params 13B --config auto --set tiers.nvme_path=/mnt/nvme --machine box.toml

Exit status: 0 on success; 1 when ``model`` finds the plan does not fit this machine (a missing
or unusable ``nvme_path`` included) or the work fails; 2 on bad input (one line on stderr naming
the problem, no traceback unless ``--debug``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from infinity.cli.common import Parser, check_output, run, write_text_atomic

PROG = "infinity-plan"


def _build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0], debug=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    table = sub.add_parser(
        "table",
        help="ZeRO model states per rank for each stage, in GB (1e9 bytes)",
        description="The ZeRO paper's per-rank model-state bytes for stages 0-3, in decimal GB.",
    )
    table.add_argument("--params", required=True,
                       help="comma-separated parameter counts, e.g. 7.5e9,128e9,1e12 or 1.3B")
    table.add_argument("--ranks", required=True,
                       help="comma-separated data-parallel degrees, e.g. 1,4,16,64")
    table.add_argument("--k", type=int, default=12,
                       help="optimizer-state bytes per parameter (default 12: mixed-precision Adam)")
    table.add_argument("--param-bytes", type=int, default=2, help="bytes per parameter (default 2)")
    table.add_argument("--grad-bytes", type=int, default=2, help="bytes per gradient (default 2)")
    table.add_argument("--json", nargs="?", const="-", metavar="PATH",
                       help="write JSON to PATH (or to stdout instead of the table, without PATH)")

    model = sub.add_parser(
        "model",
        help="per-rank bytes per tier, fit, NVMe traffic and step-time bound for a model",
        description="Plan a model under an infinity config: bytes per tier per rank (GiB), "
                    "whether it fits this machine, NVMe traffic per step and a step-time bound.",
    )
    what = model.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", metavar="PKG.MODULE:CALLABLE",
                      help="a callable returning an nn.Module, built on the meta device; the current "
                           "directory is importable, as with python -m")
    what.add_argument("--params", help="a bare parameter count, e.g. 1.3e9 or 1.3B")
    model.add_argument("--config", required=True, help="config file (.toml/.json) or preset name")
    model.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="change one config key, e.g. tiers.nvme_path=/mnt/nvme (the nvme preset's path is "
                            "a placeholder); repeatable; values are JSON when they parse, else strings")
    model.add_argument("--ranks", type=int, default=1, help="data-parallel world size (default 1)")
    model.add_argument("--local-ranks", type=int, default=None,
                       help="ranks on this machine (default: all); must divide --ranks")
    bw = model.add_mutually_exclusive_group()
    bw.add_argument("--bench-json", metavar="FILE", help="an 'infinity-bench nvme --json' result")
    bw.add_argument("--read-gbps", type=float, help="NVMe read bandwidth, GB/s (1e9 bytes/s)")
    model.add_argument("--write-gbps", type=float, help="NVMe write bandwidth, GB/s")
    model.add_argument("--activation-bytes", metavar="SIZE",
                       help="bytes of checkpointed activations per rank, e.g. 32MiB (sets "
                            "activations.checkpoint_nbytes; blocks x batch x sequence x hidden x dtype bytes "
                            "for a transformer with every block checkpointed)")
    model.add_argument("--machine", metavar="FILE",
                       help="a machine profile (JSON or TOML: device_bytes, host_bytes, nvme_bytes, rates; see "
                            "infinity.plan.machine.MachineProfile) to predict the step on; with tiers \"auto\" and "
                            "no profile, this machine is probed once and cached (~/.cache/infinity/machine.json)")
    model.add_argument("--probe", action="store_true",
                       help="predict the step on this machine, probed once and cached, whatever the tiers")
    model.add_argument("--reprobe", action="store_true",
                       help="probe this machine again and replace its cached rates (implies --probe)")
    model.add_argument("--tokens", default="16384", metavar="N",
                       help="tokens per rank and step for the predicted compute (default 16384)")
    model.add_argument("--recompute", action="store_true",
                       help="activation checkpointing: backward runs the forward again")
    model.add_argument("--no-check", action="store_true",
                       help="do not check the plan against this machine's memory and disks")
    model.add_argument("--json", nargs="?", const="-", metavar="PATH",
                       help="write JSON to PATH (or to stdout instead of the table, without PATH)")
    return parser


def _split(text: str, what: str) -> list[str]:
    from infinity.plan import PlanError

    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise PlanError(f"{what} needs at least one value, got {text!r}")
    return items


def _parse_ranks(text: str) -> list[int]:
    from infinity.plan import PlanError

    ranks = []
    for item in _split(text, "--ranks"):
        if not item.isdigit() or int(item) < 1:
            raise PlanError(f"--ranks values must be positive integers, got {item!r}")
        ranks.append(int(item))
    return ranks


def _emit_json(data: object, dest: str) -> None:
    text = json.dumps(data, indent=2)
    if dest == "-":
        print(text)
    else:
        write_text_atomic(dest, text + "\n")


def _run_table(args: argparse.Namespace) -> int:
    from infinity.plan import render_zero_table, zero_table

    check_output(args.json, "--json")

    rows = zero_table(
        _split(args.params, "--params"),
        _parse_ranks(args.ranks),
        k=args.k,
        param_bytes=args.param_bytes,
        grad_bytes=args.grad_bytes,
    )
    if args.json != "-":
        print(render_zero_table(rows, k=args.k))
    if args.json:
        _emit_json(
            {
                "unit": "bytes per rank (GB = 1e9 bytes in the printed table)",
                "k": args.k,
                "param_bytes": args.param_bytes,
                "grad_bytes": args.grad_bytes,
                "rows": rows,
            },
            args.json,
        )
    return 0


def _config(args: argparse.Namespace):
    """``--config`` with ``--set`` and ``--activation-bytes`` applied; an error names the flag and the key."""
    from infinity.config import ConfigError, load_config, parse_overrides
    from infinity.plan import PlanError, resolve_config

    flags = {}      # "section.key" -> the flag that set it, for the error
    try:
        overrides = parse_overrides(args.overrides)
    except ConfigError as exc:
        raise PlanError(f"--set {exc}") from None
    for item in args.overrides:
        flags[item.partition("=")[0].strip()] = f"--set {item}"
    if args.activation_bytes is not None:
        overrides.setdefault("activations", {})["checkpoint_nbytes"] = args.activation_bytes
        flags["activations.checkpoint_nbytes"] = "--activation-bytes"
    if not overrides:
        return args.config
    try:
        return load_config(resolve_config(args.config), overrides=overrides)
    except ConfigError as exc:
        if exc.file != "overrides":
            raise
        flag = flags.get(exc.key or "") or next((f for k, f in flags.items() if k.startswith(f"{exc.key}.")), "--set")
        raise PlanError(f"{flag}: {exc.key}: {exc.reason}" if exc.key else f"{flag}: {exc.reason}") from exc


def _prediction_inputs(args: argparse.Namespace, config) -> dict:
    """``machine`` and ``workload`` for ``plan``: the profile file, or this machine probed (``--probe``; "auto"
    tiers probe without it), and the tokens and recompute of ``--tokens`` / ``--recompute``."""
    from infinity.plan import PlanError, resolve_config
    from infinity.plan.placement import default_workload

    if args.machine and (args.probe or args.reprobe):
        raise PlanError("give --machine or --probe/--reprobe, not both")
    cfg = resolve_config(config)
    try:
        workload = dataclasses.replace(default_workload(cfg), tokens=args.tokens, recompute=args.recompute)
    except PlanError as exc:
        raise PlanError(f"--tokens: {exc}") from None
    if args.machine:
        return {"machine": args.machine, "workload": workload}
    if args.probe or args.reprobe or "auto" in (cfg.tiers.params, cfg.tiers.optimizer):
        from infinity.plan.probes import machine_profile

        local = args.local_ranks or args.ranks
        profile = machine_profile(cfg.tiers.compute_device(), cfg.precision.dtype, ranks=local,
                                  nvme_paths=tuple(cfg.tiers.nvme_path), host_budget=int(cfg.tiers.host_budget),
                                  bench_json=args.bench_json, refresh=args.reprobe)
        return {"machine": profile, "workload": workload}
    return {"workload": workload}


def _run_model(args: argparse.Namespace) -> int:
    from infinity.plan import Bandwidth, PlanError, plan

    check_output(args.json, "--json")

    bandwidth: object = None
    if args.bench_json:
        if args.write_gbps is not None:
            raise PlanError("give --bench-json or --read-gbps/--write-gbps, not both")
        bandwidth = args.bench_json
    elif (args.read_gbps is None) != (args.write_gbps is None):
        raise PlanError("--read-gbps and --write-gbps go together")
    elif args.read_gbps is not None:
        bandwidth = Bandwidth(args.read_gbps, args.write_gbps, source="command line")
    config = _config(args)
    if args.model:
        # A console script's sys.path holds its own bin/ directory, not the working directory, so
        # `--model mymodels:build` failed until PYTHONPATH=. Put it first, as python -m does.
        sys.path.insert(0, os.getcwd())
    result = plan(
        args.model if args.model else args.params,
        config,
        world_size=args.ranks,
        nvme_bandwidth=bandwidth,
        local_ranks=args.local_ranks,
        check_fit=not args.no_check,
        **_prediction_inputs(args, config),
    )
    if args.json != "-":
        print(result.table())
    if args.json:
        _emit_json(result.to_dict(), args.json)
    return 0 if result.fit is None or result.fit.fits else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``infinity-plan``; returns the exit status.

    Examples
    --------
    >>> main(["table", "--params", "7.5e9", "--ranks", "64"])  # doctest: +SKIP
    0
    """
    args = _build_parser().parse_args(argv)
    from infinity.plan import PlanError

    body = _run_table if args.command == "table" else _run_model
    return run(f"{PROG} {args.command}", args.debug, lambda: body(args), usage=(PlanError,))


if __name__ == "__main__":
    sys.exit(main())
