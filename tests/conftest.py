"""Shared test set-up: the tests folder is importable (tests.support.*) in spawned ranks too.

Tests feed CPU tensors, so the engines they build compute on the CPU on every machine, a GPU
machine included: ``INFINITY_DEVICE=cpu`` resolves ``tiers.device = "auto"`` (inherited by
spawned ranks and subprocesses). Tests of the GPU path (tests/gpu) set ``tiers.device = "cuda"``.
"""
import gc
import os
import sys
import zlib

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


# [Note: a GPU's timing in every test]
# On the CPU a data-path copy would finish before its call returns, so code that reads a copy's destination
# before its event, or reuses its source too early, would pass every test and fail on a GPU. Every test runs
# with the data path's copies held late (``INFINITY_LATE_COPIES``, [Note: late copies] in
# infinity/runtime/datapath.py), rank processes and subprocesses included. How late varies by test: the
# number of polls a held copy answers "not done" is drawn from the test's name and ``INFINITY_TEST_SEED``
# (default 0; the summary line names it, so a failure reruns the same way; ``INFINITY_TEST_POLLS=k`` gives every
# test the count k). A test opts out only with
# ``@pytest.mark.copies_at_once(reason=...)``. The summary counts the copies held late in the whole run.
_POLLS = (0, 1, 2, 3, 1000)
_SEED = os.environ.get("INFINITY_TEST_SEED", "0")
_tally = {"held": 0, "tests": 0, "at_once": []}


_FORCED = os.environ.get("INFINITY_TEST_POLLS")     # one count for every test (a failure's rerun, a sweep)


def late_polls_for(nodeid: str) -> int:
    """The number of polls a held copy answers "not done" in test ``nodeid``."""
    if _FORCED is not None:
        return int(_FORCED)
    return _POLLS[zlib.crc32(f"{_SEED}:{nodeid}".encode()) % len(_POLLS)]


@pytest.fixture(autouse=True)
def _copies_as_late_as_a_gpu_runs_them(request):
    from infinity.runtime.datapath import LATE_COPIES_ENV
    from infinity.runtime.datapath import held_late_copies

    marker = request.node.get_closest_marker("copies_at_once")
    before = os.environ.get(LATE_COPIES_ENV)
    if marker is not None:
        reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
        if not reason:
            pytest.fail("@pytest.mark.copies_at_once needs reason=...: why this test cannot run with a GPU's "
                        "timing", pytrace=False)
        os.environ.pop(LATE_COPIES_ENV, None)
        _tally["at_once"].append(request.node.nodeid)
    else:
        os.environ[LATE_COPIES_ENV] = str(late_polls_for(request.node.nodeid))
    ranks = sys.modules.get("tests.support.ranks")
    held = held_late_copies() + (ranks.held_late_copies() if ranks is not None else 0)
    try:
        yield
    finally:
        ranks = sys.modules.get("tests.support.ranks")
        _tally["held"] += held_late_copies() + (ranks.held_late_copies() if ranks is not None else 0) - held
        _tally["tests"] += 1
        if before is None:
            os.environ.pop(LATE_COPIES_ENV, None)
        else:
            os.environ[LATE_COPIES_ENV] = before


def pytest_terminal_summary(terminalreporter):
    if not _tally["tests"]:
        return
    terminalreporter.write_line(
        f"late copies: {_tally['held']:,} data-path copies held as a GPU's copy streams may hold them, over "
        f"{_tally['tests']} tests (INFINITY_TEST_SEED={_SEED}); {len(_tally['at_once'])} ran with copies at once"
        + "".join(f"\n  copies at once: {nodeid}" for nodeid in _tally["at_once"]))
    ranks = sys.modules.get("tests.support.ranks")
    if ranks is not None and ranks.collectives_compared()[1]:
        issued, calls = ranks.collectives_compared()
        checked = "checked across the ranks at each call and " if ledger_checks_at_call() else ""
        terminalreporter.write_line(f"collectives: {issued:,} issued by the ranks of {calls:,} distributed calls, "
                                    f"{checked}compared at the end of each ([Note: the collective ledger])")


def ledger_checks_at_call() -> bool:
    from tests.support import ledger

    return ledger.CHECK_AT_CALL


def pytest_sessionfinish(session, exitstatus):
    # The kept rank processes leave through the interpreter's teardown, as spawned ranks did after each call
    # (see [Note: a pool of rank processes] in tests/support/ranks.py): an abort there fails the run.
    ranks = sys.modules.get("tests.support.ranks")
    failed = ranks.close_pools() if ranks is not None else []
    if failed:
        sys.stderr.write("rank processes that did not exit normally: " + "; ".join(failed) + "\n")
        session.exitstatus = 1
