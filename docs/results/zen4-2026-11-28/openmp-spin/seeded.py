# Seeded top-p text in three processes: torch imported first (2 threads), draftwise first (2 threads, 1 thread).
# python seeded.py torch 2; python seeded.py draftwise 2; python seeded.py draftwise 1  -> one JSON line each
import sys
if sys.argv[1] == "torch":
    import torch  # noqa: F401
import json
import draftwise
from draftwise import SamplingParams, SpeculativeDecoder
from draftwise.api import setup_threads
from draftwise.settings import openmp_spins_long
setup_threads(int(sys.argv[2]))
dw = SpeculativeDecoder("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", progress=False)
out = {"long_spin": openmp_spins_long()}
for i, p in enumerate(["def quicksort(arr):", "Write a haiku about the sea."]):
    for m in ("ar", "draft", "pld"):
        r = dw.generate(p, SamplingParams(max_tokens=48, temperature=0.8, top_p=0.9, seed=7 + i), method=m)
        out[f"{i}-{m}"] = r.token_ids
print(json.dumps(out))
