"""Run a function on N spawned gloo ranks and collect what each returns."""
import os
import pickle
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world_size: int, workdir: str, args, hard_exit: bool = False) -> None:
    torch.set_num_threads(1)
    # Before the group, as a script would: see [Note: torch._dynamo and the default process group].
    from infinity import Init  # noqa: F401

    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size)
    out = os.path.join(workdir, f"result{rank}.pkl")
    try:
        result = ("ok", fn(rank, world_size, workdir, *args))
    except BaseException:  # report to the parent with the rank's traceback
        result = ("error", traceback.format_exc())
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    with open(out, "wb") as f:
        pickle.dump(result, f)
    if hard_exit:
        # The result is on disk: skip the interpreter's teardown (see run_ranks).
        os._exit(0)


def run_ranks(fn, world_size: int, workdir, *args, hard_exit: bool = False):
    """Spawn ``world_size`` ranks running ``fn(rank, world_size, workdir, *args)``; returns the results.

    ``hard_exit``: each rank ends with ``os._exit(0)`` once its result is written. Only for the Hugging
    Face Trainer test, whose ranks abort in interpreter teardown about one run in three ("terminate called
    without an active exception", a C++ thread still joinable at exit; which library's is not found yet):
    what the test checks is written before it. Every other test exits normally, so an abort there fails it.
    """
    workdir = str(workdir)
    os.makedirs(workdir, exist_ok=True)
    mp.start_processes(_entry, args=(fn, world_size, workdir, args, hard_exit), nprocs=world_size,
                       start_method="spawn", join=True)
    results = []
    for r in range(world_size):
        with open(os.path.join(workdir, f"result{r}.pkl"), "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            raise AssertionError(f"rank {r} failed:\n{value}")
        results.append(value)
    return results
