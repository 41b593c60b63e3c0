"""``draftwise bench-serve --soak MINUTES``: hours of mixed traffic in minutes, checked.

Against a server it starts in this process (the model arguments of ``bench-serve``) or a running one
(``--url``), ``--soak-clients`` concurrent clients send, for MINUTES, a mix of:

- ``greedy``: a chat completion at temperature 0;
- ``seeded``: a chat completion sampled at temperature 0.8 / top_p 0.95 with a fixed seed;
- ``stop``: a plain completion (greedy) with stop strings;
- ``method``: the greedy chat request asking for plain decoding (``"draftwise": {"method": "ar"}``), on a
  speculative server only: its answer must be the greedy one;
- ``dropped``: a streaming chat request whose client goes away after three chunks;
- ``bad``: an invalid request (unknown model, negative max_tokens, broken JSON, too many choices), which
  must get a 4xx.

Every answer of the first four kinds is compared with the same request sent alone (before the load, one
at a time): a seed, like greedy decoding, fixes the text whatever the batch, γ or method. Status codes are
counted per kind; the server's resident memory (``draftwise_process_resident_memory_bytes`` from /metrics,
less its prefix cache's ``draftwise_prefix_cache_bytes``: bounded by ``--prefix-cache-mb``, kept while idle)
is sampled every ``--soak-sample`` seconds through a warm-up burst, the load, its wind-down (past the
deadline the clients finish what they sent) and ``--soak-idle`` seconds of idleness after it.

The report (``--soak-out``): ``report.json`` (everything, samples included), ``report.md`` and
``rss.png``. Verdicts: no 5xx and no connection error; every checked answer equal to its alone-run; RSS
flat (moving at most ``FLAT_MB`` from minute 2 — or a third of the run, when shorter — to the end of
the load; measured as drift, the median of the last quarter of the samples minus that of the first,
since a sample may fall inside a step and catch its temporaries); after the idle period RSS within
``BACK_PCT`` % of the warm level (RSS once the warm-up
burst has finished and the server idled). The exit status is 1 when a verdict fails.
"""

from __future__ import annotations

import asyncio
import json
import platform
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ..kernels import cpu_name
from .bench import PROMPTS

FLAT_MB = 50.0  # MiB: RSS may move this much under steady load, after warm-up
BACK_PCT = 5.0  # after the idle period RSS is within this many percent of the warm level
STOPS = ["\n\n", "."]
KINDS = {"greedy": 3, "seeded": 3, "stop": 2, "method": 1, "dropped": 2, "bad": 1}  # relative frequency
CHECKED = ("greedy", "seeded", "stop", "method")


@dataclass
class SoakConfig:
    minutes: float
    clients: int = 12
    max_tokens: int = 32
    prompts: int = 8  # distinct prompts (each kind's alone-runs: one per prompt)
    idle_s: float = 60.0
    sample_s: float = 5.0
    seed: int = 0


@dataclass
class SoakResult:
    config: dict
    server: dict
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> status (or "conn") -> count
    checked: int = 0
    mismatches: list[dict] = field(default_factory=list)
    # {"t", "phase", "rss_mb" (less the prefix cache), "prefix_cache_mb", "open_requests"}
    samples: list[dict] = field(default_factory=list)
    warm_mb: float = 0.0
    verdicts: dict[str, bool] = field(default_factory=dict)
    numbers: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(self.verdicts.values())


def request_for(kind: str, p: int, model: str, max_tokens: int) -> tuple[str, dict | bytes]:
    """(path, JSON body or raw bytes) of request ``kind`` on prompt ``p``."""
    prompt = PROMPTS[p % len(PROMPTS)]
    chat = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    if kind in ("greedy", "method", "dropped"):
        body = {**chat, "temperature": 0}
        if kind == "method":
            body["draftwise"] = {"method": "ar"}
        if kind == "dropped":
            body["stream"] = True
        return "/v1/chat/completions", body
    if kind == "seeded":
        return "/v1/chat/completions", {**chat, "temperature": 0.8, "top_p": 0.95, "seed": 1000 + p}
    if kind == "stop":
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                   "stop": STOPS}
    bad = p % 4  # kind == "bad"
    if bad == 0:
        return "/v1/chat/completions", {**chat, "model": model + "-nonexistent"}
    if bad == 1:
        return "/v1/chat/completions", {**chat, "max_tokens": -1}
    if bad == 2:
        return "/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": '
    return "/v1/completions", {"model": model, "prompt": prompt, "n": 100_000}


def answer_text(kind: str, body: dict) -> str:
    choice = body["choices"][0]
    return choice["text"] if kind == "stop" else choice["message"]["content"]


async def send(client, kind: str, path: str, body) -> tuple[int | str, dict | None]:
    """(status or "conn", JSON answer or None). A ``dropped`` stream reads three chunks and leaves."""
    import httpx

    try:
        if kind == "dropped":
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, None
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if chunks >= 3:
                        break  # leaving the block closes the connection mid-stream
                return r.status_code, None
        if isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = await client.post(path, json=body)
        return r.status_code, (r.json() if r.status_code == 200 else None)
    except httpx.TransportError:
        return "conn", None


async def _metrics(client) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families((await client.get("/metrics")).text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


class Soak:
    def __init__(self, url: str, model: str, cfg: SoakConfig, headers: dict | None = None, log=print):
        self.url, self.model, self.cfg, self.headers, self.log = url.rstrip("/"), model, cfg, headers or {}, log
        self.t0 = time.monotonic()
        self.phase = "start"
        self.result = SoakResult(config=asdict(cfg), server={"url": url, "model": model})
        self.expected: dict[tuple[str, int], str] = {}

    def client(self, **kw):
        import httpx

        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=600,
                                 limits=httpx.Limits(max_connections=self.cfg.clients + 4), **kw)

    async def sample(self, client) -> None:
        m = await _metrics(client)
        rss = m.get("draftwise_process_resident_memory_bytes")
        # the prefix cache fills up to its --prefix-cache-mb and stays while idle, by design: judged apart
        prefix = m.get("draftwise_prefix_cache_bytes") or 0.0
        self.result.samples.append({"t": round(time.monotonic() - self.t0, 2), "phase": self.phase,
                                    "rss_mb": None if rss is None else round((rss - prefix) / 2**20, 2),
                                    "prefix_cache_mb": round(prefix / 2**20, 2),
                                    "open_requests": m.get("draftwise_open_requests")})

    async def sampler(self, stop: asyncio.Event) -> None:
        async with self.client() as c:
            while not stop.is_set():
                try:
                    await self.sample(c)
                except Exception as e:  # noqa: BLE001 — a missed sample is reported, not fatal
                    self.log(f"soak: /metrics sample failed: {type(e).__name__}: {e}")
                try:
                    await asyncio.wait_for(stop.wait(), self.cfg.sample_s)
                except TimeoutError:
                    pass

    def kinds(self, methods: list[str]) -> list[str]:
        return [k for k in KINDS if k != "method" or len(methods) > 1]

    async def alone_runs(self, client, kinds: list[str]) -> None:
        """Each checked kind on each prompt, one request at a time: the answers every later one must equal."""
        for kind in kinds:
            if kind not in CHECKED:
                continue
            for p in range(self.cfg.prompts):
                if kind == "method":  # plain decoding must give the greedy answer: same expected text
                    self.expected[(kind, p)] = self.expected[("greedy", p)]
                    continue
                path, body = request_for(kind, p, self.model, self.cfg.max_tokens)
                status, answer = await send(client, kind, path, body)
                if status != 200:
                    raise RuntimeError(f"soak: the alone-run of {kind} on prompt {p} failed with {status}")
                self.expected[(kind, p)] = answer_text(kind, answer)

    async def worker(self, client, i: int, kinds: list[str], deadline: float) -> None:
        rng = random.Random(self.cfg.seed * 1000 + i)
        weights = [KINDS[k] for k in kinds]
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            p = rng.randrange(self.cfg.prompts)
            path, body = request_for(kind, p, self.model, self.cfg.max_tokens)
            status, answer = await send(client, kind, path, body)
            self.result.statuses.setdefault(kind, Counter())[str(status)] += 1
            if kind in CHECKED and status == 200:
                self.result.checked += 1
                got, want = answer_text(kind, answer), self.expected[(kind, p)]
                if got != want:
                    self.result.mismatches.append({"kind": kind, "prompt": p, "expected": want, "got": got,
                                                   "t": round(time.monotonic() - self.t0, 1)})

    async def run(self) -> SoakResult:
        cfg = self.cfg
        async with self.client() as c:
            info = (await c.get("/v1/models")).json()["data"][0]
            methods = info.get("draftwise", {}).get("methods", ["ar"])
            self.result.server["methods"] = methods
            kinds = self.kinds(methods)
            self.log(f"soak: alone-runs of {len(CHECKED)} kinds × {cfg.prompts} prompts ...")
            self.phase = "alone-runs"
            await self.alone_runs(c, kinds)
            stop = asyncio.Event()
            sampler = asyncio.create_task(self.sampler(stop))
            self.phase = "warm-up"  # one request per client at once: every batch size is touched
            await asyncio.gather(*(send(c, "greedy", *request_for("greedy", i, self.model, cfg.max_tokens))
                                   for i in range(cfg.clients)))
            await self._wait_idle(c)
            await asyncio.sleep(2.0)  # the engine trims malloc as it goes idle
            await self.sample(c)
            self.result.warm_mb = self.result.samples[-1]["rss_mb"] or 0.0
            self.load_t0 = time.monotonic() - self.t0
            self.phase = "load"
            self.log(f"soak: warm RSS {self.result.warm_mb:.0f} MiB; {cfg.clients} clients for {cfg.minutes:g} min ...")
            deadline = time.monotonic() + cfg.minutes * 60
            self.load_t1 = self.load_t0 + cfg.minutes * 60
            # past the deadline the clients only finish what they sent: not steady load any more
            asyncio.get_running_loop().call_later(cfg.minutes * 60, setattr, self, "phase", "wind-down")
            await asyncio.gather(*(self.worker(c, i, kinds, deadline) for i in range(cfg.clients)))
            self.phase = "wind-down"
            await self.sample(c)
            self.phase = "idle"
            self.log(f"soak: load over; idle for {cfg.idle_s:g} s ...")
            await self._wait_idle(c)
            await asyncio.sleep(cfg.idle_s)
            await self.sample(c)
            stop.set()
            await sampler
        self.judge()
        return self.result

    async def _wait_idle(self, client, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not (await _metrics(client)).get("draftwise_open_requests"):
                return
            await asyncio.sleep(0.2)

    def judge(self) -> None:
        r = self.result
        statuses = {k: dict(v) for k, v in r.statuses.items()}
        r.statuses = statuses

        def count(pred) -> int:
            return sum(n for by in statuses.values() for s, n in by.items() if pred(s))

        r.numbers["requests"] = count(lambda s: True)
        r.numbers["5xx"] = count(lambda s: s.isdigit() and int(s) >= 500)
        r.numbers["connection_errors"] = count(lambda s: s == "conn")
        bad = statuses.get("bad", {})
        r.numbers["bad_not_4xx"] = sum(n for s, n in bad.items() if not (s.isdigit() and 400 <= int(s) < 500))
        r.numbers["checked"] = r.checked
        r.numbers["mismatches"] = len(r.mismatches)
        load = [s for s in r.samples if s["phase"] == "load" and s["rss_mb"] is not None]
        flat_from = self.load_t0 + min(120.0, (self.load_t1 - self.load_t0) / 3)
        steady = [s["rss_mb"] for s in load if s["t"] >= flat_from]
        r.numbers["flat_from_s"] = round(flat_from - self.load_t0, 1)
        r.numbers["rss_steady_range_mb"] = round(max(steady) - min(steady), 1) if steady else 0.0
        r.numbers["rss_drift_mb"] = round(drift(steady), 1)
        r.numbers["rss_peak_mb"] = max((s["rss_mb"] for s in r.samples if s["rss_mb"] is not None), default=0.0)
        end = r.samples[-1]["rss_mb"] if r.samples else None
        r.numbers["rss_after_idle_mb"] = end or 0.0
        back = 100 * (end - r.warm_mb) / r.warm_mb if end and r.warm_mb else 0.0
        r.numbers["rss_after_idle_vs_warm_pct"] = round(back, 2)
        r.verdicts = {
            "no 5xx, no connection error": r.numbers["5xx"] == 0 and r.numbers["connection_errors"] == 0,
            "bad requests answered 4xx": r.numbers["bad_not_4xx"] == 0,
            "every checked answer equals its alone-run": r.checked > 0 and not r.mismatches,
            f"RSS flat under load (drift within {FLAT_MB:g} MiB)": abs(r.numbers["rss_drift_mb"]) <= FLAT_MB,
            f"RSS back within {BACK_PCT:g} % of warm after idling": abs(back) <= BACK_PCT,
        }


def drift(values: list[float]) -> float:
    """How far a series moved: the median of its last quarter minus the median of its first quarter.
    Samples land at random points of a decode step, whose temporaries (logits of every row and drafted
    position, ~20-100 MB on the 1.5B) come and go; a leak moves the medians, those swings do not."""
    if len(values) < 4:
        return 0.0
    q = max(1, len(values) // 4)
    return statistics.median(values[-q:]) - statistics.median(values[:q])


def write_report(result: SoakResult, out: Path, title: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(asdict(result), indent=1, ensure_ascii=False))
    files = [out / "report.json", out / "report.md"]
    try:
        plot(result, out / "rss.png", title)
        files.append(out / "rss.png")
    except ImportError:
        print("draftwise: matplotlib is not installed: no RSS plot (pip install matplotlib)", file=sys.stderr)
    (out / "report.md").write_text(markdown(result, title, plotted=(out / "rss.png").exists()))
    return files


def markdown(r: SoakResult, title: str, plotted: bool) -> str:
    n = r.numbers
    server = (f"Server: {r.server.get('url')} (model `{r.server.get('model')}`, methods "
              f"{', '.join(r.server.get('methods', []))}); {platform.machine()}, {cpu_name()}.")
    lines = [f"# {title}", "", server, "", f"Config: {json.dumps(r.config)}", "", "## Verdicts", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in r.verdicts.items()]
    counts = (f"- requests: {n['requests']:.0f}; checked against alone-runs: {n['checked']:.0f}; mismatches: "
              f"{n['mismatches']:.0f}; 5xx: {n['5xx']:.0f}; connection errors: {n['connection_errors']:.0f}")
    rss = (f"- RSS: warm {r.warm_mb:.0f} MiB, peak {n['rss_peak_mb']:.0f} MiB; under load from "
           f"{n['flat_from_s']:.0f} s on: drift {n['rss_drift_mb']:+.1f} MiB (median of the last quarter − median "
           f"of the first), range {n['rss_steady_range_mb']:.1f} MiB (samples fall at random points of a step); "
           f"after idling {n['rss_after_idle_mb']:.0f} MiB ({n['rss_after_idle_vs_warm_pct']:+.2f} % of warm); "
           f"less the prefix cache, at most {max((s.get('prefix_cache_mb') or 0 for s in r.samples), default=0):.0f} "
           f"MiB")
    codes = sorted({s for by in r.statuses.values() for s in by})
    lines += ["", "## Numbers", "", counts, rss, "", "## Status codes by kind", "",
              "| kind | " + " | ".join(codes) + " |"]
    lines.append("|---" * (len(codes) + 1) + "|")
    for kind, by in sorted(r.statuses.items()):
        lines.append(f"| {kind} | " + " | ".join(str(by.get(c, 0)) for c in codes) + " |")
    if r.mismatches:
        lines += ["", "## Mismatches (first 5)", ""]
        lines += [f"- {m['kind']} prompt {m['prompt']} at {m['t']} s: expected {m['expected']!r}, got {m['got']!r}"
                  for m in r.mismatches[:5]]
    if plotted:
        lines += ["", "![RSS over time](rss.png)"]
    return "\n".join(lines) + "\n"


def plot(r: SoakResult, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(s["t"] / 60, s["rss_mb"], s["phase"]) for s in r.samples if s["rss_mb"] is not None]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    colours = {"warm-up": "tab:gray", "load": "tab:blue", "wind-down": "tab:orange", "idle": "tab:green"}
    for phase, colour in colours.items():
        xs = [p[0] for p in pts if p[2] == phase]
        ys = [p[1] for p in pts if p[2] == phase]
        if xs:
            ax.plot(xs, ys, ".-", color=colour, label=phase, markersize=3)
    if r.warm_mb:
        ax.axhline(r.warm_mb, color="black", lw=0.8, ls="--", label=f"warm {r.warm_mb:.0f} MiB")
        ax.axhspan(r.warm_mb * (1 - BACK_PCT / 100), r.warm_mb * (1 + BACK_PCT / 100), color="black", alpha=0.06)
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_soak(url: str, model: str, cfg: SoakConfig, out: Path, title: str, headers: dict | None = None,
             log=print) -> SoakResult:
    result = asyncio.run(Soak(url, model, cfg, headers, log).run())
    files = write_report(result, out, title)
    for name, ok in result.verdicts.items():
        log(f"soak: {'PASS' if ok else 'FAIL'}: {name}")
    log(f"soak: report in {', '.join(str(f) for f in files)}")
    return result
