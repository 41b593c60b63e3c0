# ruff: noqa
import json, sys, time, collections
import draftwise
from draftwise.api import SpeculativeDecoder
from draftwise.sampling import SamplingParams
from draftwise.drafters import draft_model as dm
sd = SpeculativeDecoder(progress=False)
prompts = [json.loads(l)["turns"][0] for l in open(sys.argv[3] if len(sys.argv) > 3 else "prompts.jsonl")]
params = SamplingParams(max_tokens=128)
sd.generate(prompts[0], params, method="draft", gamma=4)
modes = [int(m) for m in sys.argv[2].split(",")]
gam = ["auto", 4]
res = collections.defaultdict(float); ref = {}; rec = collections.Counter()
orec = dm._Lookup.record
def record(self, fed, made):
    rec[(dm.MODE, fed, made)] += 1; return orec(self, fed, made)
dm._Lookup.record = record
for r in range(int(sys.argv[1])):
    for i, p in enumerate(prompts):
        order = [("ar", 1, 0)] + [(f"g{g}-m{m}", g, m) for g in gam for m in modes]
        if r % 2: order = order[::-1]
        for name, g, m in order:
            dm.MODE = m
            t0 = time.perf_counter()
            out = sd.generate(p, params, method="ar" if name == "ar" else "draft", gamma=g)
            res[name] += time.perf_counter() - t0
            if name == "ar": ref[(r, i)] = out.token_ids
            elif (r, i) in ref and out.token_ids != ref[(r, i)]: print("MISMATCH", name, i)
for k in res: print(k, "%.2f s" % res[k], "x ar %.3f" % (res["ar"] / res[k]))
for m in modes:
    made = sum(v * k[2] for k, v in rec.items() if k[0] == m); passes = sum(v for k, v in rec.items() if k[0] == m)
    print("mode", m, "feed passes", passes, "chain tokens", made, "per pass %.3f" % (made / passes), {k[1:]: v for k, v in rec.items() if k[0] == m and v > 20})
