# ruff: noqa
# python gpolicy.py ../kq-mb1/code/prompts.jsonl 2 : `draft` with γ auto / 4 / 3 and `ar` in one process, alternated per prompt
import json, sys, time, collections, statistics
import draftwise
from draftwise.api import SpeculativeDecoder
from draftwise.sampling import SamplingParams
prompts = [json.loads(l)["turns"][0] for l in open(sys.argv[1])]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
sd = SpeculativeDecoder(progress=False)
params = SamplingParams(max_tokens=128)
sd.generate(prompts[0], params, method="draft", gamma="auto")  # warm-up (costs, draft load)
pol = sd.gamma_policy("draft", "auto")
hist = collections.Counter(); orig = pol.choose
def rec(seqs):
    k = orig(seqs); hist[pol.last] += 1; return k
pol.choose = rec
res = collections.defaultdict(list); toks = collections.defaultdict(list)
ref = {}
for r in range(rounds):
    for i, p in enumerate(prompts):
        for g in (["ar", "auto", 4, 3] if r % 2 == 0 else [3, 4, "auto", "ar"]):
            t0 = time.perf_counter()
            out = sd.generate(p, params, method="ar" if g == "ar" else "draft", gamma=1 if g == "ar" else g)
            dt = time.perf_counter() - t0
            n = len(out.token_ids)
            res[g].append(dt); toks[g].append(n)
            if g == "ar": ref[i] = out.text
            elif ref.get(i) is not None and out.text != ref[i]: print("MISMATCH", g, i)
for g in res:
    print(g, "total %.2f s" % sum(res[g]), "tok/s %.2f" % (sum(toks[g]) / sum(res[g])), "x ar %.3f" % (sum(res["ar"]) / sum(res[g])))
print("auto gamma histogram", sorted(hist.items()))
