# ruff: noqa
import sysconfig, glob, json, sys, time, collections
import draftwise
from stdlib_table import table
from draftwise.api import SpeculativeDecoder
from draftwise.sampling import SamplingParams
from draftwise.drafters import draft_model as dm
sd = SpeculativeDecoder(progress=False)
tok = sd.tokenizer
N = 3
best = table(tok, N)
orig = dm._Lookup.expect
ON = [False]
stats = collections.Counter()
def expect(self, toks, chain, room):
    r = orig(self, toks, chain, room)
    stats["calls"] += 1; stats["ctx"] += bool(r)
    if r or not ON[0] or room <= 0: return r
    tail = (toks[-2:] + chain)[-2:]
    for c in range(N - 1, 0, -1):
        g = best[c].get(tuple(tail[-c:]))
        if g is not None: stats["guess"] += 1; return [g[0]]
    return []
dm._Lookup.expect = expect
orec = dm._Lookup.record
def record(self, fed, made):
    stats[("fed", fed, made, ON[0])] += 1; return orec(self, fed, made)
dm._Lookup.record = record
prompts = [json.loads(l)["turns"][0] for l in open("prompts.jsonl")]
params = SamplingParams(max_tokens=128)
sd.generate(prompts[0], params, method="draft", gamma=4)
gam = [int(g) if g.isdigit() else g for g in sys.argv[2].split(",")]
res = collections.defaultdict(float); ref = {}
for r in range(int(sys.argv[1])):
    for i, p in enumerate(prompts):
        order = [("ar", 1, False)] + [(f"g{g}{'+T' if on else ''}", g, on) for g in gam for on in (False, True)]
        if r % 2: order = order[::-1]
        for name, g, on in order:
            ON[0] = on
            t0 = time.perf_counter()
            out = sd.generate(p, params, method="ar" if name == "ar" else "draft", gamma=g)
            res[name] += time.perf_counter() - t0
            if name == "ar": ref[(r, i)] = out.token_ids
            elif (r, i) in ref and out.token_ids != ref[(r, i)]: print("MISMATCH", name, i)
for k in res: print(k, "%.2f s" % res[k], "x ar %.3f" % (res["ar"] / res[k]))
print(stats)
