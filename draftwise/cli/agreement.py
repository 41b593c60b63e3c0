"""``draftwise agreement``: greedy agreement of weight / activation formats with an fp32 reference
(bench/agreement.py)."""

from __future__ import annotations

import argparse

from ..bench import agreement
from . import common

HELP = "greedy agreement of weight/activation formats with an fp32 reference"


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_target_arg(p)
    common.add_threads_arg(p)
    agreement.add_arguments(p)


def run(args) -> int:
    common.threads(args)
    return agreement.cmd_agreement(args)
