"""Every code block of README.md and docs/ runs: each ```python block, and each command of each ```sh /
```bash block, at the tiny size the page shows, in a temporary directory.

[Note: documentation blocks under test]
A page's blocks run in order, in one temporary directory of its own (so a later block finds the files an
earlier one wrote: a checkpoint, an exported model), each in a process of its own (so "resume in a new
process" is one). The literal directory ``/mnt/nvme`` in a block stands for the reader's NVMe disk and is
replaced by a temporary directory. A block is steered by an HTML comment on the line right above it
(blank lines between are allowed):

- ``<!-- skip: REASON -->``: not run (it needs a GPU, several processes, a long run, a download, an
  install); the test is reported skipped with REASON.
- ``<!-- needs: MODULE, ... -->``: skipped, naming the module, when one of these cannot be imported.
- ``<!-- file: NAME -->``: the block is also written to NAME in the page's directory (a later block may
  ``import`` it), then run as ``python NAME`` would run it.
- ``<!-- continue -->``: runs in the same process as the block above, after it, as one script.
- ``<!-- expect-exit: N, ... -->``: each command of a shell block may exit with one of these statuses (a
  plan that says "does not fit" on a small machine exits 1); otherwise it must exit 0.
- ``<!-- ranks: N -->``: a python block run as ``accelerate launch --num_processes N`` (or torchrun) runs it
  on a machine without a GPU: N processes at once, each with the launcher's ``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (a free port), and
  accelerate's ``ACCELERATE_USE_CPU``, so the block makes its process group (gloo) as it would under the
  launcher; it passes when every rank exits 0.
A page that only records measurements says ``<!-- docs-test: skip-page REASON -->`` once, anywhere:
each of its blocks is then skipped with REASON. Blocks in other languages (toml, text) are not run;
tests/unit/test_config_reference.py loads the toml ones.

Starting Python with torch, transformers and infinity costs seconds on two cores, more than most blocks'
work, so one server process imports them once and forks a child for each block (a console script
such as ``infinity-plan`` or ``python -m mod`` is called in such a child too; any other shell command goes
to bash). Nothing runs in the server itself after the imports, so no thread or OpenMP team exists when it
forks. Its last job is to report each block's exit status and output.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NVME_PLACEHOLDER = "/mnt/nvme"
RUN_LANGS = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "console": "sh"}
MARKER = re.compile(r"<!--\s*(skip|needs|file|continue|expect-exit|ranks)\s*(?::\s*(.*?))?\s*-->")
PAGE_SKIP = re.compile(r"<!--\s*docs-test:\s*skip-page\s+(.*?)\s*-->")
FENCE = re.compile(r"^```(\S*)\s*$")
JOB_TIMEOUT_S = 120
SERVER_TIMEOUT_S = 540
# Imported once by the server before it forks (a name that fails to import is left out).
PRELOAD = ("torch", "torch._dynamo", "numpy", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.trainer", "accelerate", "safetensors.torch", "infinity", "infinity.config",
           "infinity.runtime.init", "infinity.optim.adam", "infinity.checkpoint", "infinity.checkpoint.trainer",
           "infinity.runtime.hf_save", "infinity.runtime.gathered", "infinity.examples.data",
           "infinity.cli.plan", "infinity.cli.bench", "infinity.cli.report", "infinity.cli.consolidate")


@dataclasses.dataclass
class Block:
    page: str            # relative to the repository root
    line: int            # of the opening fence, 1-based
    lang: str            # "python" or "sh"
    code: str
    markers: dict

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    """The runnable fenced blocks of one page, each with the markers written right above it."""
    text = path.read_text(encoding="utf-8")
    page = path.relative_to(ROOT).as_posix()
    page_skip = PAGE_SKIP.search(text)
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(1).lower()
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        body = "\n".join(lines[start + 1:i]) + "\n"
        i += 1
        if lang not in RUN_LANGS:
            continue
        markers, j = {}, start - 1
        while j >= 0 and (not lines[j].strip() or MARKER.fullmatch(lines[j].strip())):
            found = MARKER.fullmatch(lines[j].strip())
            if found:
                markers.setdefault(found.group(1), found.group(2) or "")
            j -= 1
        if page_skip and "skip" not in markers:
            markers["skip"] = page_skip.group(1)
        out.append(Block(page, start + 1, RUN_LANGS[lang], body, markers))
    return out


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks_of(p)]


def _missing_module(names: str) -> str | None:
    import importlib.util

    for name in (n.strip() for n in names.split(",")):
        if name and importlib.util.find_spec(name) is None:
            return name
    return None


def jobs() -> list[dict]:
    """One job per block, or per run of blocks joined by ``continue``; each says why it is skipped, if it is."""
    out: list[dict] = []
    for block in all_blocks():
        m = block.markers
        if "continue" in m and out and out[-1]["page"] == block.page and out[-1]["lang"] == block.lang == "python":
            out[-1]["code"] += "\n" + block.code
            out[-1]["blocks"].append(block.name)
            if "skip" in m and not out[-1]["skip"]:
                out[-1]["skip"] = m["skip"]
            continue
        skip = m.get("skip") or None
        if skip is None and "needs" in m:
            missing = _missing_module(m["needs"])
            if missing:
                skip = f"needs {missing}, which is not installed"
        out.append({"id": block.name, "page": block.page, "lang": block.lang, "code": block.code,
                    "file": m.get("file") or None,
                    "expect_exit": [int(n) for n in (m.get("expect-exit") or "0").split(",")],
                    "blocks": [block.name], "skip": skip, "ranks": int(m.get("ranks") or 1)})
    return out


# ----------------------------------------------------------------------------------------------------------
# The server: imports once, then forks a child per job (see [Note: documentation blocks under test]).

def _console_scripts() -> dict[str, str]:
    try:
        import tomllib
    except ImportError:     # Python 3.10
        import tomli as tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def _shell_commands(code: str) -> list[str]:
    commands, current = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip() and not current.strip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands


def _in_process(argv: list[str], scripts: dict[str, str]):
    """A callable that runs a simple command (a console script, ``python -m``/``python file``) in this process,
    or None when it needs a shell."""
    import importlib
    import runpy

    if argv and argv[0] in scripts:
        module, func = scripts[argv[0]].split(":")

        def run():
            sys.argv = argv
            return getattr(importlib.import_module(module), func)()
        return run
    if len(argv) >= 2 and argv[0] in ("python", "python3"):
        if argv[1] == "-m" and len(argv) >= 3:
            def run():
                sys.argv = [argv[2], *argv[3:]]
                runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            return run
        if argv[1].endswith(".py"):
            def run():
                sys.argv = argv[1:]
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
                runpy.run_path(argv[1], run_name="__main__")
            return run
    return None


def _exit_status(call) -> int:
    """Runs ``call`` as a program's main: its exit status (SystemExit honoured, an exception printed: 1)."""
    import traceback

    try:
        result = call()
        return result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _fork(call, cwd: str, log: str, timeout_s: float) -> int:
    """Runs ``call`` in a forked child with cwd ``cwd`` and output to ``log``; its exit status (-9 on timeout)."""
    return _wait_all([_start(call, cwd, log)], log, timeout_s)[0]


def _start(call, cwd: str, log: str, env: dict | None = None) -> int:
    """Forks a child that runs ``call`` with cwd ``cwd``, output to ``log`` and ``env`` added to its environment;
    its pid."""
    pid = os.fork()
    if pid == 0:     # the child: never returns
        code = 1
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(cwd)
            os.environ.update(env or {})
            sys.path.insert(0, cwd)
            code = _exit_status(call)
            import atexit
            import gc

            gc.collect()
            atexit._run_exitfuncs()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code if 0 <= code < 256 else 1)
    return pid


def _wait_all(pids: list[int], log: str, timeout_s: float) -> list[int]:
    """The exit status of each child in ``pids`` (-9 for one killed at the timeout, with the others left)."""
    deadline = time.monotonic() + timeout_s
    statuses: dict[int, int] = {}
    while len(statuses) < len(pids):
        for pid in pids:
            if pid in statuses:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[pid] = os.waitstatus_to_exitcode(status)
        if len(statuses) < len(pids) and time.monotonic() > deadline:
            for pid in pids:
                if pid not in statuses:
                    os.killpg(pid, 9)
                    os.waitpid(pid, 0)
                    statuses[pid] = -9
            with open(log, "a") as f:
                f.write(f"\n[killed after {timeout_s:.0f} s]\n")
        time.sleep(0.02)
    return [statuses[pid] for pid in pids]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(run, ranks: int, cwd: str, log: str) -> int:
    """Runs ``run`` in ``ranks`` children at once, as torchrun starts them on one machine; the first nonzero exit
    status. Each rank's output goes to the job's log after a line naming the rank and its exit status."""
    port = str(_free_port())
    pids = []
    for rank in range(ranks):
        rank_log = f"{log}.rank{rank}"
        # ACCELERATE_USE_CPU as `accelerate launch` sets it on a machine without a GPU: accelerate then splits
        # the batches over the ranks (MULTI_CPU); under torchrun alone it makes the group but keeps every batch.
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "ACCELERATE_USE_CPU": "true"}
        pids.append(_start(run, cwd, rank_log, env))
    statuses = _wait_all(pids, log, JOB_TIMEOUT_S)
    with open(log, "a") as f:
        for rank, status in enumerate(statuses):
            f.write(f"[rank {rank}: exit status {status}]\n{Path(f'{log}.rank{rank}').read_text(errors='replace')}")
    return next((status for status in statuses if status != 0), 0)


def _run_job(job: dict, cwd: str, nvme: str, scripts: dict[str, str], log: str) -> int:
    code = job["code"].replace(NVME_PLACEHOLDER, nvme)
    if job["lang"] == "python":
        path = os.path.join(cwd, job["file"]) if job["file"] else None
        if path:
            with open(path, "w") as f:
                f.write(code)

        def run():
            sys.argv = [path or "-c"]
            compiled = compile(code, path or f"<{job['id']}>", "exec")
            exec(compiled, {"__name__": "__main__", "__file__": path or f"<{job['id']}>", "__builtins__": __builtins__})
        if job["ranks"] > 1:
            return _launch(run, job["ranks"], cwd, log)
        return _fork(run, cwd, log, JOB_TIMEOUT_S)
    status = 0
    for command in _shell_commands(code):
        with open(log, "a") as f:
            f.write(f"$ {command}\n")
        call = None
        if not re.search(r"[|&;<>()$`]|^\w+=", command):
            call = _in_process(shlex.split(command, comments=True), scripts)
        if call is not None:
            status = _fork(call, cwd, log, JOB_TIMEOUT_S)
        else:
            env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
            with open(log, "a") as f:
                try:
                    status = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdout=f, stderr=f,
                                            timeout=JOB_TIMEOUT_S).returncode
                except subprocess.TimeoutExpired:
                    status = -9
        if status not in job["expect_exit"]:
            return status
    return job["expect_exit"][0]


def serve(jobs_path: str, results_path: str, workdir: str) -> None:
    """The server's main: run the jobs in ``jobs_path`` (JSON), write their results to ``results_path``."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    scripts = _console_scripts()
    results, dirs = {}, {}
    for job in json.loads(Path(jobs_path).read_text()):
        page_dir = dirs.get(job["page"])
        if page_dir is None:
            page_dir = dirs[job["page"]] = os.path.join(workdir, f"page{len(dirs)}")
            os.makedirs(os.path.join(page_dir, "nvme"))
        log = os.path.join(workdir, f"job{len(results)}.log")
        t0 = time.monotonic()
        Path(log).touch()
        status = _run_job(job, page_dir, os.path.join(page_dir, "nvme"), scripts, log)
        results[job["id"]] = {"status": status, "seconds": round(time.monotonic() - t0, 2),
                              "output": Path(log).read_text(errors="replace")[-6000:]}
        Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    serve(*sys.argv[1:4])
else:
    import pytest

    _JOBS = jobs()

    @pytest.fixture(scope="module")
    def results(request, tmp_path_factory):
        """Runs every selected job that is not skipped, in one server process."""
        selected = {item.callspec.params["job"]["id"] for item in request.session.items
                    if item.module is request.module and hasattr(item, "callspec")}
        todo = [j for j in _JOBS if j["skip"] is None and j["id"] in selected]
        work = tmp_path_factory.mktemp("docs")
        (work / "jobs.json").write_text(json.dumps(todo))
        # One compute thread: the blocks' models are tiny, and two OpenMP teams on two busy cores (the suite
        # runs beside other work) spin against each other, 20-50x slower per step. No GPU: the blocks run on
        # the CPU on every machine, engines (INFINITY_DEVICE=cpu) and accelerate alike.
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        proc = subprocess.run([sys.executable, __file__, str(work / "jobs.json"), str(work / "results.json"),
                               str(work)], cwd=work, env=env, capture_output=True, text=True,
                              timeout=SERVER_TIMEOUT_S)
        found = json.loads((work / "results.json").read_text()) if (work / "results.json").exists() else {}
        return found, proc

    @pytest.mark.parametrize("job", _JOBS, ids=[j["id"] for j in _JOBS])
    def test_block_runs(job, results):
        if job["skip"]:
            pytest.skip(job["skip"])
        found, proc = results
        assert job["id"] in found, f"the docs server stopped before {job['id']}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        result = found[job["id"]]
        assert result["status"] in job["expect_exit"], (
            f"{', '.join(job['blocks'])} exited with {result['status']} (expected {job['expect_exit']}):\n"
            f"{result['output']}")

    def test_markers_are_known_and_pages_have_runnable_blocks():
        """A misspelt marker would silently run (or skip) a block: every HTML comment right above a fence is one
        of the markers; every page with a fenced python block is collected."""
        for path in pages():
            lines = path.read_text(encoding="utf-8").splitlines()
            for i, line in enumerate(lines):
                if FENCE.match(line) and i and lines[i - 1].strip().startswith("<!--"):
                    above = lines[i - 1].strip()
                    assert MARKER.fullmatch(above) or PAGE_SKIP.fullmatch(above), (
                        f"{path.relative_to(ROOT)}:{i}: unknown marker {above}")
        assert any(j["page"] == "README.md" and j["lang"] == "python" and not j["skip"] for j in _JOBS)
