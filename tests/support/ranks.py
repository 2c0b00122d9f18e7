"""Run a function on N spawned gloo ranks and collect what each returns."""
import os
import pickle
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world_size: int, workdir: str, args) -> None:
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


def run_ranks(fn, world_size: int, workdir, *args):
    """Spawn ``world_size`` ranks running ``fn(rank, world_size, workdir, *args)``; returns the results.

    Every rank exits normally, through the interpreter's teardown: an abort there fails the test.
    """
    workdir = str(workdir)
    os.makedirs(workdir, exist_ok=True)
    mp.start_processes(_entry, args=(fn, world_size, workdir, args), nprocs=world_size,
                       start_method="spawn", join=True)
    results = []
    for r in range(world_size):
        with open(os.path.join(workdir, f"result{r}.pkl"), "rb") as f:
            status, value = pickle.load(f)
        if status != "ok":
            raise AssertionError(f"rank {r} failed:\n{value}")
        results.append(value)
    return results


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
