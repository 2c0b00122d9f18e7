"""README.md's config reference is generated from infinity/config/sections.py and must not drift from it."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from infinity import config
from infinity.config import toml_io as _toml

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- config-reference:begin -->\n", "<!-- config-reference:end -->"


def test_readme_reference_equals_the_generated_one():
    text = README.read_text(encoding="utf-8")
    assert BEGIN in text and END in text
    embedded = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert embedded == config.reference_markdown(), (
        "README.md's config reference is stale: replace the text between the config-reference markers with "
        "the output of  python -c \"import infinity.config as c; print(c.reference_markdown(), end='')\"")


def test_reference_documents_every_section_and_key():
    reference = config.reference_markdown()
    for section in config.SECTIONS:
        assert f"### `[{section.section}]`" in reference
        for name in (f.name for f in dataclasses.fields(section)):
            assert re.search(rf"^\| `{name}` \| .+ \| .+ \| .{{20,}} \|$", reference, re.M), f"{section.section}.{name}"


def test_readme_examples_are_valid():
    text = README.read_text(encoding="utf-8")
    for block in re.findall(r"```toml\n(.*?)```", text, re.S):
        config.load_config(_toml.loads(block))
    for name in config.presets():
        assert f"| `{name}` |" in text, f"preset {name} missing from README's table"
    assert text.index("make demo") < text.index("## Your program") and "make test" in text.split("## Your program")[0]
