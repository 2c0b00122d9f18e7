"""Run a function on N gloo ranks and collect what each returns.

[Note: a pool of rank processes]
Spawning N interpreters that import torch and infinity cost 4.5 s for two ranks and 10 s for four on
the CI's two cores, about 45 times a suite run. So the rank processes are kept: one pool per world
size, spawned at its first use and kept to the session's end. Each call gets a group of its own (a new
file store in the call's directory), runs, destroys the group, and what it left in the process is undone
before the next call (environment, warnings shown once, torch.compile's caches, accelerate's singletons,
the garbage: the engines it built close their tiers). A rank that dies fails its call, and the pool is spawned
again for the next. ``fresh=True`` spawns processes for one call, for a test about what a process
holds at its exit. At the session's end (tests/conftest.py) the pools' processes leave through the
interpreter's teardown, as a fresh rank does after its call; an abort there fails the session. Under
pytest-xdist every call spawns its ranks (many workers would each keep idle pools).
"""
import faulthandler
import gc
import itertools
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support import ledger

_POOLS: dict = {}          # world size -> _Pool
_CALLS = itertools.count()
_FAILED_EXITS: list = []   # "world W rank R: exit status S" of pool processes that left badly
# Under pytest-xdist (the GPU machine's runs: 14 workers) every worker would keep pools of its own, up to seven
# idle interpreters each; there the cores are many and spawning is cheap, so each call spawns.
_UNDER_XDIST = "PYTEST_XDIST_WORKER" in os.environ
_HELD_LATE = [0]           # data-path copies the ranks held late, over every call
_COLLECTIVES = [0, 0]      # collectives the ranks issued (each rank's own counted once), calls with a group
# A call's whole time, a backstop for a rank stuck outside collectives (a lock, a thread that never
# ends); a rank waiting in a collective fails sooner ([Note: the collective ledger]).
CALL_TIMEOUT_S = float(os.environ.get("INFINITY_TEST_CALL_TIMEOUT", "900"))


def held_late_copies() -> int:
    """How many data-path copies the rank processes held late so far (see [Note: late copies])."""
    return _HELD_LATE[0]


def collectives_compared() -> tuple[int, int]:
    """(collectives issued on the ranks, calls with a process group) so far: every one of them was checked
    across the ranks at the call and compared at the end ([Note: the collective ledger])."""
    return _COLLECTIVES[0], _COLLECTIVES[1]


def _late_copies() -> str | None:
    """This process's ``INFINITY_LATE_COPIES``, for the ranks of the call."""
    from infinity.runtime.datapath import LATE_COPIES_ENV

    return os.environ.get(LATE_COPIES_ENV)


def _call(rank: int, world_size: int, fn, workdir: str, args, store: str | None, late: str | None = None,
          timeout_s: float | None = None):
    """Run ``fn`` on this rank: (status, its value or the traceback, data-path copies it held late, the
    collectives it issued: [Note: the collective ledger] in tests/support/ledger.py, whose timeout
    ``timeout_s`` replaces).

    ``late`` is the calling test's ``INFINITY_LATE_COPIES`` (a kept process was spawned for an earlier test);
    see [Note: a GPU's timing in every test] in tests/conftest.py."""
    from infinity.runtime.datapath import LATE_COPIES_ENV
    from infinity.runtime.datapath import held_late_copies

    if late is None:
        os.environ.pop(LATE_COPIES_ENV, None)
    else:
        os.environ[LATE_COPIES_ENV] = late
    held = held_late_copies()
    torch.set_num_threads(1)
    if store is not None:
        ledger.install()
        ledger.take()
        dist.init_process_group("gloo", init_method=f"file://{workdir}/{store}", rank=rank,
                                world_size=world_size, timeout=ledger.timeout(timeout_s))
    try:
        value = fn(rank, world_size, workdir, *args)
        return ("ok", value, held_late_copies() - held, ledger.take())
    except BaseException:  # report to the parent with the rank's traceback
        return ("error", traceback.format_exc(), held_late_copies() - held, ledger.take())
    finally:
        if store is not None:
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _prepare() -> None:
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)     # a call past its deadline shows where it is
    faulthandler.enable(all_threads=True)   # gloo aborts on collectives that do not match: say where it was
    # Before the group, as a script would: see [Note: torch._dynamo and the default process group].
    from infinity import Init  # noqa: F401


def _entry(rank: int, fn, world_size: int, workdir: str, args, group: bool, timeout_s: float | None) -> None:
    _prepare()
    result = _call(rank, world_size, fn, workdir, args, "store" if group else None, _late_copies(), timeout_s)
    with open(os.path.join(workdir, f"result{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _serve(rank: int, world_size: int, conn) -> None:
    """A pool process: run the calls the parent sends until it sends None (or goes)."""
    _prepare()
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        env = dict(os.environ)
        with warnings.catch_warnings():     # its exit also forgets which warnings were shown once
            result = _call(rank, world_size, *job)
        del job
        _forget_the_call(env)
        try:
            conn.send(result)
        except Exception:              # a result that does not pickle
            conn.send(("error", traceback.format_exc(), result[2], result[3]))


def _forget_the_call(env: dict) -> None:
    """Undo what a call leaves in its process that a freshly spawned rank would not have."""
    os.environ.clear()
    os.environ.update(env)
    torch._dynamo.reset()               # a compiled call's caches and recompile counts
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    state = sys.modules.get("accelerate.state")
    if state is not None:               # its singletons keep the distributed type the first call found
        state.AcceleratorState._reset_state(reset_partial_state=True)
    gc.collect()                        # the call's engines close their tiers


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.conns, self.procs = [], []
        for rank in range(world_size):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world_size, there), name=f"rank{rank}of{world_size}")
            proc.start()
            there.close()
            self.conns.append(here)
            self.procs.append(proc)

    def run(self, fn, workdir: str, args, group: bool, timeout_s: float | None) -> list:
        store = f"store{next(_CALLS)}" if group else None
        for conn in self.conns:
            conn.send((fn, workdir, args, store, _late_copies(), timeout_s))
        results: dict = {}
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while pending:
            ready = wait(list(pending.values()) + [p.sentinel for p in self.procs],
                         timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                for rank in pending:
                    os.kill(self.procs[rank].pid, signal.SIGUSR1)      # each thread's stack, to stderr
                time.sleep(2.0)
                self.kill()
                raise AssertionError(
                    f"{fn.__qualname__} on {self.world_size} ranks: rank(s) {sorted(pending)} did not finish within "
                    f"{CALL_TIMEOUT_S:g} s (INFINITY_TEST_CALL_TIMEOUT), outside any collective's timeout; their "
                    "threads' stacks are in the captured stderr above")
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        results[rank] = conn.recv()
                    except EOFError:
                        continue    # its process went: its sentinel says so
                    del pending[rank]
            dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
            if dead:
                self.kill()
                raise AssertionError(f"rank {dead[0]} of {self.world_size} died (exit status "
                                     f"{self.procs[dead[0]].exitcode}) in {fn.__qualname__}")
        return [results[r] for r in range(self.world_size)]

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.join()
        _POOLS.pop(self.world_size, None)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for rank, proc in enumerate(self.procs):
            proc.join(60)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
            if proc.exitcode != 0:
                _FAILED_EXITS.append(f"world {self.world_size} rank {rank}: exit status {proc.exitcode}")


def close_pools() -> list:
    """End every pool's processes; returns what left other than normally (see [Note: a pool of rank processes])."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()
    return list(_FAILED_EXITS)


def run_ranks(fn, world_size: int, workdir, *args, fresh: bool = False, group: bool = True,
              collective_timeout: float | None = None):
    """Run ``fn(rank, world_size, workdir, *args)`` on ``world_size`` gloo ranks; returns the results.

    The ranks are a kept pool of processes (see [Note: a pool of rank processes]); ``fresh=True``
    spawns new ones for this call, which must then exit normally, through the interpreter's teardown.
    ``group=False`` makes no process group: independent work shared over processes (an engine built
    there is one rank's own). The ranks' collectives are compared at the end ([Note: the collective
    ledger] in tests/support/ledger.py); ``collective_timeout`` (seconds) replaces its timeout.
    """
    workdir = str(workdir)
    os.makedirs(workdir, exist_ok=True)
    if fresh or _UNDER_XDIST:
        mp.start_processes(_entry, args=(fn, world_size, workdir, args, group, collective_timeout),
                           nprocs=world_size, start_method="spawn", join=True)
        results = []
        for r in range(world_size):
            with open(os.path.join(workdir, f"result{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    else:
        pool = _POOLS.get(world_size)
        if pool is None:
            pool = _POOLS[world_size] = _Pool(world_size)
        results = pool.run(fn, workdir, args, group, collective_timeout)
    values = []
    _HELD_LATE[0] += sum(held for _, _, held, _ in results)
    parted = ledger.first_difference([calls for _, _, _, calls in results]) if group else None
    if group:
        _COLLECTIVES[0] += sum(len(calls) for _, _, _, calls in results)
        _COLLECTIVES[1] += 1
    for r, (status, value, _, _) in enumerate(results):
        if status != "ok":
            raise AssertionError(f"rank {r} failed:\n{value}" + (f"\n{parted}" if parted else ""))
        values.append(value)
    if parted:
        raise AssertionError(f"{fn.__qualname__} on {world_size} ranks: {parted}")
    return values


def step_beside(run, opt, ref, ref_opt, x, y, rank: int, world: int, local: int, clip: float | None = None):
    """One step of ``run`` (this rank's ``local`` rows of the global batch ``x``, ``y``) and one of the plain
    ``ref`` on the whole batch, each with its optimizer and, with ``clip``, ``clip_grad_norm_`` first.

    Returns (the ranks' mean loss, the reference's loss, the two gradient norms before clipping or None)."""
    def one(net, xs, ys, o):
        loss = net(xs, ys)
        loss.backward()
        norm = None if clip is None else float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip))
        o.step()
        o.zero_grad()
        return loss.detach().clone(), norm

    lo = rank * local
    loss, norm = one(run, x[lo:lo + local], y[lo:lo + local], opt)
    dist.all_reduce(loss)
    ref_loss, ref_norm = one(ref, x, y, ref_opt)
    return loss.item() / world, ref_loss.item(), norm, ref_norm
