"""What every infinity command line shares: one-line errors, the exit codes, ``--debug``.

[Note: command-line errors]
A command that fails prints one line on stderr, ``<prog>: error: <what went wrong>``, never a
traceback, and exits with 2 when the input was wrong (a usage error, a bad config, a bad
argument value) or 1 when the work itself failed (a missing or corrupt checkpoint, a disk
error, a plan that does not fit). ``--debug`` lets the exception through with its traceback,
for a bug report. Multi-line messages (a config with several unknown keys) are joined with
"; " so that the error stays one line.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Callable, NoReturn

USAGE = 2
FAILURE = 1


class UsageError(Exception):
    """The command was called wrongly; exits with 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit 2, with a ``--debug`` flag."""

    def __init__(self, *args, debug: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if debug:
            self.add_argument("--debug", action="store_true",
                              help="show the traceback of an error instead of one line")

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: error: {one_line(message)}\n")


def one_line(message: object) -> str:
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())


def run(prog: str, debug: bool, body: Callable[[], int], usage: tuple[type[BaseException], ...] = ()) -> int:
    """Run a command's ``body``; its errors become one line and an exit code (see [Note: command-line errors])."""
    # A scheduler stops a job with SIGTERM: as Ctrl-C, so that a tool's cleanup (a bench's test file, a
    # consolidation's temporary output) runs, and the exit says so (143).
    def terminated(signum, frame):
        raise _Terminated()

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, terminated)
    try:
        return _body(prog, debug, body, usage)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)      # a caller in the same process keeps its own


def _body(prog: str, debug: bool, body: Callable[[], int], usage: tuple[type[BaseException], ...]) -> int:
    from infinity.config import ConfigError

    try:
        return body()
    except _Terminated:
        if debug:
            raise
        print(f"{prog}: terminated", file=sys.stderr)
        return 143
    except BrokenPipeError:
        # The reader went away (`... | head`): not an error of ours.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (keeps interpreter exit quiet)
        return 0
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every error becomes one line, unless --debug
        if debug:
            raise
        wrong_input = isinstance(exc, (UsageError, ConfigError) + usage)
        hint = "" if wrong_input or _expected(exc) else f" ({type(exc).__name__}; --debug shows the traceback)"
        print(f"{prog}: error: {one_line(exc)}{hint}", file=sys.stderr)
        return USAGE if wrong_input else FAILURE


class _Terminated(BaseException):
    """SIGTERM, raised where the tool runs (a BaseException, as KeyboardInterrupt: ``except Exception`` lets it by)."""


def _expected(exc: BaseException) -> bool:
    """Errors whose message says all (ours, and the OS's about a file); others get their type named."""
    from infinity.checkpoint.errors import CheckpointError

    return isinstance(exc, (CheckpointError, OSError))


def check_output(path: str | None, option: str) -> None:
    """Refuse an output file that cannot be written before the work that fills it, naming ``option``."""
    if not path or path == "-":
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: is a directory; give a file name")
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {path}: not writable")


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file beside it, renamed over it once written
    (an interrupt or a full disk leaves the old file, and a symlink at ``path`` is replaced, not followed)."""
    from tiers import newfile

    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = newfile.create(directory, prefix=f".{os.path.basename(path)}.tmp-")
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
