"""A running stream and a long prompt arriving meanwhile, against a running draftwise server: the stream's
gaps between tokens (its longest while the long prompt is prefilled) and the long prompt's time to first
token. Usage: python mixed.py URL OUT.json"""
import asyncio, inspect, json, sys, time
import json.decoder
import httpx

URL, OUT = sys.argv[1], sys.argv[2]
MODEL = "qwen2.5-coder-1.5b-instruct"
SOURCE = inspect.getsource(json.decoder)[:5200]  # ~1500 tokens of Python: a prompt no cache holds


async def stream(c, messages, max_tokens, stamps):
    t0 = time.perf_counter()
    async with c.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                if d.get("usage"):
                    stamps.append(("usage", d["usage"]))
                for ch in d.get("choices", []):
                    if ch.get("delta", {}).get("content"):
                        stamps.append((time.perf_counter() - t0, None))


async def main():
    async with httpx.AsyncClient(base_url=URL, timeout=900) as c:
        runner, longp = [], []
        task = asyncio.create_task(stream(c, [{"role": "user", "content": "Write a long, detailed tutorial on "
                                                "Python decorators with many examples."}], 400, runner))
        await asyncio.sleep(6.0)
        t_submit = time.perf_counter()
        await stream(c, [{"role": "user", "content": "Explain what this module does, function by function:\n\n"
                          + SOURCE}], 16, longp)
        await task
    times = [t for t, u in runner if u is None]
    gaps = [b - a for a, b in zip(times, times[1:])]
    long_ttft = next(t for t, u in longp if u is None)
    usage = next(u for t, u in longp if u is not None)
    res = {"long_prompt_tokens": usage["prompt_tokens"], "long_ttft_s": round(long_ttft, 2),
           "stream_tokens": len(times), "stream_max_gap_s": round(max(gaps), 2),
           "stream_gaps_over_1s": sum(g > 1 for g in gaps), "stream_total_s": round(times[-1], 2)}
    print(json.dumps(res), flush=True)
    json.dump(res, open(OUT, "w"), indent=1)

asyncio.run(main())
