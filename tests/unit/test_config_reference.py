"""docs/reference/config.md's key reference is generated from infinity/config/sections.py (by docs/generate.py)
and must not drift from it; every toml block of the README and docs/ is a valid config."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from infinity import config
from infinity.config import toml_io as _toml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIG_PAGE = ROOT / "docs" / "reference" / "config.md"
BEGIN, END = "<!-- config-reference:begin -->\n", "<!-- config-reference:end -->"


def test_config_page_reference_equals_the_generated_one():
    text = CONFIG_PAGE.read_text(encoding="utf-8")
    assert BEGIN in text and END in text
    embedded = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert embedded == config.reference_markdown(), (
        "docs/reference/config.md's config reference is stale: run  python docs/generate.py  and commit the page")


def test_reference_documents_every_section_and_key():
    reference = config.reference_markdown()
    for section in config.SECTIONS:
        assert f"### `[{section.section}]`" in reference
        for name in (f.name for f in dataclasses.fields(section)):
            assert re.search(rf"^\| `{name}` \| .+ \| .+ \| .{{20,}} \|$", reference, re.M), f"{section.section}.{name}"


def test_doc_examples_are_valid():
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    blocks = [block for page in pages for block in re.findall(r"```toml\n(.*?)```", page.read_text(encoding="utf-8"), re.S)]
    assert blocks
    for block in blocks:
        config.load_config(_toml.loads(block))
    text = CONFIG_PAGE.read_text(encoding="utf-8")
    for name in config.presets():
        assert f"| `{name}` |" in text, f"preset {name} missing from docs/reference/config.md's table"
    readme = README.read_text(encoding="utf-8")
    assert readme.index("make demo") < readme.index("## Quickstart") and "make test" in readme.split("## Quickstart")[0]
