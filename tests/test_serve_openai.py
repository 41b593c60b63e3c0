"""The server with real weights (SmolLM2-135M-Instruct as target and as its own draft model), driven by
the official ``openai`` client, unchanged, over loopback: completions, chat, streaming, n > 1, stop
sequences, a 32-request concurrent load test, and a client disconnecting mid-stream."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from draftwise.api import SpeculativeDecoder
from draftwise.sampling import SamplingParams
from draftwise.serve.engine import Engine, EngineConfig
from draftwise.serve.server import BackgroundServer

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TOPICS = ["the moon", "volcanoes", "bees", "the ocean", "chess", "coffee", "rainbows", "penguins", "Paris",
          "the piano", "trees", "bicycles", "honey", "glaciers", "owls", "tea", "deserts", "whales", "Mars",
          "bread", "lightning", "cats", "rivers", "the violin", "snow", "tigers", "clocks", "mushrooms",
          "the Nile", "kites", "dolphins", "salt"]


@pytest.fixture(scope="module")
def server(smollm):
    dw = SpeculativeDecoder(smollm, draft=smollm)
    # fixed γ so speculation runs on every step (the adaptive policy would rightly turn it off here: a
    # draft model as large as the target does not pay)
    engine = Engine(dw, EngineConfig(method="draft", gamma=3, gamma_policy="fixed", max_model_len=512,
                                     max_batch=8, max_queue=40, kv_cache_mb=512))
    with BackgroundServer(engine, MODEL) as srv:
        srv.dw = dw
        yield srv


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Tell me one short fact about {topic}."}]


def test_completion_matches_the_library(server, client):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    lib = server.dw.generate(prompt, SamplingParams(max_tokens=8), method="ar")
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == lib.text and r.choices[0].text.strip()
    assert r.choices[0].finish_reason == lib.finish_reason
    assert r.usage.prompt_tokens == len(server.dw.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(lib.token_ids)
    ext = r.model_extra["draftwise"]
    assert ext["method"] == "draft" and ext["mean_accepted_length"] >= 1.0 and ext["drafted"] > 0


def test_chat_and_models(server, client):
    r = client.chat.completions.create(model=MODEL, messages=chat("the moon"), max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content.strip()
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0.0 <= r.model_extra["draftwise"]["acceptance_rate"] <= 1.0
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"


def test_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, messages=chat("volcanoes"), max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["draftwise"]["method"] == "draft"
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices
    stream = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=10, temperature=0,
                                       stream=True)
    text = "".join(c.choices[0].text for c in stream)
    assert text == client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=10,
                                             temperature=0).choices[0].text


def test_n_choices_seeded(client):
    kw = dict(model=MODEL, messages=chat("bees"), max_tokens=8, temperature=0.9, seed=7, n=3)
    a = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert 3 <= a.usage.completion_tokens <= 3 * 8
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seeded
    assert len({c.message.content for c in a.choices}) > 1  # each choice has its own generator
    streamed = list(client.chat.completions.create(**kw, stream=True))
    texts = ["", "", ""]
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in a.choices]


def test_seeded_request_same_text_under_load_and_as_plain(server, client):
    """The hardening issue's done-when on real weights: 8 concurrent copies of a seeded request beside 6
    other seeded requests all equal the request sent alone, and equal it with plain decoding."""
    kw = dict(model=MODEL, messages=chat("bees"), max_tokens=24, temperature=0.8, seed=2024)
    alone = client.chat.completions.create(**kw).choices[0].message.content

    async def load():
        aclient = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0)
        copies = [aclient.chat.completions.create(**kw) for _ in range(8)]
        others = [aclient.chat.completions.create(model=MODEL, messages=chat(t), max_tokens=16 + i,
                                                  temperature=0.9, seed=i) for i, t in enumerate(TOPICS[:6])]
        out = await asyncio.gather(*copies, *others)
        await aclient.close()
        return [r.choices[0].message.content for r in out[:8]]
    assert asyncio.run(load()) == [alone] * 8
    for ext in ({"method": "ar"}, {"gamma": 1}, {"gamma": 3}):
        r = client.chat.completions.create(**kw, extra_body={"draftwise": ext})
        assert r.choices[0].message.content == alone, ext


def test_stop_sequences(client):
    kw = dict(model=MODEL, prompt="Here is a list of fruits: apple, banana,", max_tokens=20, temperature=0)
    ref = client.completions.create(**kw).choices[0].text
    words = [w for w in ref.split() if len(w) > 2]
    stop = words[len(words) // 2]
    cut = ref[:ref.find(stop)]
    r = client.completions.create(**kw, stop=[stop, "@@@"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_32_concurrent_streams_match_alone(server, client):
    """32 different prompts at once (8 rows, the rest queued; a third plain decoding, a third γ 1): every
    stream completes with exactly the text its request gives alone."""
    max_tokens = 12
    extras = [{"draftwise": {"method": "ar"}}, {}, {"draftwise": {"gamma": 1}}]
    alone = [client.chat.completions.create(model=MODEL, messages=chat(t), max_tokens=max_tokens, temperature=0,
                                            extra_body={"draftwise": {"method": "ar"}}).choices[0].message.content
             for t in TOPICS]

    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=chat(TOPICS[i]), max_tokens=max_tokens, temperature=0, stream=True,
            extra_body=extras[i % 3])
        text, finish = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        return text, finish

    async def run():
        aclient = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(len(TOPICS))))
        finally:
            await aclient.close()

    before = server.engine.metrics.requests._value.get()
    results = asyncio.run(run())
    assert len(results) == 32 and all(f in ("stop", "length") for _, f in results)
    assert [t for t, _ in results] == alone
    assert server.engine.metrics.requests._value.get() - before == 32
    assert server.engine.snapshot()["requests"] == 0


def test_disconnect_mid_stream_frees_the_slot(server, client):
    engine = server.engine
    aborted = engine.metrics.finished.labels("abort")._value.get()
    stream = client.chat.completions.create(model=MODEL, messages=chat("the ocean"), max_tokens=400,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for c in stream:
        got += bool(c.choices and c.choices[0].delta.content)
        if got >= 3:
            break
    assert engine.snapshot()["running"] == 1
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 15
    while engine.snapshot()["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    snap = engine.snapshot()
    assert snap["running"] == 0 and snap["requests"] == 0 and engine.decoder.free_rows == engine.rows
    assert engine.metrics.finished.labels("abort")._value.get() == aborted + 1
