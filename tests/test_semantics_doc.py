"""docs/SEMANTICS.md cannot drift: every line names tests, and every named test exists."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "SEMANTICS.md"
REF = re.compile(r"\[(tests/[\w/]+\.py)::([\w:]+)\]")


def _import(rel: str):
    path = REPO / rel
    name = "semantics_ref_" + re.sub(r"\W", "_", rel)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    sys.modules[name] = module
    return module


def lines_and_refs() -> list[tuple[int, str, list[tuple[str, str]]]]:
    """Every line except blank ones and section headings, with the tests it names."""
    out = []
    for number, line in enumerate(DOC.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("## "):
            continue
        out.append((number, line, REF.findall(line)))
    return out


def test_every_line_names_an_existing_test():
    entries = lines_and_refs()
    assert len(entries) > 50
    missing_refs = [f"line {n}: {line[:80]}" for n, line, refs in entries if not refs]
    assert not missing_refs, "lines without a [tests/...::test] reference:\n" + "\n".join(missing_refs)
    broken = []
    for n, _, refs in entries:
        for rel, node in refs:
            if not (REPO / rel).is_file():
                broken.append(f"line {n}: {rel} does not exist")
                continue
            obj = _import(rel)
            for part in node.split("::"):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if obj is None or not callable(obj) or not node.split("::")[-1].startswith("test"):
                broken.append(f"line {n}: {rel}::{node} is not a test")
    assert not broken, "\n".join(broken)


def test_the_checker_rejects_a_bad_reference(tmp_path, monkeypatch):
    fake = tmp_path / "SEMANTICS.md"
    fake.write_text(DOC.read_text() + "- made-up behaviour [tests/test_semantics_doc.py::test_that_does_not_exist]\n")
    monkeypatch.setattr(sys.modules[__name__], "DOC", fake)
    try:
        test_every_line_names_an_existing_test()
    except AssertionError as exc:
        assert "test_that_does_not_exist" in str(exc)
    else:
        raise AssertionError("a reference to a missing test was accepted")
    fake.write_text(DOC.read_text() + "- a claim with no test at all\n")
    try:
        test_every_line_names_an_existing_test()
    except AssertionError as exc:
        assert "a claim with no test" in str(exc)
    else:
        raise AssertionError("a line without a reference was accepted")
