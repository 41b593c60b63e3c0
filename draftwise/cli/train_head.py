"""``draftwise train-head``: train draft heads (Medusa, EAGLE-style) on the target itself (train_head.py)."""

from __future__ import annotations

import argparse

from .. import train_head
from . import common

HELP = "train draft heads (Medusa, EAGLE-style) on the target itself, on this CPU"


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_target_arg(p, "model the heads draft for")
    p.add_argument("--dtype", default="auto", choices=common.WEIGHT_FORMATS,
                   help="the target's weight format (default auto); use the one you will decode with")
    common.add_threads_arg(p)
    train_head.add_arguments(p)


def run(args) -> int:
    return train_head.cmd_train_head(args)  # sets the threads after checking the options
