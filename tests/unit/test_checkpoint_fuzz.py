"""A checkpoint whose manifests were edited by anyone can only fail, clearly and at once.

Every JSON field of a saved checkpoint (COMMIT, the global manifest, a rank's manifest) is mutated in turn, as
an attacker or a broken copy would: another type, a sign, zero, an absurd size, a path that leaves the
directory, a key removed. The manifests' CRC-32s in COMMIT are recomputed (anyone can), so only validation
stands between the edit and the engine. Each edited checkpoint goes through ``load_checkpoint``,
``verify_checkpoint`` and ``infinity-consolidate``; each must either succeed (a harmless edit: a timestamp)
or raise a ``CheckpointError`` naming what is wrong: never another exception (a ``KeyError`` or
``ZeroDivisionError`` from deep inside, a ``MemoryError`` from a size nobody checked), never a hang, never a
file written outside the output. ``make test`` runs a seeded sample (``INFINITY_FUZZ_CASES``, default 120);
``make fuzz`` runs every case. The review's findings run every time (``_FOUND``).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import time
import zlib

import torch

import infinity
from infinity.checkpoint.consolidate import consolidate
from infinity.checkpoint.errors import CheckpointError
from tests.support.tiny_gpt import TinyGPT, trained_on_host

_CASES = int(os.environ.get("INFINITY_FUZZ_CASES", "80"))       # 0: every case
_SEED = int(os.environ.get("INFINITY_TEST_SEED", "0"))
_HANG_S = 20        # a case past this is a hang (a refusal takes milliseconds)
_MANIFESTS = ("COMMIT", "manifest.json", os.path.join("rank0", "manifest.json"))      # (a world of one rank)
_GONE = object()    # the mutation that removes a key
_RANK0 = os.path.join("rank0", "manifest.json")
# What the review found: a negative shard size looped forever in SavedLayout.locate, zero divided by
# zero, a buffer's shape of 2e9 over its bytes had consolidate write an 8 GB file, RNG states were applied
# unchecked, a world size of 1e9 built a billion paths; a key removed surfaced as a KeyError deep inside.
_FOUND = [("manifest.json", ("groups", 1, "shard_numel"), -1), ("manifest.json", ("groups", 1, "shard_numel"), 0),
          ("manifest.json", ("buffers", 0, "shape"), [2_000_000_000]), ("COMMIT", ("world_size",), 10 ** 9),
          (_RANK0, ("rng", "torch"), "AAAA"), (_RANK0, ("rng", "python", 1), [1, 2, 3]),
          (_RANK0, ("rng", "numpy", 2), 10 ** 6), ("manifest.json", ("groups", 3, "params"), _GONE),
          ("manifest.json", ("optimizer", "hyper", "params"), [1]), ("manifest.json", ("optimizer", "hyper", "lr"), "x"),
          ("manifest.json", ("layout", "group_starts", 2), -4)]


def _values_for(value):
    """What a field is changed into: another type, a sign, zero, an absurd size, a path outside."""
    if isinstance(value, bool):
        return ["yes", 2, None]
    if isinstance(value, int):
        return [-1, 0, 1 << 62, str(value), value + 0.5, None, True]
    if isinstance(value, float):
        return [-1.0, 1e308, "nan", None]
    if isinstance(value, str):
        return ["", "../../outside", "/etc/hostname", "x" * 5000, 7, None]
    if value is None:
        return [1, "x", []]
    if isinstance(value, list):
        return [[], {}, value[:1] * 3, "list"]
    return [[], {"x": 1}, "object"]


def _fields(data, path=()):
    """Every field worth mutating: each key of each object, the first, second and last items of lists."""
    if isinstance(data, dict):
        for key, value in data.items():
            yield path + (key,), value
            yield from _fields(value, path + (key,))
    elif isinstance(data, list):
        for index in sorted({0, 1, len(data) - 1} & set(range(len(data)))):
            yield path + (index,), data[index]
            yield from _fields(data[index], path + (index,))


def _all_cases(version: str) -> list:
    cases = []
    for rel in _MANIFESTS:
        with open(os.path.join(version, rel)) as f:
            data = json.load(f)
        for path, value in _fields(data):
            for new in _values_for(value) + ([_GONE] if isinstance(path[-1], str) else []):
                cases.append((rel, path, new))
    return cases


def _describe(case) -> str:
    rel, path, new = case
    shown = "(removed)" if new is _GONE else repr(new)[:40]
    return f"{rel}:{'/'.join(map(str, path))} = {shown}"


def _apply(root: str, case) -> None:
    """Edit the copy under ``root`` as an attacker would, the manifests' CRC-32s in COMMIT recomputed."""
    rel, path, new = case
    with open(os.path.join(root, rel)) as f:
        data = json.load(f)
    holder = data
    for key in path[:-1]:
        holder = holder[key]
    if new is _GONE:
        del holder[path[-1]]
    else:
        holder[path[-1]] = new
    raw = (json.dumps(data) + "\n").encode()
    with open(os.path.join(root, rel), "wb") as f:
        f.write(raw)
    commit_path = os.path.join(root, "COMMIT")
    with open(commit_path) as f:
        commit = json.load(f)
    manifests = commit.get("manifests") if isinstance(commit, dict) else None
    if rel != "COMMIT" and isinstance(manifests, dict) and rel in manifests:
        manifests[rel] = zlib.crc32(raw)
        with open(commit_path, "w") as f:
            json.dump(commit, f)


@contextlib.contextmanager
def _deadline(what: str):
    def expired(signum, frame):
        raise TimeoutError(f"{what}: still running after {_HANG_S} s (a hang)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(_HANG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _trained():
    class WithBuffer(TinyGPT):      # a buffer, so the buffers' manifest fields are there to mutate
        def __init__(self):
            super().__init__()
            self.register_buffer("offsets", torch.arange(6, dtype=torch.float32).reshape(2, 3))

    torch.manual_seed(0)
    return trained_on_host(WithBuffer)


def test_every_manifest_field_mutated_fails_clearly_or_loads(tmp_path):
    model, opt = _trained()
    saved = infinity.save_checkpoint(tmp_path / "ckpt", model, opt, extra={"epoch": 1})
    cases = _all_cases(saved)
    total = len(cases)
    if _CASES:
        cases = random.Random(_SEED).sample(cases, min(_CASES, total))
    cases = _FOUND + cases
    outside = tmp_path / "outside"
    outside.mkdir()
    work = tmp_path / "work"
    slowest, refused, loaded, wrong = (0.0, ""), 0, 0, []
    for case in cases:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(tmp_path / "ckpt", work, symlinks=True)
        version = os.path.join(work, os.path.basename(saved))
        _apply(version, case)
        out = tmp_path / "out" / "model.pt"
        shutil.rmtree(out.parent, ignore_errors=True)
        out.parent.mkdir()
        for name, call in (("load_checkpoint", lambda: infinity.load_checkpoint(version, model, opt)),
                           ("verify_checkpoint", lambda: infinity.checkpoint.verify_checkpoint(version)),
                           ("consolidate", lambda: consolidate(version, out))):
            started = time.perf_counter()
            try:
                with _deadline(f"{name} of {_describe(case)}"):
                    call()
                loaded += 1
            except CheckpointError as exc:
                refused += 1
                if "found" in str(exc):
                    wrong.append(f"{name} of {_describe(case)}: the message echoes bytes found: {exc}")
            except Exception as exc:  # noqa: BLE001 - any other exception is the finding
                wrong.append(f"{name} of {_describe(case)}: {type(exc).__name__}: {str(exc)[:300]}")
            took = time.perf_counter() - started
            if took > slowest[0]:
                slowest = (took, f"{name} of {_describe(case)}")
        leftovers = sorted(os.listdir(out.parent))
        if leftovers not in ([], ["model.pt"]) or os.listdir(outside):
            wrong.append(f"{_describe(case)}: files written outside the output: {leftovers}")
    print(f"\ncheckpoint fuzz: {len(cases)} of {total} cases (seed {_SEED}), {refused} refusals, {loaded} loads; "
          f"slowest {slowest[0] * 1e3:.0f} ms ({slowest[1]})")
    infinity.release(model)
    assert not wrong, f"{len(wrong)} of {len(cases)} mutated checkpoints failed badly:\n" + "\n".join(wrong[:40])
