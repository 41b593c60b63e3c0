"""docs/cli.md, generated from the parsers themselves (``python -m draftwise.cli.reference > docs/cli.md``;
tests/test_cli_package.py checks the file matches), so the reference cannot drift from the code."""

from __future__ import annotations

import argparse
import sys

from .. import settings
from .main import COMMANDS, build_parser


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest.upper()}`"
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs == 0:
        return names
    meta = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices else
                              action.dest.upper())
    return f"{names} `{meta}`"


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def markdown() -> str:
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    out = ["# Command-line reference", "",
           "Generated from the parsers by `python -m draftwise.cli.reference` (a test checks that this file",
           "matches them); `draftwise COMMAND --help` prints the same. Every user error is one line on stderr",
           "with exit status 2.", ""]
    out += [f"- [`draftwise {c.name}`](#draftwise-{c.name}): {c.help}" for c in COMMANDS]
    for c in COMMANDS:
        p = sub.choices[c.name]
        out += ["", f"## draftwise {c.name}", "", _cell(c.help) + ".", "", "| option | meaning |", "|---|---|"]
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    out.append(f"| `{name}` | {_cell(sp.description or sp.format_usage().strip())} |")
                continue
            text = _cell(a.help)
            if not text and a.default not in (None, argparse.SUPPRESS, False, []):
                text = f"default {a.default}"
            out.append(f"| {_flags(a)} | {text} |")
    table = settings.__doc__[settings.__doc__.index("| variable"):settings.__doc__.index("\n\n``install.sh``")]
    out += ["", "## Environment variables", "", "Read in `draftwise/settings.py` only.", "", table.strip(), ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown())
