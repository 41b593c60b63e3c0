"""``draftwise serve`` and ``draftwise bench-serve``: their options and entry points. FastAPI / uvicorn
are imported when a command runs, so the rest of the CLI works without the ``serve`` extra."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from .. import settings
from ..api import build_decoder
from ..drafters import registry
from ..errors import DraftwiseError, InvalidParameterError
from . import common

COMMANDS = ("serve", "bench-serve")
SERVE_HELP = "OpenAI-compatible HTTP server with continuous batching"
BENCH_HELP = "load-test the server in-process: requests/s and tokens/s at several concurrencies, with and without speculation"


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default=common.SERVE_DEFAULT_METHOD, choices=registry.names(),
                   help=f"drafting method (default {common.SERVE_DEFAULT_METHOD}); requests may also ask for "
                        "plain decoding ('ar')")
    p.add_argument("--gamma", type=common.positive_int, default=4, help="largest draft length (default 4)")
    p.add_argument("--gamma-policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive (default): γ in [0, --gamma] maximising measured tokens/s, 0 turns "
                        "speculation off under load; fixed: always --gamma")
    p.add_argument("--kv-cache-mb", type=float, default=2048.0,
                   help="memory for the target + draft KV caches; sets the number of cache rows (default 2048)")
    p.add_argument("--max-batch", type=common.positive_int, default=16, help="most sequences decoded together (default 16)")
    p.add_argument("--max-model-len", type=common.positive_int, default=None,
                   help="context per sequence, prompt + output (default: the model's, at most 4096)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="sequences that may wait for a free row; more are refused with 503 (default 64)")
    p.add_argument("--max-prefill-tokens", type=common.positive_int, default=256,
                   help="prompt tokens prefilled between two decode steps, beside those the prefix cache holds; "
                        "a longer prompt goes on after the next step, so running requests keep streaming "
                        "(default 256)")
    common.add_tree_args(p)


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    common.add_model_args(s)
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0: any free one, printed)")
    s.add_argument("--api-key", default=settings.api_key(),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $DRAFTWISE_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: --target)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="after SIGTERM / Ctrl-C: new requests get 503 while admitted ones may finish for up "
                        "to this long, then the server exits 0 (default 30); a second signal exits at once")
    r = s.add_argument_group("scale-out (Ray Serve; pip install 'draftwise[ray]')")
    r.add_argument("--replicas", type=common.positive_int, default=1,
                   help="engine replicas behind one route as a Ray Serve deployment (default 1: this process "
                        "serves alone, no Ray); each replica gets --threads CPUs (default: usable cores / replicas)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="run the replicas on this running Ray cluster (e.g. auto, ray://head:10001) instead of "
                        "a local Ray instance; implies Ray Serve even with --replicas 1")
    r.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                   help="requests that may wait at Ray Serve's proxy when every replica is busy; more are "
                        "refused with 503 (default: no bound there; each engine still bounds its own queue)")


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    common.add_model_args(b, 0, ": the modes and levels run the same prompts, which a cache would favour the later "
                                "of", disk=False)
    _engine_args(b)
    b.add_argument("--concurrency", type=common.int_list, default=[1, 4, 16], help="comma-separated (default 1,4,16)")
    b.add_argument("--requests", type=common.positive_int, default=None,
                   help="requests per concurrency level (default: max(4, 2 × concurrency))")
    b.add_argument("--max-tokens", type=common.positive_int, default=64, help="output tokens per request (default 64)")
    b.add_argument("--modes", default="ar,fixed,adaptive",
                   help="comma-separated: ar (no speculation), fixed (γ = --gamma), adaptive (default: all)")
    b.add_argument("--json", default=None, help="also write the results to this JSON file")
    b.add_argument("--url", default=None, metavar="URL",
                   help="load-test a server already running there (e.g. `serve --replicas 2`) instead of "
                        "starting engines in this process")
    b.add_argument("--served-model-name", default=None, help="with --url: the model id that server expects "
                                                            "(default: --target)")
    k = b.add_argument_group("soak test (--soak MINUTES: mixed traffic checked against alone-runs, RSS sampled)")
    k.add_argument("--soak", type=common.positive_float, default=None, metavar="MINUTES",
                   help="instead of the throughput table: MINUTES of mixed traffic (greedy, seeded, stop strings, "
                        "per-request methods, dropped streams, bad requests); writes a report with an RSS plot")
    k.add_argument("--soak-clients", type=common.positive_int, default=12, metavar="N", help="concurrent clients (default 12)")
    k.add_argument("--soak-prompts", type=common.positive_int, default=8, metavar="N",
                   help="distinct prompts; each checked kind is first run alone on each (default 8)")
    k.add_argument("--soak-idle", type=float, default=60.0, metavar="SECONDS",
                   help="idle time after the load before the last RSS sample (default 60)")
    k.add_argument("--soak-sample", type=common.positive_float, default=5.0, metavar="SECONDS",
                   help="RSS sampling interval (default 5)")
    k.add_argument("--soak-out", default="soak-report", metavar="DIR",
                   help="folder for report.md, report.json and rss.png (default ./soak-report)")


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("draftwise: error: the server needs the serve extra: pip install 'draftwise[serve]'", file=sys.stderr)
        return 2
    if args.command == "serve":
        return cmd_serve(args)
    from ..serve.bench import cmd_bench_serve

    return cmd_bench_serve(args)


def cmd_serve(args) -> int:
    import torch

    from ..memory import freeze_heap
    from ..serve.engine import Engine, engine_config
    from ..serve.server import listen_socket, run_server

    cfg = engine_config(args)
    cfg.validate()  # before loading anything
    if not args.shutdown_timeout >= 0:
        raise InvalidParameterError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout:g}")
    if not _is_loopback(args.host) and not args.api_key:
        print(f"draftwise: warning: serving on {args.host} without --api-key: anyone who can reach this "
              "address can use the server", file=sys.stderr)
    if args.replicas > 1 or args.ray_address:
        from ..serve.ray_serve import cmd_serve_ray

        return cmd_serve_ray(args)
    common.threads(args)
    sock = listen_socket(args.host, args.port)  # before the load: a port in use is said at once, not minutes later
    try:
        dw = build_decoder(common.model_spec(args), method=cfg.method)
        engine = Engine(dw, cfg)
        freeze_heap()  # torch, the models, the tokenizers: never walked by the collections serving triggers
        name = args.served_model_name or args.target
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        print(f"draftwise: serving {name!r} (method {cfg.method}, γ ≤ {cfg.gamma} {cfg.gamma_policy}) on "
              f"{url} — {engine.rows} cache rows × {engine.max_model_len} tokens "
              f"({engine.rows * engine.row_bytes / 2**20:.0f} MiB KV), queue {cfg.max_queue}, "
              f"{torch.get_num_threads()} threads", file=sys.stderr)
        try:
            return run_server(engine, name, sock, args.api_key, args.log_level, args.shutdown_timeout)
        except OSError as e:
            raise DraftwiseError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    finally:
        sock.close()


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, got {text!r}")
    return port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_app(args: dict):
    """Application builder for Ray's own CLI and config files::

        serve run draftwise.cli.serve:build_app target=smollm2-135m-instruct method=pld replicas=2

    Keys are ``draftwise serve``'s options without the dashes (``max-batch=8`` or ``max_batch=8``)."""
    from ..serve.ray_serve import deployment, spec_from_args

    argv = []
    for k, v in args.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    p = argparse.ArgumentParser(prog="draftwise serve")
    add_serve_arguments(p)
    return deployment(spec_from_args(p.parse_args(argv)))
