# ruff: noqa
import json, sys, time, collections
import draftwise
from draftwise.api import SpeculativeDecoder
from draftwise.sampling import SamplingParams
prompts = [json.loads(l)["turns"][0] for l in open("prompts.jsonl")]
sd = SpeculativeDecoder(progress=False)
params = SamplingParams(max_tokens=128)
sd.generate(prompts[0], params, method="draft", gamma=4)
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(model, name):
    f = model.forward
    def g(x, *a, **k):
        t0 = time.perf_counter(); r = f(x, *a, **k); dt = time.perf_counter() - t0
        T = x.shape[1]; key = f"{name} T{T if T < 10 else 'big'}"
        acc[key] += dt; cnt[key] += 1; return r
    model.forward = g
wrap(sd.target.model, "target"); wrap(sd.draft.model, "draft")
g = sys.argv[1] if len(sys.argv) > 1 else "4"
g = g if g == "auto" else int(g)
wall = 0
for p in prompts:
    t0 = time.perf_counter(); out = sd.generate(p, params, method="draft" if g != 1 else "ar", gamma=g); wall += time.perf_counter() - t0
fw = sum(acc.values())
print("gamma", g, "wall %.2f forward %.2f other %.2f" % (wall, fw, wall - fw))
for k in sorted(acc): print(" %-14s n=%5d total %.2f s  mean %.2f ms" % (k, cnt[k], acc[k], 1e3 * acc[k] / cnt[k]))
