"""Every example in docs/api.md runs: the fast ones on tiny random models, the real-weight ones (their
first line names the model) with the slow tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
REAL = "# model: "


def _case(i: int, code: str):
    title = code.splitlines()[0][:40] if code.startswith("#") else f"example {i}"
    marks = [pytest.mark.slow] if code.startswith(REAL) else []
    return pytest.param(code, id=f"{i}-{re.sub(r'[^a-z0-9]+', '-', title.lower()).strip('-')}", marks=marks)


def test_the_reference_has_examples():
    assert len(BLOCKS) >= 12 and sum(b.startswith(REAL) for b in BLOCKS) >= 3


@pytest.mark.parametrize("code", [_case(i, b) for i, b in enumerate(BLOCKS)])
def test_api_example_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(DOC), "exec"), {"__name__": "__api_doc__"})
