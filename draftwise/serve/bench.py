"""``draftwise bench-serve``: load-test the HTTP server in-process.

For each mode (``ar``: no speculation; ``fixed``: γ = --gamma every step; ``adaptive``: the adaptive γ
policy) an engine + server is started on a free loopback port (the models are loaded once and shared)
and warmed up with one request; then for each concurrency level C and each mode, ``--requests`` streaming
chat requests (greedy, ``ignore_eos`` so every request produces exactly ``--max-tokens`` tokens) are sent
by C concurrent clients. Reported: requests/s, output tokens/s, mean latency and time to first token, α, τ
and the share of steps at each γ: the most draft tokens a row had verified in the step (from /metrics;
0 where the drafter proposed nothing, whatever γ the policy asked for).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

from ..api import ModelSpec, build_decoder, setup_threads, uses_draft_model
from ..errors import InvalidParameterError
from .engine import Engine, engine_config, with_overrides
from .server import BackgroundServer

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "Write a haiku about the ocean.",
    "List five fruits and their colours.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer with one sentence.",
    "Give three tips for writing clean code.",
    "Write a SQL query that counts the rows of a table named users.",
    "Describe a cat in one sentence.",
    "Write a bash command that lists all files larger than 1 MB.",
    "Explain recursion to a child.",
    "Write a JavaScript function that reverses an array.",
    "Name three planets of the solar system.",
    "Write a short thank-you note to a teacher.",
    "What does HTTP stand for?",
    "Write a Python class for a 2D point with a distance method.",
]


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    requests: int
    seconds: float
    requests_per_s: float
    tokens_per_s: float
    mean_latency_s: float
    mean_ttft_s: float
    acceptance_rate: float
    mean_accepted_length: float
    gamma_share: dict[str, float]


async def _one(client, url: str, model: str, prompt: str, max_tokens: int, stats: list) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    ext = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request failed: {r.status_code} {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"]["message"])
            if ttft is None and any(c.get("delta", {}).get("content") for c in data.get("choices", [])):
                ttft = time.perf_counter() - t0
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
                ext = data.get("draftwise", {})
    stats.append((time.perf_counter() - t0, ttft or 0.0, tokens, ext))


async def _level(url: str, model: str, concurrency: int, n: int, max_tokens: int) -> tuple[float, list]:
    import httpx

    stats: list = []
    queue = list(range(n))
    async with httpx.AsyncClient(timeout=None) as client:
        async def worker():
            while queue:
                i = queue.pop(0)
                await _one(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens, stats)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, stats


def _gamma_steps(metrics_text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name == "draftwise_steps":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels["gamma"]] = s.value
    return out


def mode_config(cfg, mode: str, levels: list[int]):
    cfg = with_overrides(cfg, method="ar") if mode == "ar" else with_overrides(cfg, gamma_policy=mode)
    return with_overrides(cfg, max_queue=max(cfg.max_queue, max(levels)))  # never a 503 in the benchmark


def run(dw, cfg, modes: list[str], model: str, levels: list[int], requests: int | None, max_tokens: int,
        log=print) -> list[LevelResult]:
    """All modes' servers are up at once (idle engines cost nothing) and each concurrency level runs every
    mode back to back, so a change in machine load between modes distorts the comparison less."""
    import httpx

    servers = {}
    try:
        for mode in modes:
            servers[mode] = BackgroundServer(Engine(dw, mode_config(cfg, mode, levels)), model).start()
            asyncio.run(_level(servers[mode].base_url, model, 1, 1, max_tokens))  # warm-up, not timed
        results = []
        for c in levels:
            n = requests or max(4, 2 * c)
            for mode, srv in servers.items():
                before = _gamma_steps(httpx.get(srv.base_url + "/metrics").text)
                wall, stats = asyncio.run(_level(srv.base_url, model, c, n, max_tokens))
                after = _gamma_steps(httpx.get(srv.base_url + "/metrics").text)
                steps = {g: after.get(g, 0) - before.get(g, 0) for g in after}
                label = "ar" if mode == "ar" else f"{cfg.method} γ {mode}"
                results.append(_summarise(label, c, wall, stats, steps))
                log(_row(results[-1]))
        return results
    finally:
        for srv in servers.values():
            srv.stop()


def _summarise(label: str, concurrency: int, wall: float, stats: list, steps: dict[str, float]) -> LevelResult:
    n = len(stats)
    tokens = sum(s[2] for s in stats)
    drafted = sum(s[3].get("drafted", 0) for s in stats)
    accepted = sum(s[3].get("accepted", 0) for s in stats)
    total_steps = sum(steps.values()) or 1
    return LevelResult(
        mode=label, concurrency=concurrency, requests=n, seconds=round(wall, 3),
        requests_per_s=round(n / wall, 3), tokens_per_s=round(tokens / wall, 2),
        mean_latency_s=round(sum(s[0] for s in stats) / n, 3), mean_ttft_s=round(sum(s[1] for s in stats) / n, 3),
        acceptance_rate=round(accepted / drafted, 3) if drafted else 0.0,
        mean_accepted_length=round(sum(s[3].get("mean_accepted_length", 0.0) for s in stats) / n, 3),
        gamma_share={g: round(v / total_steps, 3) for g, v in sorted(steps.items(), key=lambda x: int(x[0])) if v})


HEADER = (f"{'mode':<22} {'conc':>4} {'reqs':>4} {'req/s':>7} {'tok/s':>8} {'latency':>8} {'ttft':>6} "
          f"{'α':>5} {'τ':>5}  γ share of steps")


def _row(r: LevelResult) -> str:
    share = " ".join(f"{g}:{v:.2f}" for g, v in r.gamma_share.items())
    return (f"{r.mode:<22} {r.concurrency:>4} {r.requests:>4} {r.requests_per_s:>7.2f} {r.tokens_per_s:>8.1f} "
            f"{r.mean_latency_s:>7.2f}s {r.mean_ttft_s:>5.2f}s {r.acceptance_rate:>5.2f} "
            f"{r.mean_accepted_length:>5.2f}  {share}")


def run_url(url: str, model: str, levels: list[int], requests: int | None, max_tokens: int,
            log=print) -> list[LevelResult]:
    """The same load against a server already running (one process, or the replicas of a Ray Serve
    deployment behind its proxy): its own method and policy, no /metrics (a replica's would be partial)."""
    url = url.rstrip("/")
    asyncio.run(_level(url, model, 1, 1, max_tokens))  # warm-up, not timed
    results = []
    for c in levels:
        wall, stats = asyncio.run(_level(url, model, c, requests or max(4, 2 * c), max_tokens))
        results.append(_summarise("server", c, wall, stats, {}))
        log(_row(results[-1]))
    return results


def cmd_bench_serve(args) -> int:
    from ..outputs import out_file

    if args.soak is not None:
        return _soak(args)
    json_out = out_file(args.json, "--json") if args.json else None
    if args.url:
        model = args.served_model_name or args.target
        print(f"bench-serve: {args.url}, model {model}, max_tokens {args.max_tokens}, "
              f"concurrency {','.join(map(str, args.concurrency))}", file=sys.stderr)
        print(HEADER)
        results = run_url(args.url, model, args.concurrency, args.requests, args.max_tokens)
    else:
        results = _bench_in_process(args)
    if json_out is not None:
        with open(json_out, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0


def _bench_in_process(args) -> list[LevelResult]:
    cfg = engine_config(args)
    cfg.validate()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("ar", "fixed", "adaptive")]
    if bad:
        raise InvalidParameterError(f"unknown mode(s) {', '.join(bad)}; choose from ar, fixed, adaptive")
    if cfg.method == "ar":
        modes = ["ar"]
    setup_threads(args.threads)
    dw = build_decoder(ModelSpec.from_args(args), method=cfg.method)
    model = args.target
    print(f"bench-serve: target {args.target}" + (f", draft {args.draft}" if uses_draft_model(cfg.method) else "")
          + f", method {cfg.method}, γ ≤ {cfg.gamma}, max_tokens {args.max_tokens}, "
          f"concurrency {','.join(map(str, args.concurrency))}", file=sys.stderr)
    print(HEADER)
    return run(dw, cfg, modes, model, args.concurrency, args.requests, args.max_tokens)


def _soak(args) -> int:
    """``bench-serve --soak MINUTES``: see ``soak.py``. Exit status 1 when a verdict fails."""
    from .. import settings
    from ..outputs import out_folder
    from .soak import SoakConfig, run_soak

    if not args.soak_idle >= 0:
        raise InvalidParameterError(f"--soak-idle must be >= 0 seconds, got {args.soak_idle:g}")
    scfg = SoakConfig(minutes=args.soak, clients=args.soak_clients, max_tokens=args.max_tokens,
                      prompts=args.soak_prompts, idle_s=args.soak_idle, sample_s=args.soak_sample)
    key = settings.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else None
    out = out_folder(args.soak_out, "--soak-out")  # checked before minutes to hours of soaking
    if args.url:
        model = args.served_model_name or args.target
        result = run_soak(args.url, model, scfg, out, f"soak {args.soak:g} min: {model} at {args.url}", headers,
                          log=_log)
        return 0 if result.ok else 1
    cfg = engine_config(args)
    cfg.validate()
    setup_threads(args.threads)
    dw = build_decoder(ModelSpec.from_args(args), method=cfg.method)
    cfg = with_overrides(cfg, max_queue=max(cfg.max_queue, args.soak_clients))  # a 503 would be a failure
    engine = Engine(dw, cfg)
    title = (f"soak {args.soak:g} min: {args.target}, method {cfg.method}, {args.soak_clients} clients, "
             f"max_tokens {args.max_tokens}, {engine.rows} rows")
    with BackgroundServer(engine, args.target) as srv:
        _log(f"bench-serve --soak: {title} (server in this process, {srv.base_url})")
        result = run_soak(srv.base_url, args.target, scfg, out, title, log=_log)
    return 0 if result.ok else 1


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
