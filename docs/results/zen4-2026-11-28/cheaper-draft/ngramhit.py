# ruff: noqa
import sysconfig, glob, json, time, collections, pickle, os
import draftwise
from stdlib_table import table
from draftwise.api import SpeculativeDecoder
from draftwise.sampling import SamplingParams
sd = SpeculativeDecoder(progress=False)
tok = sd.tokenizer
N = 4
best = table(tok, N)
prompts = [json.loads(l)["turns"][0] for l in open("prompts.jsonl")]
seqs = []
for p in prompts:
    out = sd.generate(p, SamplingParams(max_tokens=128), method="ar")
    seqs.append((sd.encode(p), list(out.token_ids)))
json.dump(seqs, open("code_seqs.json", "w"))
for minc in (1, 2, 3):
  for mincount in (1, 2, 3):
    hit = tot = prop = 0
    for pr, gen in seqs:
        full = pr + gen
        for t in range(len(pr), len(full) - 1):
            # guess full[t+1] from context full[:t+1]
            g = None
            for c in range(N - 1, minc - 1, -1):
                b = best[c].get(tuple(full[t + 1 - c:t + 1]))
                if b and b[1] >= mincount: g = b[0]; break
            tot += 1
            if g is not None:
                prop += 1; hit += g == full[t + 1]
    print("min ctx", minc, "mincount", mincount, "proposed %.3f hit|prop %.3f hit %.3f" % (prop / tot, hit / max(prop, 1), hit / tot))
