"""``draftwise serve`` and ``draftwise bench-serve``: their arguments and entry points.

``draftwise.cli`` only adds these parsers and dispatches here; FastAPI / uvicorn are imported when a
command runs, so the rest of the CLI works without the ``serve`` extra.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from ..api import tree_options, tree_width_help
from ..errors import DraftwiseError, InvalidParameterError

COMMANDS = ("serve", "bench-serve")


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def lookahead_spec(s: str) -> str:
    """argparse type of ``--lookahead W,N,G`` (checked now, parsed into drafter options by tree_options)."""
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


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {s}")
    return v


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return vals


def _engine_args(p: argparse.ArgumentParser, methods) -> None:
    p.add_argument("--method", default="draft", choices=methods, help="drafting method (default draft); "
                   "requests may also ask for plain decoding ('ar')")
    p.add_argument("--gamma", type=positive_int, default=4, help="largest draft length (default 4)")
    p.add_argument("--gamma-policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive (default): γ in [0, --gamma] maximising measured tokens/s, 0 turns "
                        "speculation off under load; fixed: always --gamma")
    p.add_argument("--kv-cache-mb", type=float, default=2048.0,
                   help="memory for the target + draft KV caches; sets the number of cache rows (default 2048)")
    p.add_argument("--max-batch", type=positive_int, default=16, help="most sequences decoded together (default 16)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context per sequence, prompt + output (default: the model's, at most 4096)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="sequences that may wait for a free row; more are refused with 503 (default 64)")
    p.add_argument("--tree-width", type=positive_int, default=None,
                   help=tree_width_help())
    p.add_argument("--max-prefill-tokens", type=positive_int, default=2048,
                   help="prompt tokens prefilled between two decode steps (default 2048)")
    p.add_argument("--lookahead", type=lookahead_spec, default=None, metavar="W,N,G", help=lookahead_help())


def add_parsers(sub, model_args, methods) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    model_args(s)
    _engine_args(s, methods)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=os.environ.get("DRAFTWISE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $DRAFTWISE_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: --target)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="after SIGTERM / Ctrl-C: new requests get 503 while admitted ones may finish for up "
                        "to this long, then the server exits 0 (default 30); a second signal exits at once")
    r = s.add_argument_group("scale-out (Ray Serve; pip install 'draftwise[ray]')")
    r.add_argument("--replicas", type=positive_int, default=1,
                   help="engine replicas behind one route as a Ray Serve deployment (default 1: this process "
                        "serves alone, no Ray); each replica gets --threads CPUs (default: cores / replicas)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="run the replicas on this running Ray cluster (e.g. auto, ray://head:10001) instead of "
                        "a local Ray instance; implies Ray Serve even with --replicas 1")
    r.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="requests that may wait at Ray Serve's proxy when every replica is busy; more are "
                        "refused with 503 (default: no bound there; each engine still bounds its own queue)")

    b = sub.add_parser("bench-serve", help="load-test the server in-process: requests/s and tokens/s at "
                                           "several concurrencies, with and without speculation")
    model_args(b)
    _engine_args(b, methods)
    b.add_argument("--concurrency", type=_int_list, default=[1, 4, 16], help="comma-separated (default 1,4,16)")
    b.add_argument("--requests", type=positive_int, default=None,
                   help="requests per concurrency level (default: max(4, 2 × concurrency))")
    b.add_argument("--max-tokens", type=positive_int, default=64, help="output tokens per request (default 64)")
    b.add_argument("--modes", default="ar,fixed,adaptive",
                   help="comma-separated: ar (no speculation), fixed (γ = --gamma), adaptive (default: all)")
    b.add_argument("--json", default=None, help="also write the results to this JSON file")
    b.add_argument("--url", default=None, metavar="URL",
                   help="load-test a server already running there (e.g. `serve --replicas 2`) instead of "
                        "starting engines in this process")
    b.add_argument("--served-model-name", default=None, help="with --url: the model id that server expects "
                                                            "(default: --target)")
    k = b.add_argument_group("soak test (--soak MINUTES: mixed traffic checked against alone-runs, RSS sampled)")
    k.add_argument("--soak", type=positive_float, default=None, metavar="MINUTES",
                   help="instead of the throughput table: MINUTES of mixed traffic (greedy, seeded, stop strings, "
                        "per-request methods, dropped streams, bad requests); writes a report with an RSS plot")
    k.add_argument("--soak-clients", type=positive_int, default=12, metavar="N", help="concurrent clients (default 12)")
    k.add_argument("--soak-prompts", type=positive_int, default=8, metavar="N",
                   help="distinct prompts; each checked kind is first run alone on each (default 8)")
    k.add_argument("--soak-idle", type=float, default=60.0, metavar="SECONDS",
                   help="idle time after the load before the last RSS sample (default 60)")
    k.add_argument("--soak-sample", type=positive_float, default=5.0, metavar="SECONDS",
                   help="RSS sampling interval (default 5)")
    k.add_argument("--soak-out", default="soak-report", metavar="DIR",
                   help="folder for report.md, report.json and rss.png (default ./soak-report)")


def main(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("draftwise: error: the server needs the serve extra: pip install 'draftwise[serve]'", file=sys.stderr)
        return 2
    if args.command == "serve":
        return cmd_serve(args)
    from .bench import cmd_bench_serve

    return cmd_bench_serve(args)


def engine_config(args):
    from .engine import EngineConfig

    if args.max_queue < 0:
        raise InvalidParameterError(f"--max-queue must be >= 0, got {args.max_queue}")
    return EngineConfig(method=args.method, gamma=args.gamma, gamma_policy=args.gamma_policy,
                        kv_cache_mb=args.kv_cache_mb, max_batch=args.max_batch, max_model_len=args.max_model_len,
                        max_queue=args.max_queue, max_prefill_tokens=args.max_prefill_tokens,
                        drafter_options=tree_options(args.method, args.tree_width, args.heads, args.lookahead))


def load(args, method: str):
    from ..api import SpeculativeDecoder, uses_draft_model
    from ..cli import _setup_threads

    _setup_threads(args)
    return SpeculativeDecoder(args.target, args.draft if uses_draft_model(method) else None, dtype=args.dtype,
                              draft_dtype=args.draft_dtype, backend=args.backend, skip_layers=args.skip_layers)


def cmd_serve(args) -> int:
    from .engine import Engine
    from .server import run_server

    cfg = engine_config(args)
    cfg.validate()  # before loading anything
    if not args.shutdown_timeout >= 0:
        raise InvalidParameterError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout:g}")
    if not _is_loopback(args.host) and not args.api_key:
        print(f"draftwise: warning: serving on {args.host} without --api-key: anyone who can reach this "
              "address can use the server", file=sys.stderr)
    if args.replicas > 1 or args.ray_address:
        from .ray_serve import cmd_serve_ray

        return cmd_serve_ray(args)
    dw = load(args, cfg.method)
    engine = Engine(dw, cfg)
    name = args.served_model_name or args.target
    print(f"draftwise: serving {name!r} (method {cfg.method}, γ ≤ {cfg.gamma} {cfg.gamma_policy}) on "
          f"http://{args.host}:{args.port}/v1 — {engine.rows} cache rows × {engine.max_model_len} tokens "
          f"({engine.rows * engine.row_bytes / 2**20:.0f} MiB KV), queue {cfg.max_queue}", file=sys.stderr)
    try:
        return run_server(engine, name, args.host, args.port, args.api_key, args.log_level, args.shutdown_timeout)
    except OSError as e:  # port in use, address not available
        raise DraftwiseError(f"cannot serve on {args.host}:{args.port}: {e.strerror or e}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
