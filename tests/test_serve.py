"""The serving layer on tiny random models (fast): incremental detokenization, the adaptive γ policy,
the engine (continuous batching, outputs never mix, queue bound, cancellation, memory budget) and the
HTTP API's error handling against a live server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time

import httpx
import pytest
import torch

from draftwise.api import SpeculativeDecoder
from draftwise.decode import Decoder
from draftwise.errors import InvalidParameterError
from draftwise.acceptance import Acceptance, expected_accepted
from draftwise.gamma import AdaptiveGamma
from draftwise.models import LoadedModel, load_model
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence
from draftwise.detok import IncrementalDetokenizer
from draftwise.serve.engine import Engine, EngineConfig, EngineFullError, Output
from draftwise.serve.server import BackgroundServer
from tests.conftest import perturbed

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_dw(hf_folder) -> SpeculativeDecoder:
    """A tiny random Llama with a real (byte-level BPE) tokenizer and chat template; the draft model is a
    noisy copy, so drafts are accepted often but not always (ragged acceptance)."""
    target = load_model(str(hf_folder), "bf16", progress=False)
    noisy = perturbed(target.model, 0.3, seed=5).to(target.model.dtype)
    draft = LoadedModel("tiny-draft", noisy, target.tokenizer, 0.0)
    return SpeculativeDecoder(target, draft)


def reference(dw: SpeculativeDecoder, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy output of the prompt decoded alone, without speculation."""
    dec = Decoder(dw.target.model, None, rows=1, capacity=len(prompt) + max_tokens + 2,
                  eos_ids=dw.tokenizer.eos_ids, detokenize=dw.tokenizer.decode)
    seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens))
    with torch.inference_mode():
        dec.run([seq])
    return seq.output_ids


def collect(engine: Engine, rid: str, seqs, timeout: float = 60.0) -> dict[int, list[Output]]:
    q: queue.Queue = queue.Queue()
    engine.submit(rid, seqs, q.put)
    out: dict[int, list[Output]] = {s.index: [] for s in seqs}
    deadline = time.monotonic() + timeout
    while any(not o or o[-1].finish_reason is None for o in out.values()):
        ev = q.get(timeout=max(0.1, deadline - time.monotonic()))
        out[ev.index].append(ev)
    return out


# ---- incremental detokenization -------------------------------------------------------------------
def test_detokenizer_never_splits_a_character(tiny_dw):
    tok = tiny_dw.tokenizer
    text = "héllo 日本語 wörld — ok"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # characters really span tokens here
    d = IncrementalDetokenizer(tok.decode)
    pieces = [d.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)


def test_detokenizer_holds_back_a_possible_stop_string(tiny_dw):
    tok = tiny_dw.tokenizer
    ids = tok.encode("the quick brown fox")
    d = IncrementalDetokenizer(tok.decode, stop=("brown", "xyz"))
    shown = ""
    for n in range(1, len(ids) + 1):
        if "brown" in tok.decode(ids[:n]):  # here the decode loop ends the sequence at the stop string
            break
        shown += d.push([ids[n - 1]])
        assert "b" not in shown  # "b", "br", ... might start "brown": not shown yet
    shown += d.finish("the quick ")  # the output text, cut at the stop string
    assert shown == "the quick "


# ---- the adaptive γ policy ------------------------------------------------------------------------
def test_expected_accepted():
    assert expected_accepted(0.7, 0) == 0.0
    assert expected_accepted(1.0, 3) == 3.0
    assert expected_accepted(0.5, 2) == pytest.approx(0.75)
    assert expected_accepted(alpha=0.5, depth=3) == pytest.approx(0.875)


def test_acceptance_counts():
    """The estimator gamma and auto share: decayed counts, rates, shrinkage towards pooled rates."""
    a = Acceptance()
    assert a.alpha == 0.0 and a.pi == 1.0 and a.shrunk(0.6, 0.9, 8.0) == (0.6, 0.9)
    a.update(2, 3, True, 0.5)
    a.update(0, 1, False, 0.5)  # asked, nothing proposed: a failed try
    assert (a.accepted, a.tried, a.proposed, a.asked) == (1.0, 2.5, 0.5, 1.5)
    assert a.alpha == pytest.approx(0.4) and a.pi == pytest.approx(1 / 3)
    assert a.expected(2) == pytest.approx((0.4 + 0.16) / 3)
    alpha, pi = a.shrunk(0.8, 1.0, 2.5)
    assert alpha == pytest.approx((2.5 * 0.8 + 1.0) / 5.0) and pi == pytest.approx((2.5 + 0.5) / 4.0)
    b = Acceptance()
    b.update(5, 7, 3, 1.0, asked=4)  # a batch's step: 4 rows asked, 3 proposed
    assert (b.accepted, b.tried, b.proposed, b.asked) == (5, 7, 3, 4)


def _simulate(policy: AdaptiveGamma, B: int, steps: int, alpha: float, rng: random.Random) -> list[int]:
    """Steps with a synthetic CPU-like cost: a fixed weight-read cost, compute per token verified, and a
    draft pass per drafted token. Verification is free-ish at B=1 and expensive at B=64."""
    seqs = [Sequence([1, 2, 3], SamplingParams(max_tokens=10_000)) for _ in range(B)]
    chosen = []
    for _ in range(steps):
        k = policy.choose(seqs)
        keff = policy.last
        chosen.append(keff)
        acc = []
        for s in seqs:
            n = 0
            while n < keff and rng.random() < alpha:
                n += 1
            s.stats.record_step(keff, n)
            acc.append(n)
        cost = 0.02 + 0.002 * B * (keff + 1) + 0.004 * keff
        policy.observe(k, acc, cost * rng.uniform(0.95, 1.05))
    return chosen


def test_adaptive_gamma_speculates_when_cheap_and_stops_under_load():
    rng = random.Random(0)
    policy = AdaptiveGamma(4, explore_every=10)
    alone = _simulate(policy, 1, 120, 0.8, rng)[-40:]
    loaded = _simulate(policy, 64, 120, 0.8, rng)[-40:]
    # exploration steps aside, γ is large alone and 0 (speculation off) with a big batch
    assert sorted(alone)[len(alone) // 2] >= 3
    assert sorted(loaded)[len(loaded) // 2] == 0 and loaded.count(0) >= 30
    assert policy.acceptance_rate == pytest.approx(0.8, abs=0.1)


def test_adaptive_gamma_measures_all_or_nothing_drafters():
    """A drafter that proposes a fully correct run 40% of the time and nothing otherwise (prompt lookup on
    repetitive text): α per tried position is low, but the measured A(j) shows drafting pays at B=1."""
    rng = random.Random(2)
    policy = AdaptiveGamma(4, explore_every=8)
    seqs = [Sequence([1, 2, 3], SamplingParams(max_tokens=10_000))]
    chosen = []
    for _ in range(200):
        k = policy.choose(seqs)
        keff = policy.last
        chosen.append(keff)
        a = keff if rng.random() < 0.4 else 0
        seqs[0].stats.record_step(a, a)
        policy.observe(k, [a], (0.02 + 0.002 * (keff + 1)) * rng.uniform(0.95, 1.05))
    assert sorted(chosen[-50:])[25] == 4  # E = 1 + 0.4·4 = 2.6 tokens for 1.4× the cost of one
    assert policy.accepted_by_length()[4] == pytest.approx(1.6, abs=0.4)


def test_adaptive_gamma_respects_row_caps():
    policy = AdaptiveGamma(4, cap=lambda s: 0)
    seqs = [Sequence([1], SamplingParams(max_tokens=50))]
    policy.choose(seqs)
    assert policy.last == 0
    with pytest.raises(InvalidParameterError):
        AdaptiveGamma(0)


# ---- the engine -----------------------------------------------------------------------------------
def test_memory_budget_sets_rows(tiny_dw):
    cfg = tiny_dw.target.config
    elem = torch.empty(0, dtype=tiny_dw.target.model.dtype).element_size()  # the cache's dtype (compute dtype)
    per_token = 2 * elem * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # k+v, target and draft alike
    e = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, max_model_len=100, max_batch=64,
                                     kv_cache_mb=per_token * 2 * 104 * 5.5 / 2**20))
    assert e.rows == 5 and e.capacity == 104
    assert e.decoder.cache.rows == 5 and e.drafter.inner.cache.rows == 5
    with pytest.raises(InvalidParameterError, match="kv-cache-mb"):
        Engine(tiny_dw, EngineConfig(max_model_len=100, kv_cache_mb=0.001))


@pytest.mark.parametrize("served", ["draft", "draft-tree", "pld-tree", "auto", "eagle"])
def test_concurrent_requests_never_mix(tiny_dw, served, hf_folder, tmp_path):
    """Many different prompts with different lengths, methods and γ caps through a 4-row engine (most
    wait in the queue, join as rows free up): each output is what the prompt gives alone — chains and
    token trees of different sizes in one batch (eagle: a head reading the target's inner layers)."""
    from tests.test_bench import tiny_heads

    rng = random.Random(1)
    opts = {"branches": 2} if "tree" in served else {}
    if served == "eagle":
        opts = {"branches": 2, "heads": tiny_heads(hf_folder, tmp_path / "heads", noise=0.05)}
    engine = Engine(tiny_dw, EngineConfig(method=served, gamma=3, max_model_len=120, max_batch=4, max_queue=64,
                                          drafter_options=opts))
    engine.start()
    try:
        jobs, sinks = [], []
        for i in range(24):
            prompt = [rng.randrange(3, 290) for _ in range(rng.randrange(1, 12))]
            max_tokens = rng.randrange(1, 30)
            method, gamma = [(served, None), ("ar", None), (served, 1), (served, 2)][i % 4]
            seq = engine.new_sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                      method=method, gamma=gamma)
            q: queue.Queue = queue.Queue()
            engine.submit(f"r{i}", [seq], q.put)
            jobs.append((prompt, max_tokens, seq))
            sinks.append(q)
        for (prompt, max_tokens, seq), q in zip(jobs, sinks):
            events = []
            while not events or events[-1].finish_reason is None:
                events.append(q.get(timeout=60))
            ids = [t for e in events for t in e.token_ids]
            assert ids == seq.output_ids == reference(tiny_dw, prompt, max_tokens)
            assert "".join(e.text for e in events) == tiny_dw.tokenizer.decode(ids)
            assert events[-1].finish_reason == "length"
        drafted = [s.stats.drafted for _, _, s in jobs]
        assert drafted[1::4] == [0] * 6 and sum(drafted) > 0  # "ar" requests drafted nothing
        ragged = {s.stats.acceptance_rate for _, _, s in jobs if s.stats.drafted}
        assert len(ragged) > 1 or served in ("pld-tree", "auto", "eagle")  # rows accepted different numbers of drafts
        assert engine.snapshot()["running"] == 0 and engine.snapshot()["requests"] == 0
    finally:
        engine.stop()


def test_drafter_kept_in_step_while_no_row_drafts(tiny_dw):
    """Rows that draft nothing (plain-decoding requests) still let the draft model catch up now and then,
    so a speculating row joining later finds a short catch-up; every output stays exact."""
    from draftwise.serve.engine import DRAFTER_SYNC_STEPS

    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, gamma_policy="fixed", max_model_len=120,
                                          max_batch=3))
    p = SamplingParams(max_tokens=90, ignore_eos=True)
    plain = [engine.new_sequence([7 + i, 8, 9], p, method="ar") for i in range(2)]
    engine.start()
    try:
        sinks = [queue.Queue() for _ in range(3)]
        for i, seq in enumerate(plain):
            engine.submit(f"ar{i}", [seq], sinks[i].put)
        while plain[0].num_output < 50:
            time.sleep(0.002)
        lag = len(plain[0].tokens) - plain[0].drafter_state
        assert 0 <= lag <= DRAFTER_SYNC_STEPS + 2
        late = engine.new_sequence([11, 12], SamplingParams(max_tokens=30, ignore_eos=True))
        engine.submit("late", [late], sinks[2].put)
        for q in sinks:
            while q.get(timeout=60).finish_reason is None:
                pass
        for seq in plain + [late]:
            assert seq.output_ids == reference(tiny_dw, seq.prompt_ids, seq.params.max_tokens)
        assert late.stats.drafted > 0 and all(s.stats.drafted == 0 for s in plain)
    finally:
        engine.stop()


class StubPolicy:
    """Says what γ is best (set by the test); drafts it when the batch can."""

    max_gamma = 3

    def __init__(self, ready):
        self.best, self.ready = 0, ready

    def choose(self, seqs):
        return self.best if self.ready(seqs) else 0

    def observe(self, k, accepted, step_s):
        pass


def test_draft_model_switched_off_and_on(tiny_dw):
    """When the policy keeps finding speculation not worth it, the draft model is switched off (rows lose
    their draft state, new rows get none); when it would pay again, rows admitted get draft state and the
    batch drafts once all rows have it. Outputs stay exact throughout."""
    from draftwise.serve.engine import DETACH_AFTER_STEPS

    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, max_model_len=200, max_batch=2))
    stub = StubPolicy(lambda seqs: engine.drafter.ready(seqs))
    engine.policy = engine.decoder.gamma = stub
    a = engine.new_sequence([3, 4, 5], SamplingParams(max_tokens=70, ignore_eos=True))
    b = engine.new_sequence([9, 8], SamplingParams(max_tokens=120, ignore_eos=True))
    sinks = [queue.Queue(), queue.Queue()]
    engine.start()
    try:
        engine.submit("a", [a], sinks[0].put)
        deadline = time.monotonic() + 30
        while engine.speculation_on and time.monotonic() < deadline:
            time.sleep(0.002)
        assert not engine.speculation_on and not a.attached and a.drafter_state is None
        assert a.num_output >= DETACH_AFTER_STEPS and a.stats.drafted == 0
        stub.best = 3  # speculation would pay again
        while not engine.speculation_on:
            time.sleep(0.002)
        engine.submit("b", [b], sinks[1].put)
        for q in sinks:
            while q.get(timeout=60).finish_reason is None:
                pass
        assert b.stats.drafted > 0 and a.stats.drafted == 0  # b drafted once a (no draft state) had left
        for seq in (a, b):
            assert seq.output_ids == reference(tiny_dw, seq.prompt_ids, seq.params.max_tokens)
        text = engine.metrics.render().decode()
        assert "draftwise_speculation_on 1.0" in text
    finally:
        engine.stop()


def test_queue_bound_refuses(tiny_dw):
    engine = Engine(tiny_dw, EngineConfig(method="ar", max_model_len=64, max_batch=2, max_queue=1))
    p = SamplingParams(max_tokens=4)
    engine.submit("a", [engine.new_sequence([5, 6], p)], lambda ev: None)
    engine.submit("b", [engine.new_sequence([5, 6], p), engine.new_sequence([7], p)], lambda ev: None)
    with pytest.raises(EngineFullError):  # 2 rows + 1 queue slot are taken (the engine is not running)
        engine.submit("c", [engine.new_sequence([5, 6], p)], lambda ev: None)
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while engine.snapshot()["requests"] and time.monotonic() < deadline:
            time.sleep(0.01)
        out = collect(engine, "d", [engine.new_sequence([8, 9], p)])  # once the others ran, room again
        assert out[0][-1].finish_reason == "length"
    finally:
        engine.stop()


def test_cancel_frees_the_row(tiny_dw):
    engine = Engine(tiny_dw, EngineConfig(method="draft", max_model_len=250, max_batch=2))
    events: queue.Queue = queue.Queue()
    gate = threading.Event()

    def sink(ev):  # runs in the engine thread: hold it at the first token until the cancel is in
        gate.wait(10)
        events.put(ev)

    seq = engine.new_sequence([5, 6, 7], SamplingParams(max_tokens=240, ignore_eos=True))
    engine.start()
    try:
        engine.submit("long", [seq], sink)
        while engine.snapshot()["running"] == 0:
            time.sleep(0.005)
        engine.cancel("long")
        gate.set()
        deadline = time.monotonic() + 10
        while engine.snapshot()["requests"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.snapshot()["running"] == 0 and engine.snapshot()["requests"] == 0
        assert seq.finish_reason == "abort" and seq.num_output < 20
        assert engine.decoder.free_rows == 2
        last = None
        while not events.empty():
            last = events.get()
        assert last.finish_reason == "abort"
    finally:
        engine.stop()


def test_bad_sequence_requests(tiny_dw):
    ar = Engine(tiny_dw, EngineConfig(method="ar", max_model_len=64, max_batch=1))
    with pytest.raises(InvalidParameterError, match="serves methods ar"):
        ar.new_sequence([1], SamplingParams(), method="draft")
    sp = Engine(tiny_dw, EngineConfig(method="pld", gamma=3, max_model_len=64, max_batch=1))
    with pytest.raises(InvalidParameterError, match="gamma"):
        sp.new_sequence([1], SamplingParams(), gamma=9)
    with pytest.raises(InvalidParameterError):
        sp.new_sequence([1] * 60, SamplingParams(max_tokens=10))


# ---- HTTP: errors, refusal, disconnects (a live server on 127.0.0.1) ------------------------------
@pytest.fixture(scope="module")
def tiny_server(tiny_dw):
    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, max_model_len=200, max_batch=2, max_queue=2))
    with BackgroundServer(engine, MODEL, api_key="sekret") as srv:
        yield srv


AUTH = {"Authorization": "Bearer sekret"}


def post(srv, path: str, body=None, *, headers=AUTH, content=None) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, content=content, headers=headers, timeout=60)


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, **kw}


BAD = [
    ("/v1/chat/completions", chat_body(temperature=-0.5), 400, "temperature"),
    ("/v1/chat/completions", chat_body(top_p=0), 400, "top_p"),
    ("/v1/chat/completions", chat_body(top_p=1.5), 400, "top_p"),
    ("/v1/chat/completions", chat_body(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(max_tokens=100_000), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(n=0), 400, "n"),
    ("/v1/chat/completions", chat_body(n=50), 400, "n"),
    ("/v1/chat/completions", chat_body(model="gpt-4"), 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", chat_body(messages=[]), 400, "messages"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "word " * 400}]), 400, "messages"),
    ("/v1/chat/completions", chat_body(logprobs=True), 400, "logprobs"),
    ("/v1/chat/completions", chat_body(stop=["a", ""]), 400, "stop"),
    ("/v1/chat/completions", chat_body(draftwise={"method": "nasd"}), 400, "draftwise"),
    ("/v1/chat/completions", chat_body(draftwise={"gamma": 7}), 400, "draftwise"),
    ("/v1/chat/completions", chat_body(draftwise={"gamma": -1}), 400, "draftwise.gamma"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 300}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors(tiny_server, path, body, status, param):
    r = post(tiny_server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_malformed_json_wrong_key_unknown_route(tiny_server):
    r = post(tiny_server, "/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers={
        **AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = post(tiny_server, "/v1/chat/completions", chat_body(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(tiny_server.base_url + "/v1/models")
    assert r.status_code == 401
    r = httpx.get(tiny_server.base_url + "/v2/nothing")
    assert r.status_code == 404 and "error" in r.json()
    # and the server keeps serving
    assert httpx.get(tiny_server.base_url + "/health").json()["status"] == "ok"
    r = post(tiny_server, "/v1/chat/completions", chat_body(temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    models = httpx.get(tiny_server.base_url + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == MODEL


def test_full_server_answers_503_and_disconnects_free_slots(tiny_dw):
    """2 rows + 2 queue slots: 3 streams and a plain request fill the server, a fifth is refused with 503
    (the engine thread is held back so nothing finishes meanwhile); the four clients then go away (the
    plain one by timing out) and, once the engine runs, their rows and queue slots are free again."""
    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, max_model_len=200, max_batch=2, max_queue=2))
    engine.start = lambda: engine  # hold the engine thread back: requests stay queued

    async def scenario(base_url):
        body = chat_body(max_tokens=50, stream=True, temperature=0)
        async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=60) as client:
            streams = []
            for _ in range(3):
                cm = client.stream("POST", "/v1/chat/completions", json=body)
                r = await cm.__aenter__()
                assert r.status_code == 200
                streams.append(cm)
            plain = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(), timeout=1.5))
            while engine.snapshot()["waiting"] < 4:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/chat/completions", json=chat_body())
            with pytest.raises(httpx.ReadTimeout):
                await plain
            for cm in streams:  # the streaming clients go away too
                await cm.__aexit__(None, None, None)
            return refused

    with BackgroundServer(engine, MODEL, api_key="sekret") as srv:
        refused = asyncio.run(scenario(srv.base_url))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_overloaded"
        assert refused.headers.get("retry-after") == "1"
        deadline = time.monotonic() + 10
        while len(engine._cancelled) < 4 and time.monotonic() < deadline:  # noticed by the HTTP side
            time.sleep(0.02)
        Engine.start(engine)
        while engine.snapshot()["requests"] and time.monotonic() < deadline:
            time.sleep(0.02)
        snap = engine.snapshot()
        assert snap["running"] == 0 and snap["waiting"] == 0 and snap["requests"] == 0
        metrics = httpx.get(srv.base_url + "/metrics").text
        assert 'draftwise_sequences_finished_total{finish_reason="abort"} 4.0' in metrics
        assert "draftwise_requests_rejected_total 1.0" in metrics
        assert post(srv, "/v1/chat/completions", chat_body()).status_code == 200


def test_a_running_plain_request_is_cancelled_soon_after_its_client_leaves(tiny_dw):
    """A non-streaming request whose tokens keep coming is still checked for its client every
    DISCONNECT_POLL_S: the client gives up after 1 s, and the engine drops the request long before its 150
    tokens (a step slowed to 40 ms: 6+ s) would have run. Before, only a request whose events stopped for
    DISCONNECT_POLL_S (a queued one) was ever checked, so an abandoned running one ran to its end."""
    engine = Engine(tiny_dw, EngineConfig(method="ar", max_model_len=200, max_batch=2, max_queue=2))
    step = engine._step

    def slow_step():
        time.sleep(0.04)
        step()
    engine._step = slow_step
    aborted = engine.metrics.finished.labels("abort")._value.get()
    with BackgroundServer(engine, MODEL, api_key="sekret") as srv:
        body = chat_body(max_tokens=150, ignore_eos=True, temperature=0)
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=1.0)
        assert engine.snapshot()["running"] == 1  # it was running when its client left
        deadline = t0 + 5
        while engine.snapshot()["requests"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.snapshot()["requests"] == 0, "the abandoned request still runs"
        assert engine.metrics.finished.labels("abort")._value.get() == aborted + 1
        assert engine.steps < 100


def test_steps_are_counted_by_the_drafts_verified(tiny_dw):
    """``draftwise_steps{gamma}`` counts a step by the most draft tokens a row had verified, not the γ the
    policy asked for: a drafter that proposes nothing (prompt lookup without a match, method auto's free
    drafters between their turns) makes γ = 0 steps. Before, bench-serve reported γ 4 on 97 % of the steps
    of a run whose τ was 1.02."""
    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, gamma_policy="fixed", max_model_len=64,
                                          max_batch=2)).start()
    try:
        inner = engine.drafter.inner
        propose = inner.propose
        calls = []

        def every_other(seqs, ks):  # drafts on every other step only
            calls.append(ks)
            drafts = propose(seqs, ks)
            return drafts if len(calls) % 2 else [type(d)([]) for d in drafts]
        inner.propose = every_other
        p = SamplingParams(max_tokens=12, ignore_eos=True)
        collect(engine, "r", [engine.new_sequence([5, 6, 7], p)])
        counts = {lab: engine.metrics.steps.labels(lab)._value.get() for lab in ("0", "1", "2", "3")}
        assert max(calls[0]) == 3 and max(calls[1]) == 3  # the policy asked for 3 (up to the budget's end)
        assert counts["0"] >= len(calls) // 2 and counts["3"] >= 1, counts  # each emptied step a γ = 0 one
        assert sum(counts.values()) == engine.steps
    finally:
        engine.stop()


def test_metrics_names(tiny_server):
    text = httpx.get(tiny_server.base_url + "/metrics").text
    for name in ("draftwise_requests_total", "draftwise_generation_tokens_total", "draftwise_queue_depth",
                 "draftwise_batch_size", "draftwise_acceptance_rate", "draftwise_mean_accepted_length",
                 "draftwise_tokens_per_second", "draftwise_gamma", "draftwise_steps_total",
                 "draftwise_process_resident_memory_bytes", "draftwise_kv_cache_tokens",
                 "draftwise_kv_cache_bytes_in_use", "draftwise_kv_cache_bytes_limit"):
        assert name in text, name
    rss = [ln for ln in text.splitlines() if ln.startswith("draftwise_process_resident_memory_bytes ")]
    assert float(rss[0].split()[1]) > 50e6


# ---- the command line -----------------------------------------------------------------------------
def test_cli_errors_are_one_line(capsys, hf_folder):
    from draftwise.cli import main

    assert main(["serve", "--max-queue", "-1"]) == 2
    assert "max-queue" in capsys.readouterr().err
    assert main(["serve", "--target", str(hf_folder), "--method", "ar", "--kv-cache-mb", "0.001"]) == 2
    err = capsys.readouterr().err
    assert "kv-cache-mb" in err and "Traceback" not in err
    assert main(["bench-serve", "--target", str(hf_folder), "--method", "ar", "--modes", "fast"]) == 2


def test_bench_serve_json_into_a_new_folder_and_an_unwritable_one_refused_first(capsys, hf_folder, tmp_path):
    """``bench-serve --json`` creates the file's folder; a destination that cannot be written is refused before the
    benchmark runs (it used to end minutes of measuring in a traceback, the numbers lost)."""
    import json

    from draftwise.cli import main

    out = tmp_path / "new" / "deeper" / "c1.json"
    assert main(["bench-serve", "--target", str(hf_folder), "--method", "ar", "--modes", "ar", "--concurrency", "1",
                 "--requests", "2", "--max-tokens", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 1 and rows[0]["mode"] == "ar" and rows[0]["requests"] == 2
    capsys.readouterr()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for bad in (blocker / "c1.json", tmp_path / "new"):  # a folder below a file; a folder itself
        assert main(["bench-serve", "--target", str(hf_folder), "--method", "ar", "--modes", "ar",
                     "--json", str(bad)]) == 2
        err = capsys.readouterr()
        assert "cannot write --json" in err.err and "Traceback" not in err.err
        assert "ar " not in err.out  # refused before any level ran


def test_cli_serve_process(hf_folder):
    """``draftwise serve`` as a real process: binds 127.0.0.1, wants the API key, stops cleanly on Ctrl-C."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "draftwise.cli", "serve", "--target", str(hf_folder),
                             "--method", "pld", "--port", str(port), "--max-model-len", "128", "--threads", "1",
                             "--api-key", "k", "--log-level", "warning"],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.2)
        body = {"model": str(hf_folder), "prompt": "hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert r.json()["draftwise"]["method"] == "pld"
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert f"on http://127.0.0.1:{port}/v1" in err


@pytest.mark.parametrize("argv, says", [
    (["--port", "99999"], "a TCP port is 0-65535, got '99999'"),
    (["--port", "http"], "a TCP port is 0-65535, got 'http'"),
])
def test_serve_refuses_a_bad_port(argv, says, capsys):
    from draftwise.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_serve_says_the_port_is_taken_before_loading_anything(hf_folder, capsys, monkeypatch):
    """A port in use (or an address this machine lacks, a host that does not resolve) is a clear error at
    once, before the model loads; it used to surface as uvicorn's log and exit status 3 after the load."""
    import socket

    from draftwise.cli import main
    from draftwise.cli import serve as serve_cli

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(serve_cli, "build_decoder", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--target", str(hf_folder), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use (another server? choose another --port)" in err
    assert main(["serve", "--target", str(hf_folder), "--host", "no-such-host.invalid"]) == 2
    assert "cannot serve on no-such-host.invalid:8000: unknown host" in capsys.readouterr().err
    assert main(["serve", "--target", str(hf_folder), "--host", "192.0.2.1"]) == 2  # TEST-NET-1: not ours
    assert "cannot serve on 192.0.2.1:8000: Cannot assign requested address" in capsys.readouterr().err


def test_adaptive_gamma_is_not_trapped_by_draft_catch_up_costs():
    """A draft model skipped for m steps feeds those m tokens through itself on its next draft. Counting
    that as the cost of drafting made one exploration after a run of γ = 0 steps look twice as expensive
    as drafting is, and kept γ at 0 for good (seen on Spec-Bench: α 0.87, τ 1.05). Such steps stay out
    of the cost fit, so the fit holds the steady cost and a good draft (α 0.8) gets used."""
    rng = random.Random(0)
    policy = AdaptiveGamma(8, explore_every=16)
    for k in range(9):  # primed: a target pass costs 60 ms + 12 ms per extra token, a draft token 28 ms
        policy.prime(1, k, 0.060 + 0.040 * k)
    seqs = [Sequence([1, 2, 3], SamplingParams(max_tokens=10_000))]
    chosen, skipped = [], 0
    for _ in range(400):
        k = policy.choose(seqs)
        keff = policy.last
        chosen.append(keff)
        n = 0
        while n < keff and rng.random() < 0.8:
            n += 1
        seqs[0].stats.record_step(keff, n)
        catch_up = 0.05 + 0.01 * skipped if keff and skipped else 0.0  # one draft pass over the skipped tokens
        skipped = 0 if keff else skipped + 1
        policy.observe(k, [n], (0.060 + 0.040 * keff + catch_up) * rng.uniform(0.95, 1.05))
    assert policy.cost(1, 1) == pytest.approx(0.100, rel=0.1)  # without the rule: ~0.22
    assert sorted(chosen[-200:])[100] >= 1  # without the rule: 0
