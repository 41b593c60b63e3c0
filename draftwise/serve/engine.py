"""The serving engine: continuous batching around the one decode loop (``Decoder``), in one thread.

The engine thread owns the model, the caches and the ``Decoder``; nothing else touches them. Other
threads (the asyncio HTTP server, a benchmark) talk to it through two thread-safe channels:

- in: ``submit(seqs, sink)`` puts a request's sequences (one per choice) in a bounded waiting queue and
  ``cancel(request_id)`` marks a request to drop; both wake the engine;
- out: ``sink(event)`` is called from the engine thread with an ``Output`` (new text of one choice) or an
  ``EngineFailure``. The HTTP side passes a sink that hands events to its event loop
  (``loop.call_soon_threadsafe``).

Each iteration of the loop: drop cancelled requests (their rows and cache are free at once), prefill
waiting sequences into free rows (up to ``max_prefill_tokens`` prompt tokens to compute — those the prefix
cache holds cost nothing —; a longer prompt goes on in the next iterations, so running sequences keep getting
tokens while it is prefilled and are not starved by a burst of long prompts), then one ``Decoder.step()`` for
every running sequence, then hand each sequence's new text to its sink. Requests join and leave the batch between steps.

Memory: the KV caches of target and draft model are reserved once at start, ``rows`` rows of
``max_model_len`` (+ draft headroom) tokens each, ``rows`` chosen to fit ``kv_cache_mb``; the OS commits
their pages as positions are first written (``KVCache`` uses ``torch.empty``), so a short answer costs
what it uses, and ``kv_cache_mb`` stays the upper bound. While requests keep coming, a row a sequence
left keeps its pages for the next one (the reserved rows are the bound: the resident set stays flat
under steady load instead of giving pages back and faulting them in again every few steps); when the
engine goes idle every row written since is given back to the OS (``KVCache.release_rows``), so an idle
server returns to its warm footprint, not the longest answers seen. Going idle also runs a full garbage
collection (objects requests left in reference cycles, and the tensors they hold, would otherwise wait
for Python's rare full collections), and then trims malloc's free lists (``memory.trim_heap``). Under
load malloc holds what steps free for the next step (``memory.hold_freed_memory``, set when the engine
is made): the resident set stays at the working set's high-water mark, flat, instead of each step's
activations being unmapped and faulted in again. When every row is busy requests wait;
when ``max_queue`` are waiting ``submit`` refuses (``EngineFullError``, HTTP 503). Every structure that
outlives a request is bounded: the waiting queue (``max_queue``), the request table (rows + queue), the
suffix drafter's store (``SuffixCache.max_tokens``), the metrics window (10 s); /metrics exports their
sizes.

Shutdown: ``drain()`` stops admitting (``submit`` raises ``EngineStoppedError``, HTTP 503) while what
was admitted runs to its end; ``idle`` tells when nothing is left; ``stop()`` ends the thread and fails
whatever is still running.

Speculation: the drafter is wrapped in a ``ServeDrafter`` (per-request γ caps; plain-decoding requests in
the same batch). With the adaptive policy (``draftwise/gamma.py``) γ shrinks as the batch grows; when
speculation has not paid for a while the draft model is switched off entirely (it idles instead of
keeping its cache in step) and back on for new requests when the policy finds it would pay again.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..api import SpeculativeDecoder, output_text, uses_draft_model
from ..drafters import registry
from ..decode import Decoder, FixedGamma, GammaPolicy
from ..drafters.base import Draft, Drafter, Needs, needs_of
from ..drafters.suffix import SuffixCache
from ..errors import DraftwiseError, InvalidParameterError
from ..gamma import AdaptiveGamma
from ..memory import hold_freed_memory, trim_heap
from ..models.base import KVCache
from ..sequence import Sequence
from ..detok import IncrementalDetokenizer
from .metrics import EngineMetrics

log = logging.getLogger("draftwise.serve")

DTYPE_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}
# a batch whose rows all draft nothing still lets the drafter see its new tokens every this many steps,
# so the drafter's catch-up pass when drafting resumes stays short (a few tokens, a small logits tensor)
DRAFTER_SYNC_STEPS = 16
# the adaptive policy found speculation not paying for this many steps in a row: the draft model is
# switched off (rows detached) until the policy finds it would pay again
DETACH_AFTER_STEPS = 2 * DRAFTER_SYNC_STEPS


class EngineFullError(DraftwiseError):
    """Every cache row is busy and the waiting queue is full (HTTP 503)."""


class EngineStoppedError(DraftwiseError):
    pass


@dataclass(eq=False)
class ServeSequence(Sequence):
    """A ``Sequence`` plus what the server needs: the request it belongs to, its choice index, the
    draft-length cap the request asked for (0 = no speculation for this choice)."""

    index: int = 0
    gamma_cap: int | None = None
    method: str = "ar"
    attached: bool = False  # the drafter holds state for it (see ServeDrafter)
    detok: IncrementalDetokenizer | None = None
    sent_tokens: int = 0  # output tokens already handed to the sink
    request: "EngineRequest | None" = None

    __hash__ = object.__hash__  # identity: two choices with equal tokens are still two sequences
    __eq__ = object.__eq__


@dataclass
class Output:
    """New output of one choice since its previous Output."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" at the end
    seq: ServeSequence  # stats, prompt length, ... (read them once finish_reason is set)


@dataclass
class EngineFailure:
    request_id: str
    message: str


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    seqs: list[ServeSequence]
    sink: Callable[[object], None]
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


class ServeDrafter:
    """Wraps the server's drafter for a batch whose rows want different things.

    - Caps: each row drafts at most its sequence's ``gamma_cap`` tokens (a request that chose plain
      decoding or a smaller γ). Rows capped to 0 still share the drafter's batch state, so they can sit
      in the same batch as speculating rows. When every row is capped to 0 the drafter is still asked for
      one token per row every ``DRAFTER_SYNC_STEPS`` steps and its proposals are dropped — to the drafter
      they were rejected (the decode loop's ``accept`` reports 0 accepted) — so a draft model's cache
      never lags far behind (its catch-up pass stays short: a small logits tensor).
    - Off switch: keeping a draft model in step costs a forward of it over every token (prefill and
      catch-up), whether or not anything is drafted. ``detach(rows)`` (the engine calls it when the
      policy has kept speculation off for a while) drops the rows' drafter state and stops giving new
      rows any; the draft model then idles. ``attach_new = True`` gives rows admitted from then on their
      state again; the batch drafts once every running row has it (``ready``).

    Records the draft lengths of the latest step (``last_ks``).
    """

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name = inner.name
        self.last_ks: list[int] = []
        self.step = 0  # the engine's step counter
        self.attach_new = True  # new rows get the drafter's state at admission
        self._synced = 0

    def ready(self, seqs: list[Sequence]) -> bool:
        """Whether the batch can draft: every row has its drafter state."""
        return all(s.attached for s in seqs)

    def detach(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if s.attached:
                self.inner.release(s)
                s.attached, s.drafter_state = False, None
        # last: another thread that sees speculation off (Engine.speculation_on) sees every row detached
        self.attach_new = False

    def start(self, seq: Sequence, *, hidden=None) -> None:
        if self.attach_new:
            self.inner.start(seq, hidden=hidden)
            seq.attached = True

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        ks = [k if s.gamma_cap is None else min(k, s.gamma_cap) for s, k in zip(seqs, ks)]
        if not self.ready(seqs):  # a policy that cannot see attachment (fixed γ): no drafts this step
            ks = [0] * len(seqs)
        self.last_ks = ks
        if max(ks, default=0) > 0:
            self._synced = self.step
            return self.inner.propose(seqs, ks)
        if self.step - self._synced >= DRAFTER_SYNC_STEPS and self.ready(seqs):
            self._synced = self.step
            self.inner.propose(seqs, [1] * len(seqs))
        return [Draft([]) for _ in seqs]

    @property
    def needs(self) -> Needs:  # what the wrapped drafter reads (drafters/base.py): the loop gives it here
        return needs_of(self.inner)

    def accept(self, seq, n_before, num_accepted, target_logits, *, path=None, hidden=None, **every) -> None:
        if seq.attached:
            self.inner.accept(seq, n_before, num_accepted, target_logits, path=path, hidden=hidden, **every)

    def release(self, seq: Sequence) -> None:
        if seq.attached:
            self.inner.release(seq)
            seq.attached = False

    def move_row(self, src: int, dst: int) -> None:
        self.inner.move_row(src, dst)

    def bind_target_cache(self, cache) -> None:  # called when needs.target_cache (layerskip)
        self.inner.bind_target_cache(cache)


@dataclass
class EngineConfig:
    method: str = "draft"
    gamma: int = 4  # the largest draft length (fixed policy: always this)
    gamma_policy: str = "adaptive"  # "adaptive" | "fixed"
    kv_cache_mb: float = 2048.0
    max_batch: int = 16
    max_model_len: int | None = None  # default: min(model context, 4096)
    max_queue: int = 64
    # prompt tokens computed between two decode steps (in chunks of up to 128): a longer prompt goes on after
    # the next step, so a running stream waits ~2 s at most for the 1.5B on 2 AMD Zen 4 cores, not a whole prompt
    # (a 1378-token prompt: 10 s at 2048, 3.9 s at 512, 1.9 s at 256; its own first token 9.6-10.2 s each way)
    max_prefill_tokens: int = 256
    drafter_options: dict = field(default_factory=dict)

    def validate(self) -> None:
        registry.get(self.method)  # an unknown method: a clear error naming the registered ones
        if self.gamma_policy not in ("adaptive", "fixed"):
            raise InvalidParameterError(f"gamma policy must be adaptive or fixed, got {self.gamma_policy!r}")
        for name, lo in (("gamma", 1), ("max_batch", 1), ("max_queue", 0), ("max_prefill_tokens", 1)):
            if getattr(self, name) < lo:
                raise InvalidParameterError(f"{name} must be >= {lo}, got {getattr(self, name)}")
        if self.kv_cache_mb <= 0:
            raise InvalidParameterError(f"kv_cache_mb must be > 0, got {self.kv_cache_mb}")


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys + values one token occupies in a model's cache."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * DTYPE_BYTES.get(dtype, 4)


class Engine:
    """Continuous-batching speculative decoding engine. ``start()`` launches its thread."""

    def __init__(self, dw: SpeculativeDecoder, config: EngineConfig | None = None):
        cfg = config or EngineConfig()
        cfg.validate()
        if dw.is_encoder_decoder:
            raise InvalidParameterError("the server decodes decoder-only models; an encoder-decoder model "
                                        "(T5, BART, Marian) runs in `draftwise generate` and the library")
        self.dw, self.cfg = dw, cfg
        self.tokenizer = dw.tokenizer
        model = dw.target.model
        ctx = model.config.max_context
        self.max_model_len = min(cfg.max_model_len or min(ctx, 4096), ctx)
        if self.max_model_len < 2:
            raise InvalidParameterError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self.method = cfg.method
        self.speculative = cfg.method != "ar"
        self.headroom = cfg.gamma + 1 if self.speculative else 1
        self.capacity = self.max_model_len + self.headroom  # tokens per cache row
        per_token = kv_bytes_per_token(model.config, model.dtype)
        self.auto_draft_model = self._auto_drafts_with_model(dw, cfg)
        if uses_draft_model(cfg.method) or self.auto_draft_model:
            per_token += kv_bytes_per_token(dw.draft.model.config, dw.draft.model.dtype)
        self.kv_bytes_per_token = per_token
        self.row_bytes = per_token * self.capacity
        fit = int(cfg.kv_cache_mb * 2**20 // self.row_bytes)
        if fit < 1:
            raise InvalidParameterError(
                f"--kv-cache-mb {cfg.kv_cache_mb:g} holds no sequence of --max-model-len {self.max_model_len} "
                f"({self.row_bytes / 2**20:.1f} MiB each); raise --kv-cache-mb or lower --max-model-len")
        self.rows = min(cfg.max_batch, fit)
        if dw.backend == "hf":  # the HF adapter's cache holds one sequence
            self.rows = 1
        self.policy = self._make_policy()
        self.metrics = EngineMetrics(self)
        self.decoder = self._make_decoder()
        self._lock = threading.Condition()
        self._waiting: collections.deque[ServeSequence] = collections.deque()
        self._cancelled: set[str] = set()
        self._requests: dict[str, EngineRequest] = {}
        self._stop = False
        self.draining = False  # drain(): no new requests, the admitted ones finish
        self._thread: threading.Thread | None = None
        self._used_rows = 0  # rows written since they were last given back to the OS
        self._trimmed = True  # malloc trimmed since the engine last worked
        hold_freed_memory()  # under load a step reuses what the last one freed; trimmed when idle
        self.gamma_now = 0  # draft length of the latest step (0 = no speculation)
        self.steps = 0
        self._off_steps = 0  # consecutive steps the policy found speculation not paying

    def _make_policy(self) -> GammaPolicy:
        # a method that sizes its own drafts (auto chooses each row's depth; lookahead's window must be fed
        # at every step) takes γ as its deepest draft
        if self.cfg.gamma_policy == "fixed" or registry.get(self.method).own_gamma is not None:
            return FixedGamma(self.cfg.gamma)
        policy = AdaptiveGamma(self.cfg.gamma, explore_every=DRAFTER_SYNC_STEPS, cap=lambda s: s.gamma_cap,
                               ready=lambda seqs: self.drafter is not None and self.drafter.ready(seqs))
        return self.dw.prime(policy, self.method)

    @staticmethod
    def _auto_drafts_with_model(dw: SpeculativeDecoder, cfg: "EngineConfig") -> bool:
        """Method auto with the draft model among its children: named in option ``methods``, or by default in
        a server of one row (``max_batch`` 1, a personal server: there it pays as in ``generate``) where
        ``auto_takes_draft``. Its cache rows count in the KV budget like method draft's. A batching server
        keeps to the free drafters by default: the draft's cache took rows from the default budget (8 -> 6 at
        concurrency 8: 0.85x ``ar`` against 0.90x without it), and a batch prices its drafts out anyway."""
        if cfg.method != "auto":
            return False
        named = cfg.drafter_options.get("methods")
        if named is not None:
            return any(uses_draft_model(n) for n in named)
        return cfg.max_batch == 1 and bool(cfg.drafter_options.get("draft_model", True)) and dw.auto_takes_draft()

    def _make_decoder(self) -> Decoder:
        opts = dict(self.cfg.drafter_options)
        if self.method == "auto" and "methods" not in opts:
            opts["draft_model"] = self.auto_draft_model
        drafter = self.dw.make_drafter(self.method, self.rows, self.capacity, **opts)
        self.drafter = ServeDrafter(drafter) if drafter is not None else None
        tok = self.tokenizer
        decoder = Decoder(self.dw.target.model, self.drafter, self.policy, eos_ids=tok.eos_ids,
                          detokenize=tok.decode, rows=self.rows, capacity=self.capacity,
                          prefix_cache=self.dw.prefix_cache())
        self.kv_caches = held(KVCache, decoder.cache, drafter)
        self.suffix_stores = held(SuffixCache, drafter)
        self._used_rows = self.rows  # a rebuilt decoder: release every row once
        return decoder

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="draftwise-engine", daemon=True)
            self._thread.start()
        return self

    def drain(self) -> None:
        """Stop admitting requests (``submit`` raises EngineStoppedError); admitted ones run to the end."""
        with self._lock:
            self.draining = True

    @property
    def idle(self) -> bool:
        """No request admitted and unfinished (nothing running, nothing waiting)."""
        with self._lock:
            return not self._requests

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the thread-safe interface ---------------------------------------------------------------
    @property
    def served_methods(self) -> tuple[str, ...]:
        """Methods a request may ask for: the server's own, and plain decoding (a row that drafts 0)."""
        return (self.method, "ar") if self.speculative else ("ar",)

    def new_sequence(self, prompt_ids: list[int], params, *, index: int = 0, method: str | None = None,
                     gamma: int | None = None) -> ServeSequence:
        """Build a choice's sequence, checking method, γ and that it fits (raises InvalidParameterError)."""
        method = method or self.method
        if method not in self.served_methods:
            raise InvalidParameterError(
                f"this server serves methods {', '.join(self.served_methods)}, not {method!r} (start it with "
                f"--method {method} to serve it)")
        if gamma is not None and (not isinstance(gamma, int) or gamma < 0 or gamma > self.cfg.gamma):
            raise InvalidParameterError(f"gamma must be an integer in [0, {self.cfg.gamma}] on this server "
                                        f"(0 = no speculation), got {gamma!r}")
        cap = 0 if method == "ar" else gamma
        seq = ServeSequence(list(prompt_ids), params, index=index, gamma_cap=cap, method=method)
        self.check_fits(seq)
        return seq

    def check_fits(self, seq: Sequence) -> None:
        self.decoder.check_fits(seq)  # reads only sizes; safe from any thread

    def submit(self, request_id: str, seqs: list[ServeSequence], sink: Callable[[object], None]) -> EngineRequest:
        """Queue a request's sequences. Raises EngineFullError when they do not fit in the waiting queue."""
        if not seqs:
            raise InvalidParameterError("a request needs at least one sequence")
        req = EngineRequest(request_id, seqs, sink)
        for s in seqs:
            s.request_id, s.request = request_id, req
            s.detok = IncrementalDetokenizer(self.tokenizer.decode, s.params.stop)
        with self._lock:
            if self._stop or self.draining:
                raise EngineStoppedError("the server is shutting down")
            # admitted and unfinished sequences: at most `rows` run, at most `max_queue` wait for a row
            # (a finishing sequence is counted until its flag is set: the count errs towards refusing)
            active = sum(1 for r in self._requests.values() for s in r.seqs if not s.finished)
            if active + len(seqs) > self.rows + self.cfg.max_queue:
                self.metrics.rejected.inc()
                waiting = len(self._waiting)
                raise EngineFullError(
                    f"server is at capacity: {active - waiting} sequence(s) running or starting in "
                    f"{self.rows} rows, {waiting} waiting (--max-queue {self.cfg.max_queue}); this request "
                    f"needs {len(seqs)}; retry later")
            self._requests[request_id] = req
            self._waiting.extend(seqs)
            self.metrics.requests.inc()
            self._lock.notify_all()
        return req

    def cancel(self, request_id: str) -> None:
        """Drop a request (client gone): its rows and caches are freed before the next step."""
        with self._lock:
            if request_id in self._requests:
                self._cancelled.add(request_id)
                self._lock.notify_all()

    def snapshot(self) -> dict:
        """Counts for /health and tests (approximate while the engine runs)."""
        with self._lock:
            waiting = len(self._waiting)
            requests = len(self._requests)
        return {"running": len(self.decoder.running), "waiting": waiting, "requests": requests,
                "rows": self.rows, "gamma": self.gamma_now, "steps": self.steps, "alive": self.alive,
                "draining": self.draining}

    @property
    def kv_tokens(self) -> int:
        """Tokens in the cache rows of the running sequences (approximate while a step runs)."""
        return sum(len(s.tokens) for s in list(self.decoder.running))

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        return len(self.decoder.running)

    # ---- the engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                if not self._trimmed and not self.decoder.rows_in_use and not self._waiting:
                    self._trimmed = True  # going idle: the rows' pages and what activations freed go back
                    self._release_rows()
                    gc.collect()  # what requests left in reference cycles (tasks, frames, errors) and the
                    self._trim()  # tensors those hold: else only a rare full collection frees them
                with self._lock:
                    while not (self._stop or self._waiting or self._cancelled or self.decoder.rows_in_use):
                        self._lock.wait()
                    self._trimmed = False
                    if self._stop:
                        break
                    cancelled, self._cancelled = self._cancelled, set()
                try:
                    self._drop(cancelled)
                    self._admit()
                    self._used_rows = max(self._used_rows, self.decoder.rows_in_use)
                    self._step()
                except Exception as e:  # a bug must not take the server down: fail what is running
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._fail_all(f"internal error in the decode loop: {type(e).__name__}")
        self._fail_all("the server is shutting down", rebuild=False)

    def _trim(self) -> None:
        t0 = time.perf_counter()
        if trim_heap():
            self.metrics.heap_trims.inc()
        self.metrics.heap_trim_seconds.inc(time.perf_counter() - t0)

    def _release_rows(self) -> None:
        """Give the pages of rows that sequences have left back to the OS (every KV cache: target and
        drafter). Rows 0..B-1 hold the running sequences (the decoder compacts), so the rest are free.
        Called when the engine goes idle (B = 0): under load freed rows keep their pages for reuse."""
        used = len(self.decoder.running)
        if used < self._used_rows:
            released = sum(c.release_rows(used, self._used_rows) for c in self.kv_caches)
            self.metrics.kv_released.inc(released)
        self._used_rows = used

    def _drop(self, cancelled: set[str]) -> None:
        if not cancelled:
            return
        with self._lock:
            dropped = [s for s in self._waiting if s.request_id in cancelled]
            for s in dropped:
                self._waiting.remove(s)
        for s in list(self.decoder.running) + [self.decoder.prefilling]:
            if s is not None and s.request_id in cancelled:
                self.decoder.abort(s)
                dropped.append(s)
        for s in dropped:
            s.finish_reason = "abort"
            self._finish(s)

    def _admit(self) -> None:
        """Prefill waiting sequences, ``max_prefill_tokens`` prompt tokens at most (those the prefix cache holds are
        free) before the next step: a longer prompt goes on after it, so the running sequences keep getting tokens
        while it is prefilled (the chunks' bits do not depend on when they run). One sequence at a time, in order."""
        budget = self.cfg.max_prefill_tokens
        while budget > 0:
            seq = self.decoder.prefilling
            if seq is None:
                with self._lock:
                    if not self._waiting or self.decoder.free_rows == 0:
                        return
                    seq = self._waiting.popleft()
                seq.started = time.perf_counter()
                try:
                    self.decoder.begin(seq)
                except DraftwiseError as e:  # checked at submit; a clear message all the same
                    self._fail_request(seq.request, str(e))
                    continue
                except Exception as e:
                    log.error("prefill of %s failed:\n%s", seq.request_id, traceback.format_exc())
                    self._fail_request(seq.request, f"internal error: {type(e).__name__}")
                    continue
            try:
                done, spent = self.decoder.advance(budget)
            except Exception as e:  # the prefill of this sequence raised (its row is free): fail its request alone
                log.error("prefill of %s failed:\n%s", seq.request_id, traceback.format_exc())
                self._fail_request(seq.request, f"internal error: {type(e).__name__}")
                continue
            budget -= spent
            if done is None:
                return  # the rest of its prompt after the next step
            self.metrics.prompt_tokens.inc(done.prompt_len)
            self.metrics.cached_prompt_tokens.inc(done.stats.cached_tokens)
            self._emit(done)

    def _step(self) -> None:
        running = list(self.decoder.running)
        if not running:
            return
        if self.drafter is not None:
            self.drafter.last_ks, self.drafter.step = [], self.steps
        before = [(s.num_output, s.stats.drafted, s.stats.accepted) for s in running]
        t0 = time.perf_counter()
        self.decoder.step()
        dt = time.perf_counter() - t0
        self.steps += 1
        self.gamma_now = max(self.drafter.last_ks, default=0) if self.drafter is not None else 0
        self._switch_speculation()
        emitted = drafted = accepted = longest = 0
        for s, (n0, d0, a0) in zip(running, before):
            emitted += s.num_output - n0
            drafted += s.stats.drafted - d0
            accepted += s.stats.accepted - a0
            longest = max(longest, s.stats.drafted - d0)
        # the steps counter goes by the drafts the target verified, not the γ asked for: a drafter may propose
        # nothing (prompt lookup without a match, method auto's free drafters between their turns)
        self.metrics.observe_step(len(running), longest, emitted, drafted, accepted, dt)
        for s in running:
            if s.error is not None:  # its step raised (Decoder._fail): that request fails alone
                log.error("sequence of %s failed:\n%s", s.request_id,
                          "".join(traceback.format_exception(s.error)))
                self._fail_request(s.request, f"internal error: {type(s.error).__name__}")
                continue
            try:
                self._emit(s)
            except Exception as e:
                log.error("output of %s failed:\n%s", s.request_id, traceback.format_exc())
                self._fail_request(s.request, f"internal error: {type(e).__name__}")

    @property
    def speculation_on(self) -> bool:
        return self.drafter is not None and self.drafter.attach_new

    def _switch_speculation(self) -> None:
        """With the adaptive policy: switch the draft model off once speculation has not paid for
        DETACH_AFTER_STEPS steps; back on (for rows admitted from then on) once the policy finds it would."""
        best = getattr(self.policy, "best", None)
        if self.drafter is None or best is None:
            return
        if not self.drafter.attach_new:
            self.drafter.attach_new = best > 0
            return
        self._off_steps = self._off_steps + 1 if best == 0 else 0
        if self._off_steps >= DETACH_AFTER_STEPS:
            self._off_steps = 0
            self.drafter.detach(self.decoder.running)

    def _emit(self, s: ServeSequence) -> None:
        """Hand a sequence's new tokens (as text) to its request's sink; finish it if done."""
        new = s.output_ids[s.sent_tokens:]
        s.sent_tokens = s.num_output
        req = s.request
        if req.first_token_at is None and new:
            req.first_token_at = time.perf_counter()
            self.metrics.ttft.observe(req.first_token_at - req.submitted)
        if s.finished:
            text = s.detok.finish(output_text(s, self.tokenizer.decode))
        else:
            text = s.detok.push(new)
        self.metrics.generation_tokens.inc(len(new))
        self._deliver(req, Output(req.request_id, s.index, text, new, s.finish_reason, s))
        if s.finished:
            self._finish(s)

    def _finish(self, s: ServeSequence) -> None:
        req = s.request
        self.metrics.finished.labels(s.finish_reason or "abort").inc()
        if s.finish_reason == "abort":
            self._deliver(req, Output(req.request_id, s.index, "", [], "abort", s))
        with self._lock:
            if all(x.finished for x in req.seqs):
                self._requests.pop(req.request_id, None)
                self._cancelled.discard(req.request_id)

    def _fail_request(self, req: EngineRequest, message: str) -> None:
        with self._lock:
            if req.request_id not in self._requests:
                return  # failed already (two of its choices raised in one step)
            for s in req.seqs:
                if s in self._waiting:
                    self._waiting.remove(s)
            self._requests.pop(req.request_id, None)
        for s in req.seqs:
            if s in self.decoder.running or s is self.decoder.prefilling:
                self.decoder.abort(s)
            if s.finish_reason is None:
                s.finish_reason = "abort"
        self.metrics.failed.inc()
        self._deliver(req, EngineFailure(req.request_id, message))

    def _fail_all(self, message: str, rebuild: bool = True) -> None:
        with self._lock:
            reqs = list(self._requests.values())
        for req in reqs:
            try:
                self._fail_request(req, message)
            except Exception:  # the decoder itself may be broken: rebuild it below
                pass
        if rebuild:
            self.decoder = self._make_decoder()

    @staticmethod
    def _deliver(req: EngineRequest, event: object) -> None:
        try:
            req.sink(event)
        except Exception:  # the consumer is gone (its event loop closed): nothing to tell
            pass


def held(cls: type, *roots) -> list:
    """The instances of ``cls`` among ``roots`` and what they hold (a decoder's cache, a drafter's KV
    cache or suffix store, a composite drafter's children's), each once: the objects reachable through
    attributes, lists and dicts of draftwise's own classes (not torch modules), a few levels deep."""
    found: dict[int, object] = {}
    seen: set[int] = set()

    def walk(obj, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, cls):
            found[id(obj)] = obj
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                walk(x, depth + 1)
        elif type(obj).__module__.startswith("draftwise.") and not isinstance(obj, torch.nn.Module):
            for x in getattr(obj, "__dict__", {}).values():
                walk(x, depth + 1)

    for r in roots:
        walk(r, 0)
    return list(found.values())


def with_overrides(cfg: EngineConfig, **changes) -> EngineConfig:
    return dataclasses.replace(cfg, **changes)


def engine_config(args) -> EngineConfig:
    """The engine's settings from parsed ``serve`` / ``bench-serve`` options (any object with their names)."""
    if args.max_queue < 0:
        raise InvalidParameterError(f"--max-queue must be >= 0, got {args.max_queue}")
    return EngineConfig(method=args.method, gamma=args.gamma, gamma_policy=args.gamma_policy,
                        kv_cache_mb=args.kv_cache_mb, max_batch=args.max_batch, max_model_len=args.max_model_len,
                        max_queue=args.max_queue, max_prefill_tokens=args.max_prefill_tokens,
                        drafter_options=registry.drafter_options(args.method, args.tree_width, args.heads,
                                                                 args.lookahead))
