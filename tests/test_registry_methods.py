"""The method registry: one table that the library, server, bench and CLI read; the docs' example drafter
is added with one file and one registration line, and every front end then offers it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from draftwise.api import METHODS, SpeculativeDecoder, tree_options
from draftwise.drafters import registry
from draftwise.errors import InvalidParameterError
from draftwise.sampling import SamplingParams

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding-a-drafter.md"


def test_builtin_table():
    ms = registry.methods()
    assert list(ms)[0] == "ar" and tuple(ms) == METHODS
    assert registry.names(seq2seq=True) == ("ar", "draft", "pld", "nasd")
    assert [n for n, m in ms.items() if m.heads] == ["medusa", "eagle"]
    assert [n for n, m in ms.items() if m.auto_child] == ["pld", "nasd", "suffix"]
    assert [n for n, m in ms.items() if m.draft_model] == ["draft", "draft-tree"]
    assert ms["pld-tree"].tree and not ms["pld"].tree and ms["auto"].own_gamma == 8
    assert ms["lookahead"].own_gamma == 31
    with pytest.raises(InvalidParameterError, match="unknown method 'nope'; choose one of ar, draft"):
        registry.get("nope")
    with pytest.raises(ValueError, match="registered already"):
        registry.register(registry.Method("pld", lambda *a, **k: None))


def test_drafter_options_per_method():
    assert tree_options("pld-tree", None) == {"branches": 3} and tree_options("pld", 5) == {}
    assert tree_options("suffix", 4) == {"max_nodes": 4}
    assert tree_options("medusa", 2, "h") == {"branches": 2, "heads": "h"} and tree_options("eagle", None) == {}
    assert tree_options("auto", 2, "h") == {"heads": "h"}
    assert tree_options("lookahead", 5, None, "2,2,0") == {"window": 2, "ngram": 2, "guesses": 0}


@pytest.fixture
def echo(tmp_path, monkeypatch):
    """The docs' example drafter, saved as its own module and imported (its one register line runs)."""
    registry.methods()  # the built-in ones first
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))  # forgotten after the test
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    assert len(code.strip().splitlines()) <= 30 and code.count("register(") == 1
    path = tmp_path / "echo_drafter.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("echo_drafter", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_example_drafter(echo, hf_folder):
    assert "echo" in registry.names() and "echo" in registry.names(seq2seq=True)
    assert list(registry.methods())[-1] == "echo"  # after the built-in ones
    dw = SpeculativeDecoder(str(hf_folder), None, dtype="bf16", progress=False)
    prompt = dw.encode("abc abc abc abc abc abc abc abc")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = dw.generate(prompt, params, method="ar")
    for gamma in (3, "auto"):
        out = dw.generate(prompt, params, method="echo", gamma=gamma)
        assert out.token_ids == ref.token_ids and out.stats.drafted > 0
    auto = dw.generate(prompt, params, method="auto", drafter_options={"methods": ["echo", "pld"]})
    assert auto.token_ids == ref.token_ids
    # the command line and the server offer it too
    from draftwise.cli import build_parser
    from draftwise.serve.engine import EngineConfig

    args = build_parser().parse_args(["generate", "x", "--method", "echo"])
    assert args.method == "echo"
    EngineConfig(method="echo").validate()
