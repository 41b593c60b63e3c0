"""Teacher-forced estimate of the draft lookup: tokens of the draft chain per unit of draft cost, per category
(python estimate.py; caches the 1.5B greedy texts and the 0.5B choices in cas.pkl)."""
import json, torch, pickle, os
from draftwise.api import SpeculativeDecoder, setup_threads
from draftwise.sampling import SamplingParams
from draftwise.drafters.pld import _continuation
setup_threads(2)
files = ["code.jsonl", "specbench12.jsonl"]
if not os.path.exists("cas.pkl"):
    dw = SpeculativeDecoder("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", progress=False)
    data = []
    for f in files:
        for line in open(f):
            q = json.loads(line)
            r = dw.generate(q["turns"][0], SamplingParams(temperature=0, max_tokens=128), method="ar")
            ids = dw.encode(q["turns"][0]); full = ids + r.token_ids
            m = dw.draft.model; cache = m.new_cache(1, len(full) + 4)
            with torch.inference_mode():
                d = m.forward(torch.tensor([full[:-1]]), cache, logits_for="all").logits[0].argmax(-1).tolist()
            data.append((q["category"], len(ids), full, d))
    pickle.dump(data, open("cas.pkl", "wb"))
data = pickle.load(open("cas.pkl", "rb"))
def lookup(toks, k, nmin, nmax=3):
    for n in range(nmax, nmin - 1, -1):
        if len(toks) <= n: continue
        key = toks[-n:]
        for e in range(len(toks) - 1, n - 1, -1):
            if toks[e - n:e] == key:
                return _continuation(toks, e, k), n
    return [], 0
cost = lambda T: [0, 1, 1.03, 1.14, 1.21, 1.36][T]
for nmin in (1, 2, 3):
  for cap in (1, 2, 3, 4):
    res = {}
    for cat, P, full, d in data:
        i = P; tok = 0; c = 0.0
        while i < len(full):
            prop, n = lookup(full[:i], cap, nmin)
            j = 0
            while j < len(prop) and i + j < len(full) and prop[j] == d[i - 1 + j] and d[i-1+j] == full[i+j]:
                j += 1
            c += cost(1 + len(prop)); tok += 1 + j; i += 1 + j
        r = res.setdefault(cat, [0, 0.0]); r[0] += tok; r[1] += c
    print(f"nmin {nmin} cap {cap}: " + " ".join(f"{k[:6]} {v[0]/v[1]:.2f}" for k, v in res.items()))
print("adaptive by n")
for caps in ((1,2,3),(1,1,3),(1,2,4),(1,1,2),(1,3,4)):
    res = {}
    for cat, P, full, d in data:
        i = P; tok = 0; c = 0.0
        while i < len(full):
            prop, n = lookup(full[:i], 4, 1)
            prop = prop[:caps[n-1]] if n else []
            j = 0
            while j < len(prop) and i + j < len(full) and prop[j] == d[i - 1 + j] and d[i-1+j] == full[i+j]:
                j += 1
            c += cost(1 + len(prop)); tok += 1 + j; i += 1 + j
        r = res.setdefault(cat, [0, 0.0]); r[0] += tok; r[1] += c
    print(caps, " ".join(f"{k[:6]} {v[0]/v[1]:.2f}" for k, v in res.items()))
