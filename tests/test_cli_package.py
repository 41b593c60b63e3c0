"""The command line as a package: the dependency rule (nothing imports the CLI; the layers below do not
import the ones above), docs/cli.md generated from the parsers, and options every command honours."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_layers import import_graph

ROOT = Path(__file__).resolve().parents[1]
LOW = ("draftwise.models", "draftwise.drafters", "draftwise.decode", "draftwise.sampling", "draftwise.verify",
       "draftwise.sequence", "draftwise.gamma", "draftwise.acceptance", "draftwise.beam", "draftwise.settings",
       "draftwise.digest", "draftwise.errors", "draftwise.kernels")
HIGH = ("draftwise.api", "draftwise.serve", "draftwise.bench", "draftwise.cli")
ALLOWED: set[tuple[str, str]] = set()  # no exceptions


def _in(mod: str, layer: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in layer)


def test_nothing_imports_the_cli():
    g = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in g.items() if not _in(m, ("draftwise.cli",))
                 for d in deps if _in(d, ("draftwise.cli",)))
    assert not bad, bad


def test_layers_point_down():
    """cli -> {serve, bench, api} -> {decode, drafters, models, kernels, ...}: the core never imports the
    front ends, and serve / bench / api never the CLI."""
    g = import_graph()
    bad = sorted(f"{m} -> {d}" for m, deps in g.items() if _in(m, LOW) for d in deps
                 if _in(d, HIGH) and (m, d) not in ALLOWED)
    assert not bad, bad


def test_no_import_circles_between_packages():
    """No two of the package's parts import each other (lazily either), but the allow-listed edge."""
    g = import_graph()

    def part(m: str) -> str:
        return ".".join(m.split(".")[:2])

    edges = {(part(m), part(d)) for m, deps in g.items() for d in deps if part(m) != part(d)}
    edges -= {(part(a), part(b)) for a, b in ALLOWED}
    both = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert not both, both


def test_docs_cli_reference_matches_the_parsers():
    from draftwise.cli.reference import markdown

    doc = ROOT / "docs" / "cli.md"
    assert doc.read_text() == markdown(), "regenerate: python -m draftwise.cli.reference > docs/cli.md"


def test_chat_honours_draft_dtype(hf_folder, monkeypatch):
    """``draftwise chat --draft-dtype`` reaches the decoder (it used to be dropped)."""
    from draftwise.cli import chat, main

    seen = {}

    def loop(self, stdin=None):
        seen["dw"] = self.dw
        return 0

    monkeypatch.setattr(chat.ChatSession, "loop", loop)
    assert main(["chat", "--target", str(hf_folder), "--draft", str(hf_folder), "--dtype", "bf16",
                 "--draft-dtype", "fp32", "--threads", "1"]) == 0
    dw = seen["dw"]
    assert dw.draft_dtype == "fp32" and dw.target.weights == "bf16" and dw.draft.weights == "fp32"


@pytest.mark.parametrize("argv", [["generate", "x"], ["chat"], ["bench"], ["serve"], ["bench-serve"]])
def test_model_options_are_one_spec(argv):
    """Every command that loads a decoder takes the same model options and builds one ModelSpec."""
    from draftwise.api import ModelSpec
    from draftwise.cli import build_parser
    from draftwise.cli.common import model_spec
    from draftwise.prefix import DEFAULT_PREFIX_CACHE_MB

    args = build_parser().parse_args([*argv, "--target", "t", "--draft", "d", "--dtype", "int8", "--draft-dtype",
                                      "int4", "--backend", "hf", "--skip-layers", "1,2", "--heads", "h",
                                      "--prefix-cache-mb", "64"])
    assert model_spec(args) == ModelSpec("t", "d", "int8", "int4", "hf", "1,2", "h", 64)
    # the benchmarks keep none by default: every method (and mode) prefills its prompts, as the peers do
    default = model_spec(build_parser().parse_args(argv)).prefix_cache_mb
    assert default == (0 if argv[0].startswith("bench") else DEFAULT_PREFIX_CACHE_MB)
    assert model_spec(args).for_method("pld").draft is None and model_spec(args).for_method("draft").draft == "d"
