"""The draft model's chain with its context's lookup (the default) against without, in one process, alternated
per prompt: python ab.py PROMPTS.jsonl METHODS [ROUNDS] [MAX_TOKENS].
Greedy; both decoders share the target and the draft model (each keeps its own γ policy and acceptance
records); outputs must be equal."""
import json
import statistics
import sys
import time

import draftwise.drafters.draft_model as dm
from draftwise import SamplingParams, SpeculativeDecoder

prompts = [json.loads(line)["turns"][0] for line in open(sys.argv[1])]
methods = sys.argv[2].split(",")
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
on = SpeculativeDecoder(progress=False)
off = SpeculativeDecoder(target=on.target, draft=on.draft, progress=False)
decoders = {"off": off, "on": on}
init = dm.DraftModelDrafter.__init__
current = {"lookup": True}


def patched(self, *a, **kw):
    init(self, *a, **kw)
    self.lookup = current["lookup"]


dm.DraftModelDrafter.__init__ = patched


def gen(n, p, m, tokens):
    current["lookup"] = n == "on"
    return decoders[n].generate(p, SamplingParams(max_tokens=tokens), method=m)


for n in decoders:  # warm-up
    for m in methods:
        gen(n, prompts[0], m, 32)
res = {(m, n): [] for m in methods for n in decoders}
for rnd in range(rounds):
    for i, p in enumerate(prompts):
        for m in methods:
            outs = {}
            for n in (("off", "on") if (i + rnd) % 2 == 0 else ("on", "off")):
                t = time.perf_counter()
                o = gen(n, p, m, max_tokens)
                dt = time.perf_counter() - t
                outs[n] = o.token_ids
                res[(m, n)].append((dt, o.stats.mean_accepted_length, o.stats.acceptance_rate))
            assert outs["off"] == outs["on"], (m, i)
            print(i, m, {n: round(res[(m, n)][-1][0], 2) for n in decoders}, flush=True)
for m in methods:
    f, c = res[(m, "off")], res[(m, "on")]
    tf, tc = sum(x[0] for x in f), sum(x[0] for x in c)
    print(f"{m}: off {tf:.2f} s, on {tc:.2f} s: on x{tf / tc:.3f} (median per prompt "
          f"x{statistics.median(a[0] / b[0] for a, b in zip(f, c)):.3f}); tau {statistics.fmean(x[1] for x in f):.2f} / "
          f"{statistics.fmean(x[1] for x in c):.2f}, alpha {statistics.fmean(x[2] for x in f):.3f} / "
          f"{statistics.fmean(x[2] for x in c):.3f}")
