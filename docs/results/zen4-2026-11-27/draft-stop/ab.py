"""The draft model's confidence stop at several thresholds against none, in one process, rotated per prompt:
python ab.py PROMPTS.jsonl METHODS STOPS [ROUNDS] [MAX_TOKENS]  (STOPS e.g. 0,0.5,0.7; "c0.6": the product
of the chain's confidences below 0.6, the cumulative rule). Needs stop.patch applied.
Greedy; the decoders share the target and the draft model (each keeps its own γ policy and acceptance
records); outputs must be equal."""
import json
import statistics
import sys
import time

import draftwise.drafters.draft_model as dm
from draftwise import SamplingParams, SpeculativeDecoder

prompts = [json.loads(line)["turns"][0] for path in sys.argv[1].split(",") for line in open(path)]
methods = sys.argv[2].split(",")
stops = sys.argv[3].split(",")
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
max_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 128
first = SpeculativeDecoder(progress=False)
decoders = {v: first if j == 0 else SpeculativeDecoder(target=first.target, draft=first.draft, progress=False)
            for j, v in enumerate(stops)}
init = dm.DraftModelDrafter.__init__
current = {"stop": "0"}


def patched(self, *a, **kw):
    init(self, *a, **kw)
    v = current["stop"]
    self.cumulative = v.startswith("c")
    self.stop = float(v.lstrip("c"))


dm.DraftModelDrafter.__init__ = patched


def gen(v, p, m, tokens):
    current["stop"] = v
    return decoders[v].generate(p, SamplingParams(max_tokens=tokens), method=m)


for v in decoders:  # warm-up
    for m in methods:
        gen(v, prompts[0], m, 32)
res = {(m, v): [] for m in methods for v in decoders}
n = len(stops)
for rnd in range(rounds):
    for i, p in enumerate(prompts):
        for m in methods:
            outs = {}
            r = (i + rnd) % n
            for v in stops[r:] + stops[:r]:
                t = time.perf_counter()
                o = gen(v, p, m, max_tokens)
                dt = time.perf_counter() - t
                outs[v] = o.token_ids
                res[(m, v)].append((dt, o.stats.mean_accepted_length, o.stats.acceptance_rate, o.stats.stopped,
                                    statistics.fmean(o.stats.gammas) if o.stats.gammas else 0))
            assert all(outs[v] == outs[stops[0]] for v in stops), (m, i)
            print(i, m, {v: round(res[(m, v)][-1][0], 2) for v in stops}, flush=True)
for m in methods:
    base = res[(m, stops[0])]
    tb = sum(x[0] for x in base)
    for v in stops:
        c = res[(m, v)]
        tc = sum(x[0] for x in c)
        print(f"{m} stop {v}: {tc:.2f} s, x{tb / tc:.3f} of stop {stops[0]} (median per prompt "
              f"x{statistics.median(a[0] / b[0] for a, b in zip(base, c)):.3f}); tau {statistics.fmean(x[1] for x in c):.2f}, "
              f"alpha {statistics.fmean(x[2] for x in c):.3f}, stopped {sum(x[3] for x in c)}, "
              f"mean gamma {statistics.fmean(x[4] for x in c):.2f}")
