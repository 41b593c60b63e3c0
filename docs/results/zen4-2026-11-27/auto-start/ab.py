"""auto with and without the start rule for costly children (a start must beat the free drafters' recent rate;
a dear start waits for OBSERVE steps), in one process, alternated per prompt: python ab.py A.jsonl,B.jsonl ROUNDS.
"old" replaces AutoDrafter._typical by 0 (every start passes that test) and START_WAIT by infinity (no start
waits): the rule before. Greedy, 128 tokens, a fresh suffix cache per request, outputs compared."""
import json, sys, time, statistics
import draftwise.drafters.auto as A
from draftwise import SpeculativeDecoder, SamplingParams
new_typical = A.AutoDrafter._typical
def old_typical(self, st, k): return 0.0
files = sys.argv[1].split(",")
prompts = [(f, json.loads(l)) for f in files for l in open(f)]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
new = SpeculativeDecoder(progress=False)
_ = new.draft
old = SpeculativeDecoder(target=new.target, draft=new.draft, progress=False)
decs = {"old": old, "new": new}
new_wait = A.START_WAIT
def gen(mode, text, n=128):
    A.AutoDrafter._typical = new_typical if mode == "new" else old_typical
    A.START_WAIT = new_wait if mode == "new" else float("inf")
    t = time.perf_counter(); o = decs[mode].generate(text, SamplingParams(max_tokens=n), method="auto"); return o, time.perf_counter() - t
for m in decs: gen(m, "def f(x):", 16)
res = {m: [] for m in decs}
from draftwise.drafters.suffix import SuffixCache
for r in range(rounds):
    for d in decs.values(): d.suffix_cache = SuffixCache()
    for i, (f, p) in enumerate(prompts):
        outs = {}
        for m in (("old", "new") if (i + r) % 2 == 0 else ("new", "old")):
            decs[m].suffix_cache = SuffixCache()  # each request alone, as the bench runs them
            o, dt = gen(m, p["turns"][0])
            outs[m] = o.token_ids
            res[m].append((p["category"], dt, o.stats.summary().get("draft_s", 0)))
        assert outs["old"] == outs["new"]
        print(r, p["category"], {m: round(res[m][-1][1], 2) for m in decs}, {m: round(res[m][-1][2], 2) for m in decs}, flush=True)
cats = sorted({c for c, _, _ in res["old"]})
for c in cats + ["all"]:
    o = [d for cc, d, _ in res["old"] if c in (cc, "all")]; n = [d for cc, d, _ in res["new"] if c in (cc, "all")]
    print(f"{c:15s} old {sum(o):7.2f} s new {sum(n):7.2f} s  new x{sum(o)/sum(n):.3f}  median x{statistics.median(a/b for a,b in zip(o,n)):.3f}")
