"""The draft model's head cut to its first N ids (and the special tokens and the context's) against the whole
head, in one process, alternated per prompt: python ab.py PROMPTS.jsonl METHODS [N] [ROUNDS] [FIRST_ROUND].
Greedy, 128 new tokens; both decoders share the target, each loads its own draft; outputs must be equal."""
import json
import statistics
import sys
import time

from draftwise import SamplingParams, SpeculativeDecoder

prompts = [json.loads(line)["turns"][0] for line in open(sys.argv[1])]
methods = sys.argv[2].split(",")
keep = sys.argv[3] if len(sys.argv) > 3 else "32768"
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
first = int(sys.argv[5]) if len(sys.argv) > 5 else 0
full = SpeculativeDecoder(progress=False, draft_vocab="full")
cut = SpeculativeDecoder(target=full.target, progress=False, draft_vocab=keep)
decoders = {"full": full, "cut": cut}
for d in decoders.values():  # warm-up
    for m in methods:
        d.generate(prompts[0], SamplingParams(max_tokens=32), method=m)
res = {(m, n): [] for m in methods for n in decoders}
for rnd in range(first, first + rounds):
    for i, p in enumerate(prompts):
        for m in methods:
            outs = {}
            for n in (("full", "cut") if (i + rnd) % 2 == 0 else ("cut", "full")):
                t = time.perf_counter()
                o = decoders[n].generate(p, SamplingParams(max_tokens=128), method=m)
                dt = time.perf_counter() - t
                outs[n] = o.token_ids
                res[(m, n)].append((dt, o.stats.mean_accepted_length, o.stats.acceptance_rate))
            assert outs["full"] == outs["cut"], (m, i)
            print(i, m, {n: round(res[(m, n)][-1][0], 2) for n in decoders}, flush=True)
for m in methods:
    f, c = res[(m, "full")], res[(m, "cut")]
    tf, tc = sum(x[0] for x in f), sum(x[0] for x in c)
    print(f"{m}: full {tf:.2f} s, cut {tc:.2f} s: cut x{tf / tc:.3f} (median per prompt "
          f"x{statistics.median(a[0] / b[0] for a, b in zip(f, c)):.3f}); tau {statistics.fmean(x[1] for x in f):.2f} / "
          f"{statistics.fmean(x[1] for x in c):.2f}, alpha {statistics.fmean(x[2] for x in f):.3f} / "
          f"{statistics.fmean(x[2] for x in c):.3f}")
