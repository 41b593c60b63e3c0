"""The server under hostile input and load (tiny model, live uvicorn on 127.0.0.1):

- every defect of the hardening issue as a regression test, with its exact request, each followed by a
  valid request on the same keep-alive connection;
- a fault injected into one sequence's step fails that request alone (a 500, the connection stays
  usable) while the other sequences of the same batch finish with the right text;
- a seed means the same text whatever the load, the method and γ;
- schemathesis fuzzing against the server's own OpenAPI schema: no 5xx, no hang, the server alive after.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import shutil
import subprocess

import httpx
from hypothesis import HealthCheck, given, settings, strategies as st
import pytest

from draftwise.api import SpeculativeDecoder
from draftwise.models import LoadedModel, load_model
from draftwise.serve.engine import Engine, EngineConfig, EngineFullError
from draftwise.serve.server import BackgroundServer
from draftwise.sampling import SamplingParams
from tests.conftest import perturbed

MODEL = "tiny"
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tiny_dw(hf_folder) -> SpeculativeDecoder:
    target = load_model(str(hf_folder), "bf16", progress=False)
    noisy = perturbed(target.model, 0.3, seed=5).to(target.model.dtype)
    return SpeculativeDecoder(target, LoadedModel("tiny-draft", noisy, target.tokenizer, 0.0))


@pytest.fixture(scope="module")
def srv(tiny_dw):
    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=4, max_model_len=200, max_batch=8, max_queue=16))
    with BackgroundServer(engine, MODEL, api_key=KEY) as s:
        yield s


class Conn:
    """One keep-alive HTTP/1.1 connection (http.client: it never reconnects behind our back)."""

    def __init__(self, srv):
        self.c = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
        self.sock = None

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.c.request("POST", path, body=data, headers={"Content-Type": "application/json", **AUTH,
                                                          **(headers or {})})
        r = self.c.getresponse()
        payload = json.loads(r.read() or b"null")
        if self.sock is None:
            self.sock = self.c.sock
        assert self.c.sock is self.sock, "the server closed the keep-alive connection"
        return r.status, dict(r.getheaders()), payload

    def valid(self) -> None:
        status, _, body = self.post("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3,
                                                        "temperature": 0})
        assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body

    def close(self):
        self.c.close()


@pytest.fixture
def conn(srv):
    c = Conn(srv)
    yield c
    c.close()


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, **kw}


def _requests(srv) -> int:
    return httpx.get(srv.base_url + "/health").json()["requests"]


# ---- the repro requests -------------------------------------------------------------------------
def test_seed_above_uint64_is_a_400_naming_seed(conn):
    status, _, body = conn.post("/v1/chat/completions", chat(temperature=0.8, seed=18446744073709551616))
    assert status == 400 and body["error"]["param"] == "seed", body
    conn.valid()


def test_seed_at_uint64_max_with_two_choices(conn):
    status, _, body = conn.post("/v1/chat/completions", chat(temperature=0.8, seed=2**64 - 1, n=2))
    assert status == 200 and len(body["choices"]) == 2, body
    status, _, again = conn.post("/v1/chat/completions", chat(temperature=0.8, seed=-1, n=2))  # the same seed
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in body["choices"]]
    conn.valid()


def test_lone_surrogate_in_a_prompt_is_a_400(conn):
    raw = b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 4, "temperature": 0}'
    status, _, body = conn.post("/v1/completions", raw)
    assert status == 400 and body["error"]["param"] == "prompt", body
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 4}'
    status, _, body = conn.post("/v1/chat/completions", raw)
    assert status == 400 and body["error"]["param"] == "messages", body
    status, _, body = conn.post("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}')
    assert status == 400 and body["error"]["param"] == "stop", body
    conn.valid()


def test_an_internal_error_keeps_the_connection(srv, conn, monkeypatch):
    tok = srv.engine.tokenizer

    def broken(text, *a, **kw):
        raise TypeError("injected tokenizer failure")
    monkeypatch.setattr(tok, "encode", broken)
    status, headers, body = conn.post("/v1/completions", {"model": MODEL, "prompt": "boom", "max_tokens": 4})
    assert status == 500 and body["error"]["type"] == "server_error", body
    assert "traceback" not in json.dumps(body).lower() and "injected" not in body["error"]["message"]
    monkeypatch.undo()
    conn.valid()  # the same socket serves the next request


def test_a_template_that_refuses_is_a_400_and_a_broken_tokenizer_a_500(srv, conn, monkeypatch):
    """The template refusing the conversation is the client's problem (400, naming messages); a tokenizer
    that cannot load (e.g. a failed import) is the server's (500), never blamed on the messages."""
    from jinja2 import TemplateError

    tok = srv.engine.tokenizer
    for error, status in ((TemplateError("Conversation roles must alternate"), 400), (ImportError("half-loaded"), 500)):
        def refuse(messages, error=error):
            raise error
        monkeypatch.setattr(tok, "apply_chat", refuse)
        got, _, body = conn.post("/v1/chat/completions", chat())
        assert got == status, body
        if status == 400:
            assert body["error"]["param"] == "messages" and "alternate" in body["error"]["message"]
        monkeypatch.undo()
    conn.valid()


def test_empty_prompt_list_is_a_400_and_leaks_nothing(srv, conn):
    before = _requests(srv)
    for prompt in ([], "", [[]]):
        status, _, body = conn.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert status == 400 and body["error"]["param"] == "prompt", (prompt, body)
    assert _requests(srv) == before
    conn.valid()


@pytest.mark.parametrize("raw", [b"2.5", b"100", b"Infinity", b"-Infinity", b"NaN", b"2.0000001"])
def test_temperature_above_two_is_refused(conn, raw):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, ' \
           b'"temperature": ' + raw + b"}"
    status, _, err = conn.post("/v1/chat/completions", body)
    assert status == 400 and err["error"]["param"] == "temperature", err
    conn.valid()


def test_top_p_nan_is_refused(conn):
    status, _, err = conn.post("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", '
                                                       b'"content": "hi"}], "top_p": NaN}')
    assert status == 400 and err["error"]["param"] == "top_p", err


def test_bad_json_without_a_key_is_a_401(conn):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        status, _, body = conn.post("/v1/chat/completions", b'{"model": "tiny", "messages": [', headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    status, _, body = conn.post("/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and "JSON" in body["error"]["message"]
    conn.valid()


def test_503_says_what_is_measured_and_max_queue_bounds_the_waiting(tiny_dw):
    """2 rows, --max-queue 3, the engine thread held back: 5 sequences are taken (2 for the rows, 3 to
    wait), the sixth refused, and the message gives the measured counts."""
    engine = Engine(tiny_dw, EngineConfig(method="ar", max_model_len=64, max_batch=2, max_queue=3))
    p = SamplingParams(max_tokens=4)
    engine.submit("a", [engine.new_sequence([5, 6], p) for _ in range(3)], lambda ev: None)
    engine.submit("b", [engine.new_sequence([7], p) for _ in range(2)], lambda ev: None)
    with pytest.raises(EngineFullError) as e:
        engine.submit("c", [engine.new_sequence([8], p)], lambda ev: None)
    msg = str(e.value)
    assert "0 sequence(s) running or starting in 2 rows" in msg and "5 waiting" in msg and "--max-queue 3" in msg
    with pytest.raises(Exception, match="at least one sequence"):
        engine.submit("d", [], lambda ev: None)


# ---- fault injection -----------------------------------------------------------------------------------
def test_a_failing_sequence_fails_its_request_alone(srv, tiny_dw):
    """Three concurrent greedy requests share the batch; the step of the one whose prompt is 'poison'
    raises at its fourth verification. It gets a 500 (and its connection serves the next request); the
    others finish with exactly the text they get alone."""
    engine = srv.engine
    poison = engine.tokenizer.encode("poison")
    decoder = engine.decoder
    original = decoder._verify
    calls = {"n": 0}

    def flaky(seq, draft, logits):
        if seq.prompt_ids == poison:
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("injected failure in one sequence")
        return original(seq, draft, logits)

    prompts = ["once upon a time", "poison", "the quick brown fox"]
    body = lambda p: {"model": MODEL, "prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    alone = {p: httpx.post(srv.base_url + "/v1/completions", json=body(p), headers=AUTH, timeout=60).json()
             for p in prompts if p != "poison"}
    decoder._verify = flaky
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            conns = {p: Conn(srv) for p in prompts}
            futs = {p: pool.submit(conns[p].post, "/v1/completions", body(p)) for p in prompts}
            res = {p: f.result() for p, f in futs.items()}
    finally:
        decoder._verify = original
    status, _, err = res["poison"]
    assert status == 500 and err["error"]["type"] == "server_error" and calls["n"] >= 4, err
    assert "injected" not in err["error"]["message"]  # the details go to the log, not to the client
    conns["poison"].valid()
    for p in alone:
        status, _, out = res[p]
        assert status == 200 and out["choices"][0]["text"] == alone[p]["choices"][0]["text"], p
    for c in conns.values():
        c.close()
    assert httpx.get(srv.base_url + "/health").json()["status"] == "ok"


# ---- a seed means the same text --------------------------------------------------------------------------
def test_seeded_text_is_the_same_under_load_and_for_every_method_and_gamma(srv):
    req = chat(temperature=0.8, seed=1234, max_tokens=24)
    post = lambda b: httpx.post(srv.base_url + "/v1/chat/completions", json=b, headers=AUTH, timeout=120).json()
    alone = post(req)["choices"][0]["message"]["content"]
    others = [chat(temperature=0.9, seed=s, max_tokens=20 + s, messages=[{"role": "user", "content": f"topic {s}"}])
              for s in range(6)]
    with concurrent.futures.ThreadPoolExecutor(14) as pool:
        futs = [pool.submit(post, req) for _ in range(8)] + [pool.submit(post, o) for o in others]
        texts = [f.result()["choices"][0]["message"]["content"] for f in futs[:8]]
        [f.result() for f in futs[8:]]
    assert texts == [alone] * 8
    for ext in ({"gamma": 4}, {"gamma": 2}, {"gamma": 0}, {"method": "ar"}):
        assert post({**req, "draftwise": ext})["choices"][0]["message"]["content"] == alone, ext


def test_a_fresh_server_gives_the_same_seeded_text(srv, tiny_dw):
    req = chat(temperature=0.8, seed=99, max_tokens=16)
    first = httpx.post(srv.base_url + "/v1/chat/completions", json=req, headers=AUTH, timeout=60).json()
    engine = Engine(tiny_dw, EngineConfig(method="pld", gamma=3, max_model_len=200, max_batch=4))
    with BackgroundServer(engine, MODEL) as other:
        second = httpx.post(other.base_url + "/v1/chat/completions", json=req, timeout=60).json()
    assert second["choices"][0]["message"] == first["choices"][0]["message"]


# ---- fuzzing ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="schemathesis is not installed (pip install -e '.[test]')")
def test_schemathesis_finds_no_server_error(tiny_dw, tmp_path):
    """Property-based requests generated from the server's own OpenAPI schema (examples, coverage and
    fuzzing phases, a fixed seed and time budget): no 5xx, no hang, the server alive after. A short
    context keeps the valid generations short; the longer run is in the README."""
    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, max_model_len=48, max_batch=4, max_queue=8))
    with BackgroundServer(engine, MODEL, api_key=KEY) as fuzzed:
        cmd = [shutil.which("schemathesis"), "run", fuzzed.base_url + "/openapi.json", "--checks",
               "not_a_server_error", "-H", f"Authorization: Bearer {KEY}", "--max-examples", "20",
               "--max-time", "75", "--seed", "1", "--request-timeout", "60", "--workers", "1",
               "--phases", "examples,coverage,fuzzing", "--suppress-health-check", "all"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
        assert "404 Not Found" not in r.stdout, r.stdout[-3000:]  # the generated requests reach the engine
        assert httpx.get(fuzzed.base_url + "/health").json()["status"] == "ok"
        assert engine.metrics.generation_tokens._value.get() > 0


# ---- request parsing, property-based ---------------------------------------------------------------------
_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                          st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
_json = st.recursive(_json_scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.text(max_size=6), kids, max_size=3), max_leaves=8)
_fields = {
    "model": st.sampled_from([MODEL, "gpt-4", ""]) | _json,
    "prompt": st.text(max_size=12) | st.lists(st.integers(-5, 400), max_size=4) | _json,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot"]),
                                                "content": st.text(max_size=8) | _json}), max_size=2) | _json,
    "max_tokens": st.integers(-3, 10**6) | _json, "temperature": st.floats() | _json,
    "top_p": st.floats() | _json, "top_k": st.integers(-3, 10**6) | _json, "n": st.integers(-1, 40) | _json,
    "seed": st.integers(-(2**65), 2**65) | _json, "stop": st.lists(st.text(max_size=3), max_size=18) | _json,
    "stream": _json, "draftwise": st.fixed_dictionaries({}, optional={"method": st.text(max_size=5) | _json,
                                                                       "gamma": st.integers(-2, 9) | _json}),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({}, optional=_fields), chat_route=st.booleans())
def test_request_parsing_never_fails_unexpectedly(tiny_dw, body, chat_route):
    """Any JSON body through the parsing the routes do (pydantic model, then the sampling parameters of
    each choice): either accepted, or one OpenAI-style 4xx error naming a parameter — never another
    exception (a 5xx)."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from draftwise.errors import DraftwiseError
    from draftwise.serve.app import validation_error
    from draftwise.serve.protocol import ChatCompletionRequest, CompletionRequest

    try:
        req = (ChatCompletionRequest if chat_route else CompletionRequest).model_validate(body)
    except ValidationError as e:
        err = validation_error(RequestValidationError(e.errors()))
        assert err.status == 400 and err.message
        return
    try:
        for j in range(min(req.n, 3)):
            SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                           top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
                           max_tokens=(req.max_tokens or 16), stop=tuple(req.stop),
                           seed=None if req.seed is None else (req.seed + j) % (1 << 64))
    except DraftwiseError:
        pass  # answered as a 400 by the app
    if not chat_route:
        for p in req.prompts():
            assert isinstance(p, (str, list))
