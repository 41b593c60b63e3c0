"""``draftwise generate PROMPT``: one completion, coloured by how each token was produced (or JSON)."""

from __future__ import annotations

import argparse
import json

from ..api import BEAM, build_decoder, tree_options
from ..drafters import registry
from ..errors import InvalidParameterError
from . import common
from .render import LiveText, print_summary

HELP = "generate a completion for PROMPT"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the text to continue (with --chat: the user's message)")
    common.add_model_args(p)
    common.add_sampling_args(p, (*registry.names(), BEAM))
    p.add_argument("--num-beams", type=int, default=4, help="beams of --method beam (default 4)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="--method beam: hypotheses score sum_logprobs / len ** L (default 1.0)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-color", action="store_true", help="plain text output")


def run(args) -> int:
    from rich.console import Console

    params = common.sampling_params(args)  # validate before loading anything
    if args.method == BEAM:
        from ..beam import check_beam_params

        check_beam_params(params, args.num_beams, args.length_penalty)
    if not args.prompt:
        raise InvalidParameterError("empty prompt")
    common.threads(args)
    dw = build_decoder(common.model_spec(args), method=args.method, progress=not args.json)
    console = Console(no_color=args.no_color, highlight=False, soft_wrap=True)  # the terminal wraps
    live = None if args.json else LiveText(console, colour=not args.no_color)  # the text as it is made
    try:
        result = dw.generate(args.prompt, params, method=args.method, gamma=args.gamma, chat=args.chat,
                             num_beams=args.num_beams, length_penalty=args.length_penalty,
                             drafter_options=tree_options(args.method, args.tree_width, args.heads, args.lookahead),
                             on_text=live)
    finally:  # the line ends, also when Ctrl-C stops the generation
        if live is not None:
            live.end()
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
        return 0
    print_summary(result, console, colour=not args.no_color)
    return 0
