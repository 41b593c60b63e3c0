# The Python API as a library user runs it: `import torch` first (or draftwise first), then the six code prompts
# with each method; prints the wall time per method. Run with PYTHONPATH pointing at the checkout to measure.
import sys
first = sys.argv[1]
if first == "torch":
    import torch  # noqa: F401
import json
import os
import time
from pathlib import Path

import draftwise
from draftwise import SamplingParams, SpeculativeDecoder
from draftwise.api import setup_threads
try:
    from draftwise.settings import openmp_spins_long
except ImportError:  # a checkout from before it
    openmp_spins_long = None

setup_threads(2)
dw = SpeculativeDecoder("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", progress=False)
prompts = [json.loads(line)["turns"][0] for line in open(Path(__file__).with_name("code.jsonl"))]
ids = [dw.encode(p) for p in prompts]
dw.generate(ids[0], SamplingParams(max_tokens=8), method="draft")  # load both models, warm up
row = {"first": first, "checkout": str(Path(draftwise.__file__).parent.parent.name),
       "long_spin": openmp_spins_long() if openmp_spins_long else None,
       "preload": os.path.basename(os.environ.get("LD_PRELOAD", ""))}  # libiomp5.so: torch's OpenMP is Intel's
for method in sys.argv[2].split(","):
    t, n = time.perf_counter(), 0
    for x in ids:
        n += len(dw.generate(x, SamplingParams(max_tokens=128), method=method).token_ids)
    row[method] = round(time.perf_counter() - t, 2)
    row[method + "_tokens"] = n
print(json.dumps(row), flush=True)
