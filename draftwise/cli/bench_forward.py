"""``draftwise bench-forward``: what verifying costs on this machine (bench/passcost.py)."""

from __future__ import annotations

import argparse

HELP = ("forward cost over T = 1..32 new tokens and prefill tokens/s, draftwise's kernel and (--llama) "
        "llama.cpp on the same GGUF")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..bench.passcost import add_arguments as passcost_arguments

    passcost_arguments(p)


def run(args) -> int:
    from ..bench.passcost import cmd

    return cmd(args)
