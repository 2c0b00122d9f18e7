"""Writes the generated parts of the documentation from the code, so they cannot drift from it.

- docs/reference/config.md, between its ``config-reference`` markers: every config key, from the
  section dataclasses' docstrings (``infinity.config.reference_markdown()``).
- docs/reference/cli.md, between its ``cli-reference`` markers: every command line's options, from
  the commands' own argparse parsers.
- docs/reference/api.md, between its ``api-reference`` markers: each public name of ``infinity``, its
  signature and the description its docstring opens with.
- docs/explanation/notes-index.md, whole: every ``[Note: ...]`` block of the code and the file that
  holds it.

Run ``python docs/generate.py`` after changing a config field, a command-line option or a note;
``python docs/generate.py --check`` exits 1 naming the pages that are stale (tests/unit/test_docs_generated.py
and tests/unit/test_config_reference.py run the same check in ``make test``).
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG_PAGE = ROOT / "docs" / "reference" / "config.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
API_PAGE = ROOT / "docs" / "reference" / "api.md"
NOTES_PAGE = ROOT / "docs" / "explanation" / "notes-index.md"
CONFIG_MARKERS = ("<!-- config-reference:begin -->\n", "<!-- config-reference:end -->")
CLI_MARKERS = ("<!-- cli-reference:begin -->\n", "<!-- cli-reference:end -->")
API_MARKERS = ("<!-- api-reference:begin -->\n", "<!-- api-reference:end -->")
# The public names, grouped as the page shows them (every name of infinity's lazy table must be in one).
API_GROUPS = (("Building a model", ("Init", "from_pretrained", "load_config")),
              ("Training", ("AdamW", "Adam", "clip_grad_norm_", "activation_checkpoint", "Trainer")),
              ("Whole parameters and weights", ("gathered", "state_dict", "save_pretrained")),
              ("Checkpoints", ("save_checkpoint", "load_checkpoint")),
              ("Telemetry and lifetime", ("stats", "trace", "release")),
              ("Tiled layers", ("TiledLinear", "TiledEmbedding")))
# Where notes are looked for, and the files' suffixes.
NOTE_FOLDERS = ("infinity", "tiers", "aio_csrc", "optim_csrc", "benchmarks", "tests")
NOTE_SUFFIXES = (".py", ".pyi", ".c", ".h")
# A note is defined where a line starts with its name (after a comment marker) and goes on with nothing,
# or with a sentence; "[Note: x] in file" and "[Note: x])." are citations of it.
NOTE_DEFINITION = re.compile(r"^\s*(?:#|\*|/\*|//)?\s*\[Note: ([^\]]+)\](?:\s*(?:\*/)?\s*$| (?!in\b|for\b)\w)")
# The console scripts, in the order the page lists them; each with its subcommands.
COMMANDS = (("infinity-plan", "infinity.cli.plan"), ("infinity-bench", "infinity.cli.bench"),
            ("infinity-report", "infinity.cli.report"), ("infinity-consolidate", "infinity.cli.consolidate"))


def _between(text: str, markers: tuple[str, str], body: str, page: Path) -> str:
    begin, end = markers
    if begin not in text or end not in text:
        raise SystemExit(f"{page.relative_to(ROOT)}: the markers {begin.strip()} and {end} are missing")
    head, rest = text.split(begin, 1)
    return head + begin + body + end + rest.split(end, 1)[1]


# -- the config reference ----------------------------------------------------------------------------------

def config_page(text: str) -> str:
    """``text`` (the page) with its generated part brought up to date."""
    from infinity.config import reference_markdown

    return _between(text, CONFIG_MARKERS, reference_markdown(), CONFIG_PAGE)


# -- the command lines -------------------------------------------------------------------------------------

class _Parsed(Exception):
    """Carries the parser a command's ``main`` built, instead of letting it parse."""


def _parser_of(module_name: str) -> argparse.ArgumentParser:
    """The top-level parser a command's ``main`` builds, taken as it calls ``parse_args``."""
    main = importlib.import_module(module_name).main
    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        main([])
    except _Parsed as caught:
        return caught.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    raise RuntimeError(f"{module_name}.main returned without parsing its arguments")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    """The default as the page shows it: none where the help already says it (some are computed on this
    machine, such as the I/O engines the kernel allows, and raw values read worse than the help's)."""
    value = action.default
    if (value is None or value is False or value == argparse.SUPPRESS or action.nargs == 0
            or value == [] or "default" in (action.help or "")):
        return ""
    if value == tempfile.gettempdir():
        return "the temp directory"
    return f"`{value}`"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(default)" in text:
        value = action.default
        shown = "the temp directory" if value == tempfile.gettempdir() else str(value)
        text = text.replace("%(default)s", shown)
    return _cell(text)


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | value | default | meaning |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
        if action.choices:
            value = " \\| ".join(f"`{c}`" for c in action.choices)
        elif action.nargs == 0:
            value = "flag"
        else:
            value = f"`{action.metavar or action.dest.upper()}`"
            if action.nargs == "?":
                value += " (optional)"
        rows.append(f"| {name} | {value} | {_default(action)} | {_help(action)} |")
    return rows


def cli_reference() -> str:
    out = []
    for prog, module in COMMANDS:
        parser = _parser_of(module)
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subparsers:
            out += [f"### `{prog}`", "", _cell(parser.description or ""), ""]
            helps = {c.dest: c.help for c in subparsers[0]._choices_actions}
            for name, sub in subparsers[0].choices.items():
                out += [f"#### `{prog} {name}`", "", _cell(sub.description or helps.get(name) or ""), ""]
                out += _options_table(sub) + [""]
        else:
            out += [f"### `{prog}`", "", _cell(parser.description or ""), ""]
            out += _options_table(parser) + [""]
    return "\n".join(out)


def cli_page(text: str) -> str:
    return _between(text, CLI_MARKERS, cli_reference(), CLI_PAGE)


# -- the Python API ---------------------------------------------------------------------------------------

def _description(obj) -> str:
    """The docstring's opening, up to its first numpydoc section (Parameters, Examples, ...)."""
    import inspect

    doc = inspect.getdoc(obj) or ""
    lines = []
    for i, line in enumerate(doc.splitlines()):
        following = doc.splitlines()[i + 1] if i + 1 < len(doc.splitlines()) else ""
        if following.strip() and set(following.strip()) == {"-"}:
            break
        lines.append(line)
    return "\n".join(lines).strip()


def api_reference() -> str:
    import inspect

    import infinity

    named = {name for _, names in API_GROUPS for name in names}
    missing = sorted(set(infinity._LAZY) - named)
    if missing:
        raise SystemExit(f"docs/generate.py: API_GROUPS does not list {missing}: add them to a group")
    out = []
    for title, names in API_GROUPS:
        out += [f"### {title}", ""]
        for name in names:
            obj = getattr(infinity, name)
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                signature = "(...)"
            kind = "class" if inspect.isclass(obj) else "def"
            out += [f"#### `infinity.{name}`", "", "```text", f"{kind} {name}{signature}", "```", "",
                    _description(obj), ""]
    return "\n".join(out)


def api_page(text: str) -> str:
    return _between(text, API_MARKERS, api_reference(), API_PAGE)


# -- the notes index ---------------------------------------------------------------------------------------

def notes() -> dict[str, list[str]]:
    """Each note's name and the files (relative paths) that define it."""
    found: dict[str, list[str]] = defaultdict(list)
    for folder in NOTE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in NOTE_SUFFIXES or not path.is_file():
                continue
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                match = NOTE_DEFINITION.match(line)
                if match:
                    relative = path.relative_to(ROOT).as_posix()
                    if relative not in found[match.group(1)]:
                        found[match.group(1)].append(relative)
    return dict(found)


def notes_page() -> str:
    by_folder: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for name, files in notes().items():
        for file in files:
            by_folder[file.split("/")[0]].append((name, file))
    out = ["# Index of the design notes in the code", "",
           "The code explains its non-obvious decisions in named blocks, `[Note: name]`, which other places cite",
           "as \"see [Note: name] in path\". This index lists every note and the file that holds it: open the file",
           "and search for the name. Generated by `python docs/generate.py` (a test fails when it is stale).", ""]
    titles = {"infinity": "`infinity/`: the engine", "tiers": "`tiers/`: where tensors live",
              "aio_csrc": "`aio_csrc/`: the I/O core (C)", "optim_csrc": "`optim_csrc/`: the host Adam kernels (C)",
              "benchmarks": "`benchmarks/`", "tests": "`tests/`"}
    for folder in NOTE_FOLDERS:
        entries = sorted(by_folder.get(folder, []), key=lambda e: (e[1], e[0].lower()))
        if not entries:
            continue
        out += [f"## {titles[folder]}", "", "| note | file |", "|---|---|"]
        out += [f"| {_cell(name)} | `{file}` |" for name, file in entries]
        out.append("")
    return "\n".join(out)


# -- the command -------------------------------------------------------------------------------------------

def generated() -> dict[Path, str]:
    """Each generated page and the text it should have."""
    return {CONFIG_PAGE: config_page(CONFIG_PAGE.read_text(encoding="utf-8")),
            CLI_PAGE: cli_page(CLI_PAGE.read_text(encoding="utf-8")),
            API_PAGE: api_page(API_PAGE.read_text(encoding="utf-8")),
            NOTES_PAGE: notes_page()}


def stale() -> list[str]:
    """The generated pages whose text differs from what the code gives now."""
    return [page.relative_to(ROOT).as_posix() for page, text in generated().items()
            if not page.exists() or page.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/generate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming stale pages")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for page in old:
            print(f"{page} is stale: run python docs/generate.py", file=sys.stderr)
        return 1 if old else 0
    for page, text in generated().items():
        if not page.exists() or page.read_text(encoding="utf-8") != text:
            page.write_text(text, encoding="utf-8")
            print(f"wrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
