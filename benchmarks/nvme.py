"""Thin wrapper: ``python benchmarks/nvme.py --path DIR ...`` is ``infinity-bench nvme --path DIR ...``."""
from __future__ import annotations

import sys

from infinity.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(["nvme", *sys.argv[1:]]))
