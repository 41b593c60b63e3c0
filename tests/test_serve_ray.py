"""``draftwise serve --replicas N`` on Ray Serve: options, and on loopback with 2 SmolLM2 replicas a load
test where a replica is killed mid-load (every request completes or gets an error, the replica is
replaced) and an overload where what does not fit is refused with 503."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from draftwise.cli import build_parser

PROMPTS = ["Write a Python function that adds two numbers.", "Name three colours.",
           "What is the capital of Italy?", "Write a haiku about rain."]


def serve_args(*extra: str):
    return build_parser().parse_args(["serve", "--target", "smollm2-135m-instruct", *extra])


def test_spec_carries_the_engine_options_and_splits_the_cores():
    from draftwise.serve.ray_serve import spec_from_args

    spec = spec_from_args(serve_args("--method", "pld", "--replicas", "2", "--max-batch", "4", "--max-queue", "3",
                                     "--max-queued-requests", "5"))
    assert spec["replicas"] == 2 and spec["engine"]["method"] == "pld"
    assert spec["engine"]["max_batch"] == 4 and spec["engine"]["max_queue"] == 3
    assert spec["max_queued_requests"] == 5
    assert spec["threads"] >= 1 and spec["name"] == "smollm2-135m-instruct"
    assert spec_from_args(serve_args("--replicas", "2", "--threads", "3"))["threads"] == 3


def test_bad_options_are_refused_before_ray_starts():
    from draftwise.errors import InvalidParameterError
    from draftwise.serve.ray_serve import spec_from_args

    with pytest.raises(InvalidParameterError, match="max-queue"):
        spec_from_args(serve_args("--replicas", "2", "--max-queue", "-1"))
    with pytest.raises(InvalidParameterError, match="max-queued-requests"):
        spec_from_args(serve_args("--replicas", "2", "--max-queued-requests", "-2"))
    with pytest.raises(SystemExit):
        serve_args("--replicas", "0")


def test_serve_run_builder_takes_the_cli_options():
    """``serve run draftwise.cli.serve:build_app key=value ...`` parses with the CLI's own parser."""
    pytest.importorskip("ray.serve", reason="Ray Serve is the optional [ray] extra")
    from draftwise.cli.serve import build_app

    app = build_app({"target": "smollm2-135m-instruct", "method": "pld", "replicas": "2", "max_batch": "4"})
    assert type(app).__name__ == "Application"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(url: str, prompt: str, max_tokens: int = 160) -> tuple[int, str]:
    import httpx

    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    except httpx.HTTPError as e:  # a connection the dying replica's proxy dropped: an error, not a hang
        return -1, type(e).__name__
    if r.status_code == 200:
        return 200, r.json()["choices"][0]["message"]["content"]
    return r.status_code, r.text


@pytest.mark.slow
def test_two_replicas_survive_a_killed_replica_and_refuse_overload_with_503():
    ray = pytest.importorskip("ray", reason="Ray Serve is the optional [ray] extra")
    from ray import serve

    from draftwise.serve.ray_serve import (APP_NAME, deployment, prepare_models, replica_actors,
                                           running_replicas, spec_from_args)

    spec = spec_from_args(serve_args("--method", "pld", "--replicas", "2", "--threads", "1", "--max-batch", "2",
                                     "--max-queue", "4", "--max-queued-requests", "4", "--max-model-len", "512"))
    prepare_models(spec)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(spec), name=APP_NAME, route_prefix="/")
        assert running_replicas() == 2
        reference = {p: _ask(url, p) for p in PROMPTS}  # one at a time: greedy, deterministic
        assert all(status == 200 and text for status, text in reference.values())

        # a replica killed while 8 requests are in flight or queued
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_ask, url, PROMPTS[i % 4]) for i in range(8)]
            time.sleep(1.0)
            victim = replica_actors()[0]
            ray.kill(victim, no_restart=True)
            t_kill = time.monotonic()
            answers = [(PROMPTS[i % 4], f.result(timeout=300)) for i, f in enumerate(futures)]
            print(f"killed a replica {time.monotonic() - t_kill:.1f} s before the last answer")
        print("statuses with a replica killed:", [status for _, (status, _) in answers])
        for prompt, (status, text) in answers:
            if status == 200:
                assert text == reference[prompt][1]  # nothing mixed with another request's output
            else:
                assert status == -1 or status >= 500, (status, text)  # an error, never a silent wrong answer
        assert 200 in [status for _, (status, _) in answers]  # the other replica kept serving

        deadline = time.monotonic() + 180
        while running_replicas() < 2 or len(replica_actors()) < 2:
            assert time.monotonic() < deadline, "the killed replica was not replaced"
            time.sleep(1.0)
        print(f"replaced {time.monotonic() - t_kill:.0f} s after the kill")
        assert all(_ask(url, p) == reference[p] for p in PROMPTS)

        # overload: 2 replicas × (2 rows + 4 queued) + 4 at the proxy = 16 fit; 40 at once
        with ThreadPoolExecutor(40) as pool:
            burst = list(pool.map(lambda i: (PROMPTS[i % 4], _ask(url, PROMPTS[i % 4], 24)), range(40)))
        statuses = [status for _, (status, _) in burst]
        print("statuses of the burst:", statuses)
        assert set(statuses) <= {200, 503}, statuses
        assert 503 in statuses and 200 in statuses
        for prompt, (status, text) in burst:
            if status == 200:
                assert reference[prompt][1].startswith(text)  # 24 of the same greedy tokens
    finally:
        serve.shutdown()
        ray.shutdown()
