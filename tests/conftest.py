"""Shared test set-up: the tests folder is importable (tests.support.*) in spawned ranks too.

Tests feed CPU tensors, so the engines they build compute on the CPU on every machine, a GPU
machine included: ``INFINITY_DEVICE=cpu`` resolves ``tiers.device = "auto"`` (inherited by
spawned ranks and subprocesses). Tests of the GPU path (tests/gpu) set ``tiers.device = "cuda"``.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

os.environ["INFINITY_DEVICE"] = "cpu"


def pytest_sessionfinish(session, exitstatus):
    # The kept rank processes leave through the interpreter's teardown, as spawned ranks did after each call
    # (see [Note: a pool of rank processes] in tests/support/ranks.py): an abort there fails the run.
    ranks = sys.modules.get("tests.support.ranks")
    failed = ranks.close_pools() if ranks is not None else []
    if failed:
        sys.stderr.write("rank processes that did not exit normally: " + "; ".join(failed) + "\n")
        session.exitstatus = 1
