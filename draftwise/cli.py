"""Command line: ``draftwise generate``, ``draftwise chat``, ``draftwise bench`` (bench/harness.py),
``draftwise agreement`` (bench/agreement.py), ``draftwise info`` (CPU features and kernel path),
``draftwise cache ls|rm`` (models/cache.py),
``draftwise serve`` and ``draftwise bench-serve`` (serve/cli.py).

Every user error (unknown model, bad parameter, prompt too long, ...) is printed as one clear line on
stderr with exit status 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .api import BEAM, DEFAULT_DRAFT, DEFAULT_TARGET, METHODS, tree_options, tree_width_help
from .errors import DraftwiseError, InvalidParameterError
from .serve import cli as serve_cli

LEGEND = "  ([green]accepted draft[/] [bold red]corrected[/] [bold blue]bonus[/] plain)"
COLOURS = {"plain": "", "accepted": "green", "recovered": "bold red", "bonus": "bold blue"}


def _gamma(s: str) -> int | str:
    if s == "auto":
        return s
    try:
        g = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"gamma must be an integer >= 1 or 'auto', got {s!r}") from None
    if g < 1:
        raise argparse.ArgumentTypeError(f"gamma must be >= 1, got {g}")
    return g


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"model name, GGUF file, HF folder or hub id "
                                                             f"(default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model for --method draft (default {DEFAULT_DRAFT})")
    p.add_argument("--heads", default=None, help="draft heads for --method medusa / eagle: a folder from `draftwise train-head`, or "
                        "several separated by commas (each method takes the heads of its kind); default: the "
                        "ones `draftwise train-head` wrote for the target without --out")
    p.add_argument("--dtype", default="auto", choices=["auto", "gguf", "int8", "int4", "bf16", "fp32"],
                   help="weight format: auto (a GGUF keeps its own quantization, exact; else bf16), gguf, "
                        "int8 / int4 (round-to-nearest, groups of 32), bf16, fp32")
    p.add_argument("--draft-dtype", default=None, choices=["auto", "gguf", "int8", "int4", "bf16", "fp32"],
                   help="weight format of the draft model (default: as --dtype); its precision only moves the "
                        "acceptance rate, never the output")
    p.add_argument("--backend", default="native", choices=["native", "hf"],
                   help="native PyTorch Llama/Qwen2 (default) or any HF AutoModelForCausalLM")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--skip-layers", type=_skip_layers, default=None, metavar="LAYERS",
                   help="--method layerskip: the target's layers its drafts skip, e.g. 3,5,7-12 (default: the "
                        "set calibrated once for the target and cached in $DRAFTWISE_HOME/layerskip)")


def _skip_layers(s: str) -> str:
    from .drafters.layerskip import parse_skip_layers

    try:
        parse_skip_layers(s, 1 << 20)  # the syntax now; the range once the target is loaded
    except InvalidParameterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def _sampling_args(p: argparse.ArgumentParser, methods=METHODS) -> None:
    p.add_argument("--method", default="auto", choices=methods,
                   help="drafting method (default auto: per request and step, the best of pld, nasd, suffix "
                        "and the heads given by --heads, or none)")
    p.add_argument("--gamma", type=_gamma, default="auto",
                   help="draft tokens per step, or auto (default): chosen each step from the measured cost of "
                        "verifying k tokens and the running acceptance")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--tree-width", type=serve_cli.positive_int, default=None,
                   help=tree_width_help())
    p.add_argument("--lookahead", type=serve_cli.lookahead_spec, default=None, metavar="W,N,G",
                   help=serve_cli.lookahead_help())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftwise", description="Lossless speculative decoding.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for PROMPT")
    g.add_argument("prompt")
    _model_args(g)
    _sampling_args(g, (*METHODS, BEAM))
    g.add_argument("--num-beams", type=int, default=4, help="beams of --method beam (default 4)")
    g.add_argument("--length-penalty", type=float, default=1.0,
                   help="--method beam: hypotheses score sum_logprobs / len ** L (default 1.0)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--no-color", action="store_true", help="plain text output")
    c = sub.add_parser("chat", help="interactive session (/help inside)")
    _model_args(c)
    _sampling_args(c)
    from .bench.harness import add_arguments as bench_args

    b = sub.add_parser("bench", help="benchmark methods and HF peers on a prompt set; write results.json, "
                                     "report.md and plots")
    _model_args(b)
    bench_args(b)
    from .bench.agreement import add_arguments as agreement_args

    a = sub.add_parser("agreement", help="greedy agreement of weight/activation formats with an fp32 reference")
    a.add_argument("--target", default=DEFAULT_TARGET, help=f"model (default {DEFAULT_TARGET})")
    a.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    agreement_args(a)
    serve_cli.add_parsers(sub, _model_args, METHODS)
    from .train_head import add_arguments as train_head_args

    t = sub.add_parser("train-head", help="train draft heads (Medusa, EAGLE-style) on the target itself, on this CPU")
    t.add_argument("--target", default=DEFAULT_TARGET, help=f"model the heads draft for (default {DEFAULT_TARGET})")
    t.add_argument("--dtype", default="auto", choices=["auto", "gguf", "int8", "int4", "bf16", "fp32"],
                   help="the target's weight format (default auto); use the one you will decode with")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    train_head_args(t)
    i = sub.add_parser("info", help="version, CPU features, the kernel path chosen and whether the kernel built")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    from .models.cache import add_arguments as cache_args

    cache_args(sub.add_parser("cache", help="list (ls) or remove (rm) what draftwise keeps in $DRAFTWISE_HOME"))
    return ap


def _params(args):
    from .sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop))


def render(result, tokenizer, console, colour: bool = True) -> None:
    """Print the output text with each token coloured by how it was produced."""
    from rich.text import Text

    if not colour:
        console.print(result.text, markup=False, highlight=False)
        return
    out = Text()
    tok = tokenizer
    prev = ""
    ids = result.token_ids
    for i in range(len(ids)):
        cur = tok.decode(ids[:i + 1])
        piece = cur[len(prev):] if cur.startswith(prev) else ""
        limit = len(result.text) - len(prev)
        if limit <= 0:
            break
        out.append(piece[:limit], style=COLOURS.get(result.kinds[i], ""))
        prev = cur
    console.print(out)


def summary_line(result) -> str:
    s = result.stats
    return (f"[{result.method}] {s.new_tokens} tokens in {s.wall_s:.2f}s = {s.tokens_per_s:.2f} tok/s | "
            f"α {s.acceptance_rate:.2f} | τ {s.mean_accepted_length:.2f} | "
            f"prefill {s.prefill_s:.2f}s draft {s.draft_s:.2f}s verify {s.verify_s:.2f}s")


def _setup_threads(args) -> None:
    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)


def cmd_generate(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    params = _params(args)  # validate before loading anything
    if args.method == BEAM:
        from .beam import check_beam_params

        check_beam_params(params, args.num_beams, args.length_penalty)
    if not args.prompt:
        raise InvalidParameterError("empty prompt")
    _setup_threads(args)
    from .api import SpeculativeDecoder, uses_draft_model

    dw = SpeculativeDecoder(args.target, args.draft if uses_draft_model(args.method) else None, dtype=args.dtype,
                            draft_dtype=args.draft_dtype, backend=args.backend, progress=not args.json,
                            skip_layers=args.skip_layers)
    result = dw.generate(args.prompt, params, method=args.method, gamma=args.gamma, chat=args.chat,
                         num_beams=args.num_beams, length_penalty=args.length_penalty,
                         drafter_options=tree_options(args.method, args.tree_width, args.heads, args.lookahead))
    if args.json:
        print(json.dumps(result.to_json(), ensure_ascii=False))
        return 0
    console = Console(no_color=args.no_color, highlight=False)
    render(result, dw.tokenizer, console, colour=not args.no_color)
    console.print(f"[dim]{escape(summary_line(result))}[/]{'' if args.no_color else LEGEND}")
    return 0


def cmd_info(args) -> int:
    """What a bug report needs: versions, the CPU's features, the kernel path in use (DRAFTWISE_ISA forces
    a lower one), whether the kernel built (the first call builds it: ~1-2 min once)."""
    import platform

    import torch

    from . import __version__
    from .kernels import kernel_info

    info = {"draftwise": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), **kernel_info()}
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}}  {' '.join(v) if isinstance(v, list) else v}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "chat":
            from .chat import run_chat

            return run_chat(args)
        if args.command == "bench":
            from .bench.harness import cmd_bench

            _setup_threads(args)
            return cmd_bench(args)
        if args.command == "agreement":
            from .bench.agreement import cmd_agreement

            _setup_threads(args)
            return cmd_agreement(args)
        if args.command == "info":
            return cmd_info(args)
        if args.command == "train-head":
            from .train_head import cmd_train_head

            return cmd_train_head(args)
        if args.command == "cache":
            from .models.cache import cmd_cache

            return cmd_cache(args)
        if args.command in serve_cli.COMMANDS:
            return serve_cli.main(args)
    except DraftwiseError as e:
        print(f"draftwise: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
