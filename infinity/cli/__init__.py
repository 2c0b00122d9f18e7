"""The command lines: ``infinity-bench``, ``infinity-report``, ``infinity-plan``, ``infinity-consolidate``.

Each module is one command's ``main(argv)`` (``bench_nvme`` holds the measurements behind
``infinity-bench nvme``); ``common`` gives them one-line errors, exit codes 2 (wrong input)
and 1 (failed work) and ``--debug`` ([Note: command-line errors]). What the room may touch: anything below it (config, plan,
checkpoint, tiers), never the engine of a running model; commands print tables and,
with ``--json``, write what they measured.
"""
