# ruff: noqa
"""Acceptance by depth: per drafted position d, P(accepted | all before accepted), for draft at γ 8."""
import json, sys, collections
import draftwise
from draftwise.api import SpeculativeDecoder
from draftwise.sampling import SamplingParams
from draftwise.drafters import draft_model as dm
from draftwise.bench.prompts import load_prompts
sd = SpeculativeDecoder(progress=False)
params = SamplingParams(max_tokens=128)
code = [json.loads(l)["turns"][0] for l in open("prompts.jsonl")]
_, sb = load_prompts(None, None, 2)
sets = {"code": code, "specbench": [p.text for p in sb]}
G = int(sys.argv[1]) if len(sys.argv) > 1 else 8
asked = {}
orig_p, orig_a = dm.DraftModelDrafter.propose, dm.DraftModelDrafter.accept
rec = []
def propose(self, seqs, ks):
    out = orig_p(self, seqs, ks)
    for s, d in zip(seqs, out): asked[id(s)] = len(d.tokens)
    return out
def accept(self, seq, n_before, num_accepted, *a, **k):
    rec.append((CUR[0], asked.get(id(seq), 0), num_accepted))
    return orig_a(self, seq, n_before, num_accepted, *a, **k)
dm.DraftModelDrafter.propose, dm.DraftModelDrafter.accept = propose, accept
CUR = [None]
for name, ps in sets.items():
    CUR[0] = name
    for p in ps:
        sd.generate(p, params, method="draft", gamma=G)
json.dump(rec, open(f"depth-g{G}.json", "w"))
for name in sets:
    r = [(k, a) for n, k, a in rec if n == name and k > 0]
    print(name, "steps", len(r), "mean accepted %.2f" % (sum(a for _, a in r) / len(r)))
    for d in range(1, G + 1):
        tried = sum(1 for k, a in r if k >= d and a >= d - 1)
        acc = sum(1 for k, a in r if a >= d)
        print("  depth %d: tried %4d alpha_d %.3f" % (d, tried, acc / max(tried, 1)))
