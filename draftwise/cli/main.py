"""``draftwise COMMAND``: the table of commands, the parser built from it, and the one place user errors
become a line on stderr.

Every user error (unknown model, bad parameter, prompt too long, ...) is printed as one clear line on
stderr with exit status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

from ..errors import DraftwiseError
from . import agreement, bench, bench_forward, cache, chat, generate, info, serve, train_head


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS = (
    Command("generate", generate.HELP, generate.add_arguments, generate.run),
    Command("chat", chat.COMMAND_HELP, chat.add_arguments, chat.run),
    Command("bench", bench.HELP, bench.add_arguments, bench.run),
    Command("bench-forward", bench_forward.HELP, bench_forward.add_arguments, bench_forward.run),
    Command("agreement", agreement.HELP, agreement.add_arguments, agreement.run),
    Command("serve", serve.SERVE_HELP, serve.add_serve_arguments, serve.run),
    Command("bench-serve", serve.BENCH_HELP, serve.add_bench_arguments, serve.run),
    Command("train-head", train_head.HELP, train_head.add_arguments, train_head.run),
    Command("info", info.HELP, info.add_arguments, info.run),
    Command("cache", cache.HELP, cache.add_arguments, cache.run),
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftwise", description="Lossless speculative decoding.")
    sub = ap.add_subparsers(dest="command", required=True)
    for c in COMMANDS:
        c.add_arguments(sub.add_parser(c.name, help=c.help))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = next(c for c in COMMANDS if c.name == args.command)
    try:
        return command.run(args)
    except DraftwiseError as e:
        print(f"draftwise: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
