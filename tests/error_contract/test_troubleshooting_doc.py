"""docs/TROUBLESHOOTING.md and the contract agree: every contract text is in the doc and in the
runtime's source, every entry has its section linking its tests, and every linked test exists."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, List

import pytest

from contract import CONTRACT

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "TROUBLESHOOTING.md"
RUNTIME_DIRS = ("srt", "managers", "mem_cache", "kernels")
TEST_LINK = re.compile(r"tests/[\w/]+\.py::\w+")


@lru_cache(maxsize=None)
def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def doc_sections() -> Dict[str, str]:
    """Anchor -> the text up to the next anchor (sections start with `<a id="key"></a>`)."""
    parts = re.split(r'<a id="([\w-]+)"></a>', doc_text())
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@lru_cache(maxsize=None)
def source_literals() -> List[str]:
    """Every string literal of the runtime, f-strings split at their placeholders (implicit
    concatenation is already joined by the parser), so a contract text must be printed as is."""
    out: List[str] = []
    for folder in RUNTIME_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    out.append(node.value)
    return out


def test_test_ids_are_unique_and_anchors_distinct():
    keys = [e.key for e in CONTRACT]
    assert len(keys) == len(set(keys))
    assert {"start-up", "request", "running"} == {e.stage for e in CONTRACT}


@pytest.mark.parametrize("entry", CONTRACT, ids=[e.key for e in CONTRACT])
def test_every_contract_text_is_printed_by_the_runtime_and_documented(entry):
    for text in entry.texts:
        assert any(text in literal for literal in source_literals()), f"{text!r} is not in the runtime's source"
        assert text in doc_text(), f"{text!r} ({entry.key}) is not in docs/TROUBLESHOOTING.md"


@pytest.mark.parametrize("entry", CONTRACT, ids=[e.key for e in CONTRACT])
def test_every_entry_has_a_section_that_links_its_tests(entry):
    section = doc_sections().get(entry.key)
    assert section is not None, f'docs/TROUBLESHOOTING.md lacks <a id="{entry.key}"></a>'
    for test in entry.tests:
        assert test in section, f"section {entry.key} does not link {test}"


def test_every_test_linked_from_the_doc_or_the_contract_exists():
    links = set(TEST_LINK.findall(doc_text())) | {t for e in CONTRACT for t in e.tests}
    assert links
    for link in sorted(links):
        path, name = link.split("::")
        file = ROOT / path
        assert file.is_file(), f"{link}: no such file"
        assert re.search(rf"^(async )?def {name}\(", file.read_text(encoding="utf-8"), re.M), f"{link}: no such test"


def test_every_doc_section_links_at_least_one_test():
    sections = doc_sections()
    assert set(sections) >= {e.key for e in CONTRACT}
    for key, body in sections.items():
        assert TEST_LINK.search(body), f"section {key} links no test"
