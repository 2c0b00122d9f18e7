"""The generated parts of docs/ (the command-line options, the Python API, the index of design notes) equal
what docs/generate.py makes from the code now; the config reference is held by test_config_reference.py."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_fresh(page: Path, text: str) -> None:
    assert page.read_text(encoding="utf-8") == text, (
        f"{page.relative_to(ROOT)} is stale: run  python docs/generate.py  and commit the page")


def test_cli_reference_is_fresh():
    gen = _generator()
    _assert_fresh(gen.CLI_PAGE, gen.cli_page(gen.CLI_PAGE.read_text(encoding="utf-8")))


def test_api_reference_is_fresh():
    gen = _generator()
    _assert_fresh(gen.API_PAGE, gen.api_page(gen.API_PAGE.read_text(encoding="utf-8")))


def test_notes_index_is_fresh():
    gen = _generator()
    _assert_fresh(gen.NOTES_PAGE, gen.notes_page())


def test_notes_index_finds_definitions_not_citations():
    gen = _generator()
    found = gen.notes()
    assert "glossary" in found and "infinity/__init__.py" in found["glossary"]
    assert "fork" in found and found["fork"] == ["aio_csrc/lifecycle.h"]          # "/* [Note: fork] A forked ..."
    assert "shutdown" in found and "aio_csrc/lifecycle.h" in found["shutdown"]
    # "[Note: update modes] in infinity/optim/scheduler.py" cites it: the definition is in scheduler.py only
    assert found.get("update modes") == ["infinity/optim/scheduler.py"]
    assert len(found) > 100
