"""What the commands share: argument types, the model / sampling / γ option groups, the defaults (one
place each), thread set-up and the model spec built from the options."""

from __future__ import annotations

import argparse

from ..api import DEFAULT_DRAFT, DEFAULT_TARGET, THREADS_HELP, ModelSpec, setup_threads, tree_width_help
from ..drafters import registry
from ..errors import InvalidParameterError
from ..gamma import parse_gamma
from ..prefix import BLOCK, DEFAULT_PREFIX_CACHE_DISK_MB, DEFAULT_PREFIX_CACHE_MB

DEFAULT_METHOD = "auto"  # --method of generate and chat
SERVE_DEFAULT_METHOD = "auto"  # --method of serve and bench-serve
WEIGHT_FORMATS = ["auto", "gguf", "int8", "int4", "bf16", "fp32"]


# ---- argument types: a bad value is one line from argparse, exit status 2 --------------------------------
def gamma_arg(s: str) -> int | str:
    """``--gamma``: an integer >= 1 or auto."""
    try:
        return parse_gamma(s)
    except InvalidParameterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _float_arg(s: str, ok, what: str) -> float:
    """``s`` as a float for which ``ok`` holds, else argparse's one-line error naming ``what`` it must be."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"expected a number {what}, got {s}")
    return v


def positive_float(s: str) -> float:
    return _float_arg(s, lambda v: v > 0, "> 0")


def non_negative_float(s: str) -> float:
    """A finite number >= 0 (a MiB budget)."""
    return _float_arg(s, lambda v: 0 <= v < float("inf"), ">= 0")


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return vals


def lookahead_spec(s: str) -> str:
    """``--lookahead W,N,G`` (checked now, parsed into drafter options by ``tree_options``)."""
    from ..drafters.lookahead import parse_lookahead

    try:
        parse_lookahead(s)
    except InvalidParameterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def lookahead_help() -> str:
    from ..drafters.lookahead import GUESSES, NGRAM, WINDOW

    return (f"--method lookahead: Jacobi window W, n-gram size N, n-grams verified per step G (default "
            f"{WINDOW},{NGRAM},{GUESSES}); a step feeds (W+G)(N-1) tokens")


def skip_layers_arg(s: str) -> str:
    from ..drafters.layerskip import parse_skip_layers

    try:
        parse_skip_layers(s, 1 << 20)  # the syntax now; the range once the target is loaded
    except InvalidParameterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


# ---- option groups ------------------------------------------------------------------------------------
def add_target_arg(p: argparse.ArgumentParser, help: str = "model") -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"{help} (default {DEFAULT_TARGET})")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)


def add_model_args(p: argparse.ArgumentParser, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                   prefix_why: str = "", disk: bool = True) -> None:
    """The model spec's options (``model_spec``) and --threads; ``prefix_cache_mb``: --prefix-cache-mb's
    default in this command (``prefix_why``: why, when it is not the library's); ``disk``: --prefix-cache-dir
    too (not in the benchmarks, which time every prompt's prefill)."""
    add_target_arg(p, "model name, GGUF file, HF folder or hub id")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model for --method draft (default {DEFAULT_DRAFT})")
    p.add_argument("--heads", default=None, help="draft heads for --method medusa / eagle: a folder from `draftwise train-head`, or "
                        "several separated by commas (each method takes the heads of its kind); default: the "
                        "ones `draftwise train-head` wrote for the target without --out")
    p.add_argument("--dtype", default="auto", choices=WEIGHT_FORMATS,
                   help="weight format: auto (a GGUF keeps its own quantization, exact; else bf16), gguf, "
                        "int8 / int4 (round-to-nearest, groups of 32), bf16, fp32")
    p.add_argument("--draft-dtype", default=None, choices=WEIGHT_FORMATS,
                   help="weight format of the draft model (default: int4 when the target runs quantized on the "
                        "native backend, else as --dtype); its precision only moves the acceptance rate, never "
                        "the output")
    p.add_argument("--backend", default="native", choices=["native", "hf"],
                   help="native PyTorch Llama/Qwen2 (default) or any HF AutoModelForCausalLM")
    add_threads_arg(p)
    p.add_argument("--skip-layers", type=skip_layers_arg, default=None, metavar="LAYERS",
                   help="--method layerskip: the target's layers its drafts skip, e.g. 3,5,7-12 (default: the "
                        "set calibrated once for the target and cached in $DRAFTWISE_HOME/layerskip)")
    p.add_argument("--prefix-cache-mb", type=non_negative_float, default=prefix_cache_mb, metavar="MB",
                   help=f"MiB of prompt keys and values each model keeps, so that a later prompt starting with "
                        f"the same {BLOCK}-token blocks (a chat's history, a shared system prompt) skips "
                        f"their prefill; the output is the same bits either way; 0 turns it off (default "
                        f"{prefix_cache_mb:g}{prefix_why})")
    if not disk:
        return
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="also keep the prefix cache's blocks in this folder (a sub-folder per model, weight format "
                        "and kernel build), so that a later run or a restarted server reads a prompt it has seen "
                        "instead of computing it (default: memory only)")
    p.add_argument("--prefix-cache-disk-mb", type=positive_float, default=DEFAULT_PREFIX_CACHE_DISK_MB, metavar="MB",
                   help=f"MiB of block files each model keeps in --prefix-cache-dir, least recently used first out "
                        f"(default {DEFAULT_PREFIX_CACHE_DISK_MB})")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """--tree-width and --lookahead: the drafter options every command takes (``tree_options``)."""
    p.add_argument("--tree-width", type=positive_int, default=None, help=tree_width_help())
    p.add_argument("--lookahead", type=lookahead_spec, default=None, metavar="W,N,G", help=lookahead_help())


SEED_HELP = ("a sampled text becomes a function of the seed: every method and gamma give ar's text with it "
             "(default: none, a fresh draw each run)")


def add_sampling_args(p: argparse.ArgumentParser, methods: tuple[str, ...] | None = None) -> None:
    """--method (the registered methods, or ``methods``), --gamma, the sampling parameters, the tree options."""
    p.add_argument("--method", default=DEFAULT_METHOD, choices=methods or registry.names(),
                   help=f"drafting method (default {DEFAULT_METHOD}: per request and step, the best of pld, nasd, "
                        "suffix and the heads given by --heads, or none)")
    p.add_argument("--gamma", type=gamma_arg, default="auto",
                   help="draft tokens per step, or auto (default): chosen each step from the measured cost of "
                        "verifying k tokens and the running acceptance")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens (default 0: off)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the fewest tokens whose probability reaches P, in (0, 1] (default 1: off)")
    p.add_argument("--seed", type=int, default=None, help=SEED_HELP)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_tree_args(p)


# ---- from options to objects ------------------------------------------------------------------------------
def sampling_params(args):
    """The SamplingParams of the options (checked: a bad value is a clear error before anything loads)."""
    from ..sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop))


def model_spec(args) -> ModelSpec:
    """The model spec of the options (``--target``, ``--draft``, ``--dtype``, ...)."""
    return ModelSpec.from_args(args)


def threads(args) -> None:
    """torch's CPU threads from --threads (default: every core this process may use, ``cpus.usable_cores``)."""
    setup_threads(getattr(args, "threads", None))
