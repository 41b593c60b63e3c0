"""Prometheus metrics of one engine (its own registry, so several engines can live in one process)."""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

WINDOW_S = 10.0  # tokens/s, acceptance rate and τ gauges cover the steps of the last WINDOW_S seconds


class EngineMetrics:
    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        ns = "draftwise"
        self.requests = Counter("requests", "Requests accepted into the queue", namespace=ns, registry=r)
        self.rejected = Counter("requests_rejected", "Requests refused because the queue was full (503)",
                                namespace=ns, registry=r)
        self.failed = Counter("requests_failed", "Requests ended by an engine error", namespace=ns, registry=r)
        self.finished = Counter("sequences_finished", "Finished sequences (choices) by finish reason",
                                ["finish_reason"], namespace=ns, registry=r)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens prefilled", namespace=ns, registry=r)
        self.cached_prompt_tokens = Counter("prefix_cache_hit_tokens", "Prompt tokens whose keys and values came "
                                            "from the prefix cache (not computed)", namespace=ns, registry=r)
        self.generation_tokens = Counter("generation_tokens", "Output tokens generated", namespace=ns, registry=r)
        self.drafted = Counter("draft_tokens", "Draft tokens proposed", namespace=ns, registry=r)
        self.accepted = Counter("accepted_tokens", "Draft tokens accepted", namespace=ns, registry=r)
        self.steps = Counter("steps", "Decode steps by the most draft tokens a row had verified (gamma; 0 = "
                             "none: no speculation, or the drafter proposed nothing)", ["gamma"],
                             namespace=ns, registry=r)
        self.step_seconds = Histogram("step_seconds", "Duration of one decode step for the whole batch",
                                      namespace=ns, registry=r,
                                      buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.ttft = Histogram("time_to_first_token_seconds", "From submission to the first output token",
                              namespace=ns, registry=r, buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        g = lambda name, doc: Gauge(name, doc, namespace=ns, registry=r)  # noqa: E731
        g("queue_depth", "Sequences waiting for a cache row").set_function(lambda: engine.queue_depth)
        g("batch_size", "Sequences in the running batch").set_function(lambda: engine.batch_size)
        g("cache_rows", "KV cache rows (the largest batch)").set_function(lambda: engine.rows)
        g("gamma", "Draft length γ chosen for the latest step (0 = speculation off)").set_function(
            lambda: engine.gamma_now)
        g("speculation_on", "1 while the drafter runs (rows admitted get draft state), 0 once the adaptive "
          "policy switched it off").set_function(lambda: float(engine.speculation_on))
        g("tokens_per_second", f"Output tokens per second over the last {WINDOW_S:g} s").set_function(
            self.tokens_per_s)
        g("acceptance_rate", f"α = accepted / drafted over the last {WINDOW_S:g} s").set_function(
            self.acceptance_rate)
        g("mean_accepted_length", f"τ = tokens per row per target pass over the last {WINDOW_S:g} s"
          ).set_function(self.mean_accepted_length)
        # memory: the process (draftwise_process_resident_memory_bytes, ...) and the KV cache in use
        ProcessCollector(namespace=ns, registry=r)
        g("kv_cache_tokens", "Tokens held in the KV cache rows of running sequences").set_function(
            lambda: engine.kv_tokens)
        g("kv_cache_bytes_in_use", "Bytes of KV cache (target + draft) those tokens occupy; the OS commits "
          "cache memory page by page as positions are written").set_function(
            lambda: engine.kv_tokens * engine.kv_bytes_per_token)
        g("kv_cache_bytes_limit", "The KV cache's upper bound (--kv-cache-mb, whole rows)").set_function(
            lambda: engine.rows * engine.row_bytes)
        self.kv_released = Counter("kv_cache_released_bytes", "Bytes of KV cache rows given back to the OS as "
                                   "sequences left (madvise; 0 where unsupported)", namespace=ns, registry=r)
        self.heap_trims = Counter("heap_trims", "Times malloc gave free memory back to the OS (malloc_trim: when "
                                  "the engine goes idle, and periodically under load)", namespace=ns, registry=r)
        self.heap_trim_seconds = Counter("heap_trim_seconds", "Time spent in those trims", namespace=ns, registry=r)
        # every structure that outlives a request, bounded; its size and bound
        g("open_requests", "Requests admitted and not finished (bounded by cache rows + --max-queue)"
          ).set_function(lambda: len(engine._requests))
        g("open_requests_limit", "The most sequences admitted at once (cache rows + --max-queue)").set_function(
            lambda: engine.rows + engine.cfg.max_queue)
        # (the suffix drafter's stores: found in the drafter when the decoder is built, after this)
        stores = lambda: getattr(engine, "suffix_stores", [])  # noqa: E731
        g("suffix_cache_tokens", "Tokens of earlier requests held by the suffix drafter's store (0: none)"
          ).set_function(lambda: sum(len(s) for s in stores()))
        g("suffix_cache_bytes", "Bytes of the suffix drafter's store").set_function(
            lambda: sum(s.nbytes for s in stores()))
        g("suffix_cache_limit_tokens", "The suffix store's bound in tokens (the oldest sequences are evicted)"
          ).set_function(lambda: sum(s.max_tokens for s in stores()))
        prefix = lambda: getattr(getattr(engine, "decoder", None), "prefix_cache", None)  # None: no cache
        g("prefix_cache_bytes", "Bytes of prompt keys and values the target's prefix cache holds").set_function(
            lambda: prefix().bytes if prefix() is not None else 0)
        g("prefix_cache_limit_bytes", "The target's prefix cache bound (--prefix-cache-mb; least recently used "
          "blocks are evicted)").set_function(lambda: prefix().budget if prefix() is not None else 0)
        disk = lambda: getattr(prefix(), "disk", None)  # noqa: E731  (None: no --prefix-cache-dir)
        g("prefix_cache_disk_pending_bytes", "Bytes of prefix cache blocks waiting for the --prefix-cache-dir "
          "writer thread").set_function(lambda: disk().pending_bytes if disk() is not None else 0)
        g("prefix_cache_disk_dropped_blocks", "Prefix cache blocks not written to --prefix-cache-dir since the "
          "start (the writer's queue full, or the disk refused a write)").set_function(
            lambda: disk().dropped_blocks if disk() is not None else 0)
        g("draining", "1 after SIGTERM: new requests are refused (503) while admitted ones finish").set_function(
            lambda: float(engine.draining))
        self._window: collections.deque[tuple[float, int, int, int, int]] = collections.deque()
        self._mu = threading.Lock()

    def observe_step(self, rows: int, verified: int, emitted: int, drafted: int, accepted: int, seconds: float):
        self.steps.labels(str(verified)).inc()
        self.step_seconds.observe(seconds)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        with self._mu:
            self._window.append((time.monotonic(), rows, emitted, drafted, accepted))

    def _recent(self) -> tuple[int, int, int, int]:
        now = time.monotonic()
        with self._mu:
            while self._window and self._window[0][0] < now - WINDOW_S:
                self._window.popleft()
            rows = sum(w[1] for w in self._window)
            emitted = sum(w[2] for w in self._window)
            drafted = sum(w[3] for w in self._window)
            accepted = sum(w[4] for w in self._window)
        return rows, emitted, drafted, accepted

    def tokens_per_s(self) -> float:
        return self._recent()[1] / WINDOW_S

    def acceptance_rate(self) -> float:
        _, _, drafted, accepted = self._recent()
        return accepted / drafted if drafted else 0.0

    def mean_accepted_length(self) -> float:
        rows, emitted, _, _ = self._recent()
        return emitted / rows if rows else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
