"""The default process group goes when the script destroys it, with an engine alive: no gloo worker
thread is left for the interpreter's teardown, where one aborts the process (see [Note: torch._dynamo and
the default process group] in infinity/runtime/hooks.py). And where torch does keep the group, because
the engine was first imported after the group was made, the engine says so."""
import os
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist

import infinity
from tests.support.ranks import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def _step_then_destroy(rank, world, workdir):
    # run_ranks imported the engine before it made the group, as a script should.
    torch.manual_seed(0)
    with infinity.Init({"tiers": {"params": "host", "optimizer": "host"}}):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = infinity.AdamW(model, lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    before = _gloo_threads()
    dist.destroy_process_group()   # model and opt, so their engine, are alive here
    after = _gloo_threads()
    infinity.stats(model)   # raises if the engine were gone (released)
    return before, after


def test_destroy_process_group_stops_the_gloo_threads_while_the_engine_lives(tmp_path):
    for before, after in run_ranks(_step_then_destroy, 2, tmp_path, fresh=True):
        assert before, "the check needs the group's gloo threads to exist before the destroy"
        assert after == [], f"gloo threads outlive destroy_process_group(): {after}"


_LATE_IMPORT = textwrap.dedent("""
    import os, sys, warnings
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, workdir):
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=2)
        import infinity        # first imported after the group: what the warning is for
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with infinity.Init({"tiers": {"params": "host", "optimizer": "host"}}):
                torch.nn.Linear(4, 4)
        with open(os.path.join(workdir, f"warnings{rank}"), "w") as f:
            f.write("\\n".join(str(w.message) for w in seen))
        dist.destroy_process_group()
        os._exit(0)   # torch keeps the group: skip the teardown that warning is about

    if __name__ == "__main__":
        mp.start_processes(rank_main, args=(sys.argv[1],), nprocs=2, start_method="spawn")
""")


def test_an_engine_imported_after_the_group_says_torch_keeps_it(tmp_path):
    script = tmp_path / "late.py"
    script.write_text(_LATE_IMPORT)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        text = (tmp_path / f"warnings{rank}").read_text()
        assert "first imported after dist.init_process_group()" in text, text
        assert "from infinity import Init" in text and "190489" in text, text
