"""A multi-turn chat against a running draftwise server: each turn sends the whole conversation (as OpenAI
clients do) and streams the answer; prints per turn the prompt tokens, cached tokens, time to first token
and the total. Usage: python conversation.py URL OUT.json"""
import json, sys, time
import httpx

URL, OUT = sys.argv[1], sys.argv[2]
TURNS = [
    "Write a Python class LRUCache with get and put in O(1), using an OrderedDict. Include type hints and a docstring.",
    "Add a method that returns the current keys from most to least recently used, and explain its complexity.",
    "Now make it thread-safe. Which operations need the lock, and why?",
    "Write pytest tests for the thread-safe version, including a test with several threads.",
    "Add a time-to-live per entry: expired entries are dropped on access. Show the changed methods only.",
    "Summarize every design decision we made in this conversation as a bulleted list.",
    "Rewrite the class in Rust with the same API, using a HashMap and a doubly linked list of indices.",
    "What are the differences between the Python and the Rust versions in memory use and speed?",
]
messages = [{"role": "system", "content": "You are a senior software engineer. Answer with code and short explanations."}]
rows = []
with httpx.Client(base_url=URL, timeout=600) as c:
    for i, text in enumerate(TURNS):
        messages.append({"role": "user", "content": text})
        t0 = time.perf_counter()
        ttft = None
        answer = ""
        usage = None
        with c.stream("POST", "/v1/chat/completions", json={
                "model": "qwen2.5-coder-1.5b-instruct", "messages": messages, "max_tokens": 160,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    usage = d["usage"]
                for ch in d.get("choices", []):
                    piece = ch.get("delta", {}).get("content")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        answer += piece
        total = time.perf_counter() - t0
        messages.append({"role": "assistant", "content": answer})
        row = {"turn": i + 1, "prompt_tokens": usage["prompt_tokens"],
               "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
               "completion_tokens": usage["completion_tokens"], "ttft_s": round(ttft, 3), "total_s": round(total, 3),
               "answer_sha": __import__("hashlib").sha256(answer.encode()).hexdigest()[:12]}
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(OUT, "w"), indent=1)
