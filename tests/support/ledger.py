"""Each rank's sequence of collectives, compared across the ranks at the end of every distributed call.

[Note: the collective ledger]
NCCL matches collectives by their order alone: when one rank issues an all-reduce that another does not,
or two ranks issue same-sized collectives from different places, a multi-GPU run hangs or silently mixes
tensors, while gloo on one machine often happens to pass (every rank of a test runs the same timing). So
every rank process of the test pool records what it hands ``torch.distributed``: the operation, the
group's ranks, each tensor's dtype and element count, and the reduce op or root, with the line of the
caller (reported, not compared; object collectives record no sizes, which may differ). At the end of a
call the parent compares the ranks' sequences (tests/support/ranks.py) and fails the test on the first
entry that differs, naming it and the ranks. Collectives inside another (``all_gather_object`` issues
two) count once, as the outer one.

Like NCCL, the stand-in also refuses at the call a collective whose ranks disagree (another operation, reduce
op, root, dtype or element count: NCCL hangs or reads past a buffer, gloo aborts the process or returns): before
each collective every rank of its group all-reduces a fingerprint of the call (``CHECK_AT_CALL``), and when the
fingerprints differ every rank raises ``CollectiveMismatch`` naming each rank's call and caller, instead of
issuing it. The comparison at the end of the call stays: it also sees a rank that issued fewer collectives.

Every collective also runs under a short timeout (``COLLECTIVE_TIMEOUT_S``, not gloo's 30 minutes): a
rank left waiting in one raises an error naming the call, its place in the sequence and the caller, and
the comparison then names where the ranks parted.
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import sys
import threading
import zlib

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = float(os.environ.get("INFINITY_TEST_COLLECTIVE_TIMEOUT", "180"))
_timeout_s = [COLLECTIVE_TIMEOUT_S]
# INFINITY_TEST_CHECK_COLLECTIVES=0 turns the check at the call off (the end-of-call comparison stays).
CHECK_AT_CALL = os.environ.get("INFINITY_TEST_CHECK_COLLECTIVES", "1") != "0"


class CollectiveMismatch(RuntimeError):
    """The ranks of a group called one collective with different operations, dtypes or element counts."""


def timeout(seconds: float | None = None) -> datetime.timedelta:
    """The process group's timeout for a call: ``seconds``, or ``COLLECTIVE_TIMEOUT_S``."""
    _timeout_s[0] = COLLECTIVE_TIMEOUT_S if seconds is None else seconds
    return datetime.timedelta(seconds=_timeout_s[0])

_NAMES = ("all_reduce", "broadcast", "barrier", "all_gather_into_tensor", "all_gather_single",
          "reduce_scatter_tensor", "reduce_scatter_single", "all_gather", "reduce_scatter", "reduce", "gather",
          "scatter", "all_to_all_single", "all_to_all", "all_reduce_coalesced", "monitored_barrier",
          "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "new_group")
_OBJECTS = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"}
# Tensor arguments that only the root passes (and NCCL sizes from the other argument): not compared.
_ROOT_ONLY = ("gather_list", "scatter_list")
# Not checked at the call: ``new_group`` is not a collective of a group yet, ``monitored_barrier`` names its own,
# an all-to-all's sizes may differ by rank (uneven splits).
_UNCHECKED = {"new_group", "monitored_barrier", "all_to_all", "all_to_all_single"}
# The caller named is the first frame outside torch.distributed, this file, contextlib (a ``with`` block's
# exit) and the engine's thin wrapper.
_SKIP = (os.path.dirname(dist.__file__), os.path.abspath(__file__), contextlib.__file__,
         os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "infinity",
                      "runtime", "ranks.py"))

_entries: list = []
_lock = threading.Lock()
_depth = threading.local()
_installed = [False]


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _group(bound: dict):
    group = bound.get("group")
    if group is None or group is dist.group.WORLD:     # the same group, named either way
        return "default"
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:
        return repr(group)


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


def _wrap(name: str, fn):
    signature = inspect.signature(fn)

    def recorded(*args, **kwargs):
        if getattr(_depth, "n", 0):
            return fn(*args, **kwargs)
        try:
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            bound = call.arguments
        except TypeError:
            return fn(*args, **kwargs)     # torch says what is wrong
        sizes = () if name in _OBJECTS else tuple(
            (str(t.dtype).replace("torch.", ""), t.numel())
            for key in ("tensor", "output_tensor", "input_tensor", "output", "input", "tensor_list",
                        "output_tensor_list", "input_tensor_list", "tensors")
            for t in _tensors(bound.get(key)))
        if name == "new_group":        # every process of the default group takes part
            what = (f"new_group[ranks={list(bound.get('ranks') or [])}]", "default", ())
        else:
            extra = tuple(f"{k}={str(bound[k]).replace('RedOpType.', '')}" for k in ("op", "src", "dst", "group_src", "group_dst")
                          if bound.get(k) is not None)
            what = (name + (f"[{', '.join(extra)}]" if extra else ""), _group(bound), sizes)
        with _lock:
            index = len(_entries)
            _entries.append((what, _site()))
        _depth.n = 1
        try:
            # An async collective is not made a rendezvous (the check would block where it must not).
            if CHECK_AT_CALL and name not in _UNCHECKED and not bound.get("async_op"):
                _agree(what, index, bound.get("group"))
            return fn(*args, **kwargs)
        except CollectiveMismatch:
            raise
        except Exception as exc:
            try:
                named = type(exc)(f"rank {dist.get_rank()}: collective #{index} {describe(what)}, called from "
                                  f"{_entries[index][1]}, failed or waited past {_timeout_s[0]:g} s "
                                  f"(INFINITY_TEST_COLLECTIVE_TIMEOUT): {exc}")
            except Exception:
                raise exc from None
            raise named from exc
        finally:
            _depth.n = 0

    recorded.__wrapped__ = fn
    return recorded


def _agree(what, index: int, group) -> None:
    """Refuse, on every rank of ``group`` together, a collective that its ranks describe differently.

    Runs inside the wrapper (``_depth`` is set), so its own collectives are neither recorded nor checked."""
    if group is not None and group is not dist.group.WORLD and dist.get_rank(group) < 0:
        return      # not a member: torch's collective returns at once there
    if dist.get_backend(group) != "gloo":       # NCCL itself (a GPU run) refuses what it refuses
        return
    mark = zlib.crc32(describe(what).encode())
    marks = torch.tensor([mark, -mark], dtype=torch.int64)
    dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=group)
    if int(marks[0]) == mark and int(marks[1]) == -mark:
        return
    calls = [None] * dist.get_world_size(group)         # every rank saw the difference: all take part
    dist.all_gather_object(calls, (dist.get_rank(), describe(what), _entries[index][1]), group=group)
    lines = "\n".join(f"  rank {rank}: {said} at {site}" for rank, said, site in calls)
    raise CollectiveMismatch(f"rank {dist.get_rank()}: collective #{index} differs between the ranks (NCCL "
                             f"would hang or mix tensors; the stand-in refuses it):\n{lines}")


def install() -> None:
    """Record this process's collectives from now on (once per process)."""
    if _installed[0]:
        return
    for name in _NAMES:
        fn = getattr(dist, name, None)
        if fn is not None:
            setattr(dist, name, _wrap(name, fn))
    _installed[0] = True


def take() -> list:
    """The entries recorded since the last ``take`` (a call's), and forget them."""
    with _lock:
        out = list(_entries)
        _entries.clear()
    return out


def describe(what) -> str:
    name, group, sizes = what
    shown = ", ".join(f"{dtype} x{numel}" for dtype, numel in sizes) or "no tensors"
    return f"{name} ({shown}; group {group})"


def first_difference(ledgers: list) -> str | None:
    """Where the ranks' sequences part, in words; None when every rank issued the same collectives.

    Each group's collectives are compared among its members (``ledgers`` is in global rank order)."""
    groups = {entry[0][1] for ledger in ledgers for entry in ledger}
    for group in sorted(groups, key=str):
        members = range(len(ledgers)) if group == "default" else group
        if not isinstance(members, (range, tuple)):
            continue
        found = _first_difference({rank: [e for e in ledgers[rank] if e[0][1] == group] for rank in members})
        if found:
            return found
    return None


def _first_difference(ledgers: dict) -> str | None:
    longest = max((len(ledger) for ledger in ledgers.values()), default=0)
    for index in range(longest):
        seen = {rank: ledger[index] if index < len(ledger) else None for rank, ledger in ledgers.items()}
        if len({entry[0] if entry else None for entry in seen.values()}) > 1:
            group = next(entry[0][1] for entry in seen.values() if entry)
            lines = [f"collective #{index} of group {group} differs between the ranks (NCCL would hang or mix "
                     "tensors):"]
            for rank, entry in seen.items():
                if entry is None:
                    last = (f"; its last was #{len(ledgers[rank]) - 1} {describe(ledgers[rank][-1][0])} at "
                            f"{ledgers[rank][-1][1]}") if ledgers[rank] else ""
                    lines.append(f"  rank {rank}: issued only {len(ledgers[rank])} collectives{last}")
                else:
                    lines.append(f"  rank {rank}: {describe(entry[0])} at {entry[1]}")
            return "\n".join(lines)
    return None
