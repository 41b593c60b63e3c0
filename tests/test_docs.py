"""The README and docs/ stay usable: the README is short, every docs page is reachable from the index,
every relative link (and #anchor) resolves, no path of a development machine or talk about how the work
was organised appears, and every `draftwise ...` command in a code block parses with the CLI's own parser
(its subcommand and every flag exist, values of the right type)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from draftwise.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
WRITTEN = [p for p in PAGES if p.name != "report.md"]  # report.md files are written by `draftwise bench`
README_MAX_LINES = 300

DEV_PATHS = re.compile(r"(?<![\w.~])/(?:work|root|tmp|home/\w+)/|\.\./shared/")
PROCESS_TALK = re.compile(r"\b(?:this|last|next|earlier|later|previous|one|another) session\b|\bsessions\b|"
                          r"\bthe issue(?:'s)?\b|\bnot met\b|[:(] ?met\b|\bmet / not met\b|\bscorecard\b|"
                          r"\bthe lead\b|\bhelper [A-D]\b", re.IGNORECASE)


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, '-', '_', spaces
    kept), spaces to '-'."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def code_blocks(page: Path) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def draftwise_commands(block: str) -> list[str]:
    """`draftwise ...` command lines of a code block: `\\` continuations joined, `&&` / `;` / `|` chains
    split, `VAR=value` prefixes dropped; in a block that shows a session (`$ ` prompts), only the prompted
    lines (the rest is output)."""
    joined = re.sub(r"\s*\\\n\s*", " ", block)
    lines = [line.strip() for line in joined.splitlines()]
    if any(line.startswith("$ ") for line in lines):
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    out = []
    for line in lines:
        for part in re.split(r"\s*(?:&&|;|\|\|?)\s*", line):
            part = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", part.strip())  # VAR=value prefixes
            if part.startswith("draftwise "):
                out.append(part)
    return out


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: move detail to docs/)"


def test_every_docs_page_is_linked_from_the_index():
    index = DOCS / "README.md"
    linked = {(index.parent / link.split("#")[0]).resolve() for link in links(index) if not link.startswith("http")}
    pages = [p for p in DOCS.glob("*.md") if p != index] + [DOCS / "results" / "README.md"]
    missing = [rel(p) for p in pages if p.resolve() not in linked]
    assert not missing, f"not linked from docs/README.md: {missing}"
    assert index.resolve() in {(ROOT / link.split("#")[0]).resolve() for link in links(ROOT / "README.md")}


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_links_resolve(page):
    bad = []
    for link in links(page):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            bad.append(f"{link} (no heading with that anchor in {rel(target)})")
    assert not bad, f"{rel(page)}: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_development_paths_or_process_talk(page):
    hits = []
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        for rx, what in ((DEV_PATHS, "development path"), (PROCESS_TALK, "process talk")):
            m = rx.search(line)
            if m:
                hits.append(f"{rel(page)}:{n}: {what} {m.group(0)!r}")
    assert not hits, "\n".join(hits)


def test_results_carry_no_development_paths():
    hits = [rel(p) for p in DOCS.rglob("*.json") if DEV_PATHS.search(p.read_text(encoding="utf-8"))]
    assert not hits, hits


COMMANDS = [(rel(p), c) for p in PAGES for b in code_blocks(p) for c in draftwise_commands(b)]


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 40
    assert any(c.startswith("draftwise generate") for _, c in COMMANDS if _ == "README.md")


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_documented_command_parses(page, command, capsys):
    argv = shlex.split(command, comments=True)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{page}: `{command}` does not parse (exit {e.code}): {capsys.readouterr().err.strip()}")


@pytest.mark.parametrize("command,ok", [
    ("draftwise generate hi --method auto", True),
    ("draftwise generate hi --no-such-flag", False),
    ("draftwise nosuchcommand", False),
    ("draftwise generate hi --gamma zero", False),
])
def test_the_command_check_can_fail(command, ok):
    try:
        build_parser().parse_args(shlex.split(command)[1:])
        parsed = True
    except SystemExit:
        parsed = False
    assert parsed is ok


def test_command_extraction():
    block = "./install.sh --peers && draftwise bench \\\n    --limit 2\nFOO=1 draftwise chat   # x86\n"
    assert draftwise_commands(block) == ["draftwise bench --limit 2", "draftwise chat   # x86"]
    assert draftwise_commands("$ draftwise info\ndraftwise       0.1.0\n") == ["draftwise info"]
    assert slug("`auto`: choosing per request and step") == "auto-choosing-per-request-and-step"
    assert DEV_PATHS.search("from `/work/shared/x`") and not DEV_PATHS.search("~/models/a.gguf")
    assert PROCESS_TALK.search("measured in a later session") and PROCESS_TALK.search("the issue's target")
    assert not PROCESS_TALK.search("an interactive session (/help inside)")
