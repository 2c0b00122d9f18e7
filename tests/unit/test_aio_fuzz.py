"""A seeded random walk over the C I/O core's API: every crash, hang or wrong result names its seed.

Each case opens a handle with random settings (engine, block_size, queue_depth, threads) on two
regular files in a temporary directory, one buffered and one ``O_DIRECT``, and runs a random
sequence of submit (read or write, odd sizes, through the buffer protocol or a raw address with
its owner), wait, wait_any, wait_all, done, reap, release, drain and close, with injected errors
and stalls. A model of each file's bytes checks every read; the rules checked are the core's
contract: a wait with no limit returns True, a released or reaped id is dead (reap raises
KeyError, release does nothing), an id is never handed to two live requests, close neither hangs
nor reports a request that was not stuck, and no request is lost.

Cases run in batches, each in a fresh interpreter with a time limit, so a crash or a hang fails
the test with the seed and the operations of the case that did it (each is printed before it is
made). ``INFINITY_FUZZ_CASES`` sets the number of cases (default: a sample that takes a few seconds;
``make fuzz`` runs many more) and ``INFINITY_FUZZ_SEED`` the first seed.

Run one case by hand: ``python -m tests.unit.test_aio_fuzz ENGINE SEED 1 DIR``.
"""
from __future__ import annotations

import errno
import math
import mmap
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILE_NBYTES = 96 * 1024
CASES = int(os.environ.get("INFINITY_FUZZ_CASES", "120"))
FIRST_SEED = int(os.environ.get("INFINITY_FUZZ_SEED", "0"))
BATCH = 40                       # cases per interpreter
BATCH_TIMEOUT_S = 120.0          # far beyond a batch's time: only a hang reaches it
INJECTED = (errno.EIO, errno.ENOSPC)


class Case:
    """One random sequence against one handle, checked against a model of the files."""

    def __init__(self, engine: str, seed: int, folder: str) -> None:
        from tiers import _aio
        from tiers.aio_file import open_file

        self.aio, self.rng, self.seed = _aio, random.Random(seed), seed
        rng = self.rng
        self.block = rng.choice((4096, 8192, 65536))
        self.core = _aio.Handle(engine, rng.choice((1, 2, 4, 32)), rng.choice((1, 2, 3)), self.block)
        self.engine = engine
        self.files, self.model, self.known = [], [], []
        for direct in (False, True):
            path = os.path.join(folder, f"case{seed}-{int(direct)}.bin")
            with open(path, "wb") as f:
                f.write(random.Random(seed).randbytes(FILE_NBYTES))
            self.files.append(open_file(path, "rw", direct=direct))
            self.model.append(bytearray(Path(path).read_bytes()))
            self.known.append(bytearray(b"\1") * FILE_NBYTES)
        self.live: dict[int, tuple] = {}        # id -> (op, file, offset, nbytes, buffer, data written)
        self.released: list[tuple] = []         # requests released in flight: landed by the next wait_all
        self.dead: list[int] = []               # reaped or released ids
        self.faulted = False                    # an error was injected: any later piece may fail with it
        self.closing = False                    # drain or close began: cancels allowed
        self.closed = False

    # -- helpers ------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(f"  {text}", flush=True)

    def busy(self, index: int, offset: int, nbytes: int) -> bool:
        """Whether [offset, offset + nbytes) of file ``index`` overlaps a request not yet settled."""
        for op, f, off, n, *_ in list(self.live.values()) + self.released:
            if f == index and off < offset + nbytes and offset < off + n:
                return True
        return False

    def forget(self, index: int, offset: int, nbytes: int) -> None:
        self.known[index][offset:offset + nbytes] = bytes(nbytes)

    def buffer(self, nbytes: int, direct: bool):
        """A writable buffer of nbytes: page-aligned memory for O_DIRECT, a bytearray otherwise."""
        if direct or self.rng.random() < 0.3:
            return mmap.mmap(-1, max(nbytes, 1))
        return bytearray(nbytes)

    # -- operations ---------------------------------------------------------------------------
    def submit(self) -> None:
        rng, aio = self.rng, self.aio
        index = rng.randrange(2)
        direct = self.files[index].direct
        op = rng.choice((aio.OP_READ, aio.OP_WRITE))
        if direct:
            nbytes = 4096 * rng.choice((0, 1, 1, 2, 3, 5, 8))
            offset = 4096 * rng.randrange(FILE_NBYTES // 4096)
        else:
            nbytes = rng.choice((0, 1, 100, 4095, 4096, 4097, 12289, rng.randrange(1, 40000)))
            offset = rng.randrange(FILE_NBYTES)
        past_end = offset + nbytes > FILE_NBYTES
        if past_end and (op == aio.OP_WRITE or rng.random() < 0.5):
            offset = max(0, FILE_NBYTES - nbytes)
            past_end = offset + nbytes > FILE_NBYTES
        if self.busy(index, offset, nbytes):
            return self.say(f"(skip: [{offset}, {offset + nbytes}) of file {index} is busy)")
        buf = self.buffer(nbytes, direct)
        data = bytes(rng.randbytes(nbytes)) if op == aio.OP_WRITE else None
        if data is not None:
            buf[:nbytes] = data
        raw = rng.random() < 0.5
        self.say(f"submit{'_ptr' if raw else ''}({'read' if op == aio.OP_READ else 'write'}, file {index}, "
                 f"offset {offset}, {nbytes} bytes)")
        view = memoryview(buf)[:nbytes]
        try:
            if raw:
                address = aio.buffer_info(buf, True)[0] if nbytes else 0
                rid = self.core.submit_ptr(op, self.files[index].fd, offset, address, nbytes, buf)
            else:
                rid = self.core.submit(op, self.files[index].fd, offset, view)
        except ValueError as e:
            assert self.closing and "closed aio handle" in str(e), e
            return self.say("  -> refused: closing")
        assert rid not in self.live, f"id {rid} handed to two live requests"
        self.live[rid] = (op, index, offset, nbytes, buf, data, past_end)

    def bad_span(self) -> None:
        owner = bytearray(4096)
        address = self.aio.buffer_info(owner, True)[0]
        nbytes, address = self.rng.choice(((8192, address), (4096, address + 1), (4096, 8), (4096, 2**64 - 2048)))
        self.say(f"submit_ptr(bad span: {nbytes} bytes at {address:#x})")
        try:
            self.core.submit_ptr(self.aio.OP_WRITE, self.files[0].fd, 0, address, nbytes, owner)
        except ValueError as e:
            assert "submit_ptr" in str(e) or "closed aio handle" in str(e), e
        else:
            raise AssertionError("a span outside its owner was accepted")

    def settle(self, rid: int, result: int, err_offset: int) -> None:
        """Check a reaped outcome against the model."""
        op, index, offset, nbytes, buf, data, past_end = self.live.pop(rid)
        self.dead.append(rid)
        if result < 0:
            err = -result
            allowed = {errno.ECANCELED, errno.EINTR} if self.closing else set()
            if self.faulted:
                allowed |= set(INJECTED)
            if past_end:
                allowed.add(errno.ENODATA)
            assert err in allowed, f"{os.strerror(err)} for {rid}; expected one of {sorted(allowed)}"
            if op == self.aio.OP_WRITE:
                self.forget(index, offset, nbytes)
            return
        assert not past_end, f"a read past the end of the file reported {result} bytes"
        assert result == nbytes, f"{result} bytes moved of {nbytes}"
        if op == self.aio.OP_WRITE:
            self.model[index][offset:offset + nbytes] = data
            self.known[index][offset:offset + nbytes] = b"\1" * nbytes
        else:
            got, want, known = bytes(buf[:nbytes]), self.model[index][offset:offset + nbytes], \
                self.known[index][offset:offset + nbytes]
            bad = [k for k in range(nbytes) if known[k] and got[k] != want[k]]
            assert not bad, f"read of file {index} at {offset}: byte {offset + bad[0]} is {got[bad[0]]}, " \
                            f"the model says {want[bad[0]]}"

    def reap(self) -> None:
        if not self.live:
            return
        rid = self.rng.choice(list(self.live))
        self.say(f"reap({rid})")
        try:
            result, err_offset = self.core.reap(rid)
        except RuntimeError as e:
            return self.say(f"  -> {e}")
        self.settle(rid, result, err_offset)

    def reap_dead(self) -> None:
        if not self.dead:
            return
        rid = self.rng.choice(self.dead)
        self.say(f"reap(dead {rid})")
        try:
            self.core.reap(rid)
        except KeyError:
            return
        except ValueError:
            assert self.closed
            return
        raise AssertionError(f"a reaped or released id {rid} was reaped again")

    def release(self) -> None:
        if self.live and self.rng.random() < 0.8:
            rid = self.rng.choice(list(self.live))
            self.say(f"release({rid})")
            self.core.release(rid)
            entry = self.live.pop(rid)
            self.released.append(entry)
            self.dead.append(rid)
        elif self.dead:
            rid = self.rng.choice(self.dead)
            self.say(f"release(dead {rid})")
            assert self.core.release(rid) is None

    def wait(self) -> None:
        if not self.live:
            return
        rid = self.rng.choice(list(self.live))
        timeout = self.rng.choice((0.0, 0.001, 0.01, -1.0, math.inf, 1e10, 1e300))
        self.say(f"wait({rid}, {timeout})")
        done = self.core.wait(rid, timeout)
        assert done or 0 <= timeout <= 1, f"wait with no limit returned {done}"
        if done:
            assert self.core.done(rid)
            result, err_offset = self.core.reap(rid)
            self.settle(rid, result, err_offset)

    def wait_any(self) -> None:
        if not self.live:
            return
        ids = self.rng.sample(list(self.live), self.rng.randint(1, len(self.live)))
        timeout = self.rng.choice((0.0, 0.005, -1.0, math.inf))
        self.say(f"wait_any({ids}, {timeout})")
        got = self.core.wait_any(ids, timeout)
        assert got in ids or (got is None and 0 <= timeout <= 1), f"wait_any returned {got}"
        if got is not None:
            assert self.core.done(got)

    def wait_all(self) -> None:
        timeout = self.rng.choice((0.0, 0.01, -1.0, math.inf))
        self.say(f"wait_all({timeout})")
        done = self.core.wait_all(timeout)
        assert done or 0 <= timeout <= 1, "wait_all with no limit returned False"
        if done:
            assert self.core.active == 0 and all(self.core.done(rid) for rid in self.live)
            self.land_released()

    def land_released(self) -> None:
        """Released writes have completed: what they wrote is known unless a fault or cancel may have hit them."""
        for op, index, offset, nbytes, buf, data, past_end in self.released:
            if op == self.aio.OP_WRITE:
                if self.faulted or self.closing:
                    self.forget(index, offset, nbytes)
                else:
                    self.model[index][offset:offset + nbytes] = data
        self.released.clear()

    def fault(self) -> None:
        op = self.rng.choice((-1, self.aio.OP_READ, self.aio.OP_WRITE))
        err, nth = self.rng.choice(INJECTED), self.rng.randint(1, 4)
        self.say(f"_inject({op}, {errno.errorcode[err]}, {nth})")
        try:
            self.core._inject(op, err, nth)
        except ValueError:
            assert self.closing
            return
        self.faulted = True

    def stall(self, seconds: float | None = None, nth: int | None = None) -> None:
        seconds = seconds or self.rng.choice((0.001, 0.02))
        nth = nth or self.rng.randint(1, 4)
        self.say(f"_stall(-1, {nth}, {seconds})")
        try:
            self.core._stall(-1, nth, seconds)
        except ValueError:
            assert self.closing

    def cancel_on_close(self) -> None:
        """A piece that would take 30 s, then close: io_uring cancels it in the kernel (the pool cannot)."""
        if self.engine != "io_uring":
            return
        self.stall(30.0, 1)
        self.submit()
        self.close()

    def drain(self) -> None:
        timeout = self.rng.choice((0.1, 0.3)) if self.engine == "io_uring" else 1.0
        self.say(f"drain({timeout})")
        self.closing = True
        left = self.core.drain(timeout)
        assert not left, f"drain left {left} in flight"
        assert self.core.active == 0
        self.land_released()

    def close(self) -> None:
        timeout = self.rng.choice((0.1, 0.3)) if self.engine == "io_uring" else 1.0
        self.say(f"close({timeout})")
        self.closing = True
        self.core.close(timeout)      # TimeoutError here: a request reported stuck that was not
        assert self.core.closed and self.core.active == 0
        self.closed = True
        for rid in list(self.live):   # outcomes are gone with the handle; the ids are dead
            assert self.core.wait(rid, -1.0) and self.core.done(rid)
            op, index, offset, nbytes, *_ = self.live.pop(rid)
            if op == self.aio.OP_WRITE:
                self.forget(index, offset, nbytes)
        self.land_released()

    # -- the walk -----------------------------------------------------------------------------
    def run(self, steps: int) -> None:
        ops = [(self.submit, 30), (self.wait, 12), (self.reap, 8), (self.wait_any, 6), (self.release, 8),
               (self.wait_all, 4), (self.reap_dead, 3), (self.fault, 2), (self.stall, 2), (self.bad_span, 1),
               (self.drain, 1), (self.close, 1), (self.cancel_on_close, 1)]
        funcs, weights = zip(*ops)
        for _ in range(steps):
            if self.closed:
                break
            self.rng.choices(funcs, weights)[0]()
        if not self.closed:
            self.say("wait_all(-1)")
            assert self.core.wait_all(-1.0)
            self.land_released()
            for rid in list(self.live):
                self.settle(rid, *self.core.reap(rid))
            self.close()
        for index, f in enumerate(self.files):
            on_disk = Path(f.path).read_bytes()
            bad = [k for k in range(FILE_NBYTES) if self.known[index][k] and on_disk[k] != self.model[index][k]]
            assert not bad, f"file {index}: byte {bad[0]} on disk is {on_disk[bad[0]]}, the model says " \
                            f"{self.model[index][bad[0]]}"
            f.close()


def run_batch(engine: str, first_seed: int, count: int, folder: str) -> None:
    """Runs cases first_seed .. first_seed + count - 1 (the child's side)."""
    for seed in range(first_seed, first_seed + count):
        print(f"case {seed} ({engine})", flush=True)
        case = Case(engine, seed, folder)
        print(f"  handle: block_size={case.block} queue_depth={case.core.queue_depth} threads={case.core.threads}",
              flush=True)
        case.run(case.rng.randint(5, 60))
    print("batch done", flush=True)


def _last_case(output: str) -> str:
    """The output of the last case begun: its seed, settings and operations."""
    start = output.rfind("case ")
    return output[start:][-6000:] if start >= 0 else output[-6000:]


def _batches(engine: str) -> list[tuple[int, int]]:
    per_engine = max(1, CASES // 2)
    return [(FIRST_SEED + first, min(BATCH, per_engine - first)) for first in range(0, per_engine, BATCH)]


def test_random_sequences_neither_crash_nor_hang_nor_lie(tmp_path) -> None:
    import pytest

    from tiers import _aio

    failures = []
    for engine in _aio.engines():
        for first, count in _batches(engine):
            command = [sys.executable, "-m", "tests.unit.test_aio_fuzz", engine, str(first), str(count), str(tmp_path)]
            try:
                done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=BATCH_TIMEOUT_S,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                failures.append(f"{engine}: hung for {BATCH_TIMEOUT_S} s in\n{_last_case(out)}")
                continue
            if done.returncode != 0 or not done.stdout.rstrip().endswith("batch done"):
                failures.append(f"{engine}: exit status {done.returncode} in\n{_last_case(done.stdout)}\n"
                                f"{done.stderr[-3000:]}")
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


if __name__ == "__main__":
    run_batch(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
