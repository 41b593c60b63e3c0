"""The server over hours (tiny model): memory that comes back, a disconnect storm, graceful shutdown.

- a freed KV row's pages leave the resident set (madvise) and the row stays usable; the engine gives the
  rows sequences left back, and trims malloc when idle; every cross-request structure is in /metrics;
- hundreds of streams opened and dropped within milliseconds, half-written bodies and abandoned plain
  requests leave the server serving, every row free, no connection or task left in uvicorn, no file
  descriptor leaked;
- ``draftwise serve`` as a real process: SIGTERM drains (503 + Retry-After for new requests, /health
  503, admitted requests finish), exits 0; past --shutdown-timeout the rest fail and it still exits 0;
  a second SIGTERM exits at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from draftwise.api import SpeculativeDecoder
from draftwise.memory import PAGE, can_release, rss_bytes
from draftwise.models import LoadedModel, load_model
from draftwise.models.base import KVCache
from draftwise.serve.engine import Engine, EngineConfig
from draftwise.serve.server import BackgroundServer
from tests.conftest import perturbed

MODEL = "tiny"
linux_only = pytest.mark.skipif(not can_release(), reason="madvise through libc (Linux)")


@pytest.fixture(scope="module")
def tiny_dw(hf_folder) -> SpeculativeDecoder:
    target = load_model(str(hf_folder), "bf16", progress=False)
    noisy = perturbed(target.model, 0.3, seed=5).to(target.model.dtype)
    return SpeculativeDecoder(target, LoadedModel("tiny-draft", noisy, target.tokenizer, 0.0))


def wait_for(cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what or cond}"
        time.sleep(0.02)


# ---- memory that comes back ----------------------------------------------------------------------------
@linux_only
def test_released_rows_leave_the_resident_set_and_stay_usable():
    # (layers 4, rows 4, kv heads 2, capacity 4096, head_dim 64) fp32: 8 MiB per row per k/v
    cache = KVCache(4, 4, 2, 4096, 64, torch.float32)
    cache.k.fill_(1.0)
    cache.v.fill_(1.0)
    cache.lengths[:] = 4096
    before = rss_bytes()
    released = cache.release_rows(1, 4)
    after = rss_bytes()
    assert released >= 3 * 2 * 8 * 2**20 - 2 * 4 * 2 * PAGE  # whole pages of rows 1..3, k and v
    assert before - after > 40 * 2**20, (before, after)  # ~48 MiB left the resident set
    assert cache.lengths.tolist() == [4096, 0, 0, 0]
    assert bool((cache.k[:, 0] == 1.0).all()) and bool((cache.v[:, 0] == 1.0).all())  # row 0 untouched
    cache.k[:, 2].fill_(3.0)  # a released row takes writes again
    assert bool((cache.k[:, 2] == 3.0).all())
    assert cache.release_rows(2, 2) == 0


@linux_only
def test_engine_gives_freed_rows_back_and_exports_its_bounded_structures(tiny_dw):
    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, max_model_len=200, max_batch=4, max_queue=8))
    assert len(engine.kv_caches) == 2  # the target's and the draft model's
    with BackgroundServer(engine, MODEL) as srv:
        async def burst():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
                body = {"model": MODEL, "prompt": "hello world", "max_tokens": 40, "temperature": 0,
                        "ignore_eos": True}
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(6)))
        assert all(r.status_code == 200 for r in asyncio.run(burst()))
        wait_for(lambda: engine.snapshot()["requests"] == 0 and engine._used_rows == 0)
        text = httpx.get(srv.base_url + "/metrics").text
    metrics = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    # every row the burst used was given back: at least 4 rows × (target + draft) keys and values
    per_row = sum(c.k[:, 0].numel() * c.k.element_size() * 2 for c in engine.kv_caches)
    assert metrics["draftwise_kv_cache_released_bytes_total"] >= 0.5 * 4 * per_row  # less the partial pages
    assert metrics["draftwise_open_requests"] == 0
    assert metrics["draftwise_open_requests_limit"] == engine.rows + 8
    for name in ("draftwise_suffix_cache_tokens", "draftwise_suffix_cache_limit_tokens", "draftwise_draining",
                 "draftwise_process_resident_memory_bytes"):
        assert name in metrics, name


@linux_only
def test_engine_keeps_freed_rows_while_busy_and_gives_them_back_when_idle(tiny_dw):
    # under steady load a freed row keeps its pages for the next sequence (RSS flat, no re-faulting);
    # the rows go back to the OS once nothing is running or waiting
    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, max_model_len=256, max_batch=2, max_queue=4))
    released = lambda: engine.metrics.kv_released._value.get()  # noqa: E731
    with BackgroundServer(engine, MODEL) as srv:
        async def long_and_short():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as c:
                body = {"model": MODEL, "prompt": "hello world", "temperature": 0, "ignore_eos": True}
                long = asyncio.ensure_future(c.post("/v1/completions", json={**body, "max_tokens": 240}))
                while engine.batch_size < 1 and not long.done():  # the long request is running
                    await asyncio.sleep(0.005)
                short = await c.post("/v1/completions", json={**body, "max_tokens": 4})
                busy = engine.batch_size  # the long request still running
                released_while_busy = released()
                long = await long
                assert long.status_code == 200, long.text
                return short, busy, released_while_busy, long
        short, busy, released_while_busy, long = asyncio.run(long_and_short())
        assert short.status_code == 200 and long.status_code == 200
        assert busy == 1, "the long request finished before the short one: the test needs a longer one"
        assert released_while_busy == 0
        wait_for(lambda: engine.snapshot()["requests"] == 0 and engine._used_rows == 0)
    assert released() > 0


def test_engine_collects_reference_cycles_when_it_goes_idle(tiny_dw):
    # a tensor only a reference cycle holds (a request's task, frame or error) is freed by a full
    # collection; with automatic collection off, the engine's own (on going idle) must be the one
    import gc
    import weakref

    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, max_model_len=256, max_batch=2))
    gc.disable()
    try:
        cycle: list = [torch.zeros(1024)]
        cycle.append(cycle)
        held = weakref.ref(cycle[0])
        del cycle
        assert held() is not None
        with BackgroundServer(engine, MODEL) as srv:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
            assert httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
            wait_for(lambda: held() is None, what="the idle engine's collection")
    finally:
        gc.enable()


def test_suffix_store_is_bounded_and_exported(tiny_dw):
    tiny_dw.suffix_cache.clear()
    old = tiny_dw.suffix_cache.max_tokens
    tiny_dw.suffix_cache.max_tokens = 100
    try:
        engine = Engine(tiny_dw, EngineConfig(method="suffix", gamma=3, max_model_len=200, max_batch=2))
        assert engine.suffix_stores == [tiny_dw.suffix_cache]
        with BackgroundServer(engine, MODEL) as srv:
            for i in range(4):
                body = {"model": MODEL, "prompt": f"request {i} " * 3, "max_tokens": 30, "temperature": 0,
                        "ignore_eos": True}
                assert httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
            wait_for(lambda: engine.snapshot()["requests"] == 0)
            text = httpx.get(srv.base_url + "/metrics").text
        tokens = [ln for ln in text.splitlines() if ln.startswith("draftwise_suffix_cache_tokens ")]
        assert 30 < float(tokens[0].split()[1]) <= 100  # earlier requests held, the oldest evicted
        assert "draftwise_suffix_cache_limit_tokens 100.0" in text
    finally:
        tiny_dw.suffix_cache.max_tokens = old
        tiny_dw.suffix_cache.clear()


# ---- the disconnect storm --------------------------------------------------------------------------------
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="/proc (Linux)")
def test_disconnect_storm_leaves_the_server_serving_with_nothing_leaked(tiny_dw):
    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, max_model_len=200, max_batch=8, max_queue=64))
    with BackgroundServer(engine, MODEL) as srv:
        state = srv.server.server_state
        ok = httpx.post(srv.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200
        fds_before = _open_fds()
        stream = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}],
                             "max_tokens": 150, "ignore_eos": True, "stream": True}).encode()
        plain = json.dumps({"model": MODEL, "prompt": "a long answer", "max_tokens": 150, "ignore_eos": True}).encode()

        def request(path: str, body: bytes, length: int | None = None) -> bytes:
            return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body

        def storm(n: int) -> None:
            for i in range(n):
                s = socket.create_connection((srv.host, srv.port))
                kind = i % 4
                if kind == 0:  # a stream dropped as soon as it is sent
                    s.sendall(request("/v1/chat/completions", stream))
                elif kind == 1:  # a stream dropped after its first bytes came back
                    s.sendall(request("/v1/chat/completions", stream))
                    s.settimeout(10)
                    s.recv(64)
                elif kind == 2:  # a half-written body: Content-Length promises more than is sent
                    s.sendall(request("/v1/completions", plain, length=len(plain) + 500)[:-40])
                else:  # a plain (non-streaming) request abandoned
                    s.sendall(request("/v1/completions", plain))
                if i % 2:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                s.close()

        threads = [threading.Thread(target=storm, args=(75,)) for _ in range(4)]  # 300 connections
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        # the server keeps serving during the aftermath: connections still in the listen backlog are read after
        # their clients left and may fill the queue for a moment, so a 503 (with its Retry-After) is
        # back-pressure, not a fault; a client that honours it is served once they are dropped
        deadline = time.monotonic() + 60
        while True:
            r = httpx.post(srv.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
                           timeout=60)
            if r.status_code != 503 or time.monotonic() > deadline:
                break
            assert r.headers.get("retry-after") == "1" and r.json()["error"]["code"] == "server_overloaded"
            time.sleep(0.2)
        assert r.status_code == 200
        # every request ends (the plain ones are noticed within DISCONNECT_POLL_S), every row is free
        wait_for(lambda: engine.snapshot()["requests"] == 0, 60, "the engine's requests to end")
        snap = engine.snapshot()
        assert snap["running"] == 0 and snap["waiting"] == 0 and engine.alive
        # uvicorn holds no connection and no task; the process no more descriptors than before
        wait_for(lambda: not state.connections and not state.tasks, 30, "uvicorn's connections to close")
        wait_for(lambda: _open_fds() <= fds_before, 10, "file descriptors to be closed")
        text = httpx.get(srv.base_url + "/metrics").text
        assert "draftwise_requests_failed_total 0.0" in text
        assert 'finish_reason="abort"' in text
        assert httpx.post(srv.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hello",
                                                                   "max_tokens": 5}).status_code == 200


# ---- graceful shutdown (a real process) ----------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def start_server(hf_folder, *extra: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "draftwise.cli", "serve", "--target", str(hf_folder),
                             "--method", "ar", "--port", str(port), "--max-model-len", "256", "--threads", "1",
                             "--log-level", "warning", *extra],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # a loaded 2-core machine took 90+ s to import and start it
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the server did not start: {proc.communicate()[1]}")
        time.sleep(0.2)


def long_body(hf_folder, max_tokens: int = 240) -> dict:
    return {"model": str(hf_folder), "prompt": "once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}


def read_stream(url: str, body: dict, out: dict, started: threading.Event) -> None:
    """One streaming request: records its finish reasons, whether [DONE] came and any error event."""
    out.update(finish=[], done=False, error=None, status=None)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code  # the headers come back once the request is admitted
            started.set()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if "error" in data:
                        out["error"] = data["error"]["message"]
                    for c in data.get("choices", []):
                        if c.get("finish_reason"):
                            out["finish"].append(c["finish_reason"])
    except httpx.TransportError as e:
        out["error"] = f"transport: {type(e).__name__}"
    finally:
        started.set()


def in_flight(url: str, body: dict, n: int) -> list[tuple[threading.Thread, dict]]:
    """n streaming requests, all admitted when this returns. With --max-batch 1 they run one after
    another (~0.15 s each on a 2-core machine), so most are still waiting for the row."""
    out, events = [], []
    for _ in range(n):
        rec, started = {}, threading.Event()
        t = threading.Thread(target=read_stream, args=(url, body, rec, started), daemon=True)
        t.start()
        out.append((t, rec))
        events.append(started)
    for e in events:
        assert e.wait(60)
    assert all(rec["status"] == 200 for _, rec in out), [rec for _, rec in out]
    return out


def test_sigterm_drains_admitted_requests_then_exits_0(hf_folder):
    proc, url = start_server(hf_folder, "--max-batch", "1", "--shutdown-timeout", "60")
    try:
        reqs = in_flight(url, long_body(hf_folder), 40)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(url + "/health").status_code == 503, 10, "/health to say draining")
        health = httpx.get(url + "/health")
        assert health.json()["status"] == "draining" and health.headers["retry-after"]
        refused = httpx.post(url + "/v1/completions", json={"model": str(hf_folder), "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "shutting_down"
        for t, rec in reqs:
            t.join(120)
            assert rec["status"] == 200 and rec["finish"] == ["length"] and rec["done"] and rec["error"] is None
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "draining" in err and "drained" in err and "Traceback" not in err


def test_shutdown_timeout_fails_the_rest_and_a_second_sigterm_exits_at_once(hf_folder):
    # past --shutdown-timeout: what still runs ends with an error event, and the exit status is still 0
    proc, url = start_server(hf_folder, "--max-batch", "1", "--shutdown-timeout", "0.5")
    try:
        reqs = in_flight(url, long_body(hf_folder), 40)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "--shutdown-timeout (0.5 s) passed" in err
        for t, rec in reqs:
            t.join(30)
        failed = [rec for _, rec in reqs if rec["error"] is not None]
        assert failed and all(rec["finish"] == [] and "shutting down" in rec["error"] for rec in failed), failed
        assert all(rec["finish"] == ["length"] and rec["done"] for _, rec in reqs if rec["error"] is None)
    finally:
        if proc.poll() is None:
            proc.kill()
    # a second SIGTERM: out at once (status 1), however long the admitted requests would take
    proc, url = start_server(hf_folder, "--max-batch", "1", "--shutdown-timeout", "300")
    try:
        in_flight(url, long_body(hf_folder), 40)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining" in httpx.get(url + "/health").text, 10)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 5
        assert proc.returncode == 1, err
        assert "second signal" in err
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- the app's pieces, without a server ----------------------------------------------------------------
def test_route_helpers_work_alone(tiny_dw):
    """The routes' helpers are module-level functions over a ServerContext: testable without uvicorn."""
    from draftwise.serve.app import ServerContext, check_common, sequences
    from draftwise.serve.protocol import APIError, CompletionRequest

    engine = Engine(tiny_dw, EngineConfig(method="draft", gamma=3, max_model_len=100, max_batch=2, max_queue=2))
    ctx = ServerContext(engine, MODEL)
    check_common(ctx, CompletionRequest(model=MODEL, prompt="hi"), 1)
    with pytest.raises(APIError) as e:
        check_common(ctx, CompletionRequest(model="other", prompt="hi"), 1)
    assert e.value.status == 404 and e.value.code == "model_not_found"
    with pytest.raises(APIError) as e:
        check_common(ctx, CompletionRequest(model=MODEL, prompt="hi", n=3), 2)  # 6 choices > 2 rows + 2 queued
    assert e.value.param == "n"
    body = CompletionRequest(model=MODEL, prompt="hi", n=2, max_tokens=5, seed=7, draftwise={"method": "ar"})
    seqs = sequences(engine, body, [[1, 2, 3]], chat=False)
    assert [s.index for s in seqs] == [0, 1] and [s.params.seed for s in seqs] == [7, 8]
    assert all(s.method == "ar" and s.gamma_cap == 0 for s in seqs)
    with pytest.raises(APIError) as e:
        sequences(engine, CompletionRequest(model=MODEL, prompt="hi", max_tokens=99), [[1, 2, 3]], chat=False)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"
