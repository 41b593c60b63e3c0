"""Prefill of the 1.5B in exact chunks of 32 against one pass over the prompt (medians of three).
Usage: python chunk2.py 64,128,256,512,1024,2048"""
import draftwise  # noqa  (before torch)
from pathlib import Path
QUESTIONS = Path(draftwise.__file__).parent / "bench/data/spec_bench/question.jsonl"
import sys, time, json, torch, statistics
from draftwise.models import load_model
lm = load_model("qwen2.5-coder-1.5b-instruct")
model, tok = lm.model, lm.tokenizer
text = " ".join(json.loads(l)["turns"][0] for l in open(QUESTIONS).readlines()[300:400])
allids = tok.encode(text)
def run(ids, C):
    cache = model.new_cache(1, 4200)
    t = time.perf_counter()
    for s in range(0, len(ids), C):
        out = model.forward(torch.tensor([ids[s:s + C]]), cache, logits_for="last")
    return time.perf_counter() - t
run(allids[:300], 300); run(allids[:300], 32)
for N in [int(x) for x in sys.argv[1].split(",")]:
    ids = allids[:N]
    res = {"whole": [], "c32": []}
    for rep in range(3):
        res["whole"].append(run(ids, N)); res["c32"].append(run(ids, 32))
    w, c = statistics.median(res["whole"]), statistics.median(res["c32"])
    print(f"N={N:5d} whole {N/w:6.1f} tok/s  chunks-32 {N/c:6.1f} tok/s  ratio {w/c:.2f}", flush=True)
