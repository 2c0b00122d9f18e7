"""Shared test set-up: the tests folder is importable (tests.support.*) in spawned ranks too.

Tests feed CPU tensors, so the engines they build compute on the CPU on every machine, a GPU
machine included: ``INFINITY_DEVICE=cpu`` resolves ``tiers.device = "auto"`` (inherited by
spawned ranks and subprocesses). Tests of the GPU path (tests/gpu) set ``tiers.device = "cuda"``.
"""
import gc
import os
import sys

import psutil
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

os.environ["INFINITY_DEVICE"] = "cpu"


# [Note: memory between tests]
# An engine holds its host buffers (pools, arenas, flat sub-group states: ~0.5 GiB for the defaults) until it
# is collected, and a model with its engine is a reference cycle, so it waits for the garbage collector's
# oldest generation, which runs rarely: without help the suite's process held up to 35 dead engines at once
# (16.8 GB). After a test whose process grew by more than _COLLECT_ABOVE since the last collection, the
# garbage is collected and the C heap trimmed, so a test starts with the buffers of the earlier ones given
# back. A collection after every test would add about four minutes (0.18 s each, with transformers loaded).
_COLLECT_ABOVE = 384 << 20
_PROCESS = psutil.Process()
_resident_after_collection = [_PROCESS.memory_info().rss]


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield       # the test's fixtures are torn down first (tmp_path's files, monkeypatches)
    if _PROCESS.memory_info().rss > _resident_after_collection[0] + _COLLECT_ABOVE:
        gc.collect()
        from tiers.host_alloc import trim_c_heap

        trim_c_heap()
        _resident_after_collection[0] = _PROCESS.memory_info().rss


def pytest_sessionfinish(session, exitstatus):
    # The kept rank processes leave through the interpreter's teardown, as spawned ranks did after each call
    # (see [Note: a pool of rank processes] in tests/support/ranks.py): an abort there fails the run.
    ranks = sys.modules.get("tests.support.ranks")
    failed = ranks.close_pools() if ranks is not None else []
    if failed:
        sys.stderr.write("rank processes that did not exit normally: " + "; ".join(failed) + "\n")
        session.exitstatus = 1
