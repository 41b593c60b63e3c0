# ruff: noqa
import sysconfig, glob, json, collections
import draftwise
from stdlib_table import table
from draftwise.api import SpeculativeDecoder
from draftwise.drafters.pld import NgramIndex
from draftwise.drafters.draft_model import LOOKUP
sd = SpeculativeDecoder(progress=False)
tok = sd.tokenizer
N = 4
best = table(tok, N)
seqs = json.load(open("code_seqs.json"))
ctx_by_n = collections.Counter(); ctxhit_by_n = collections.Counter()
tab_by = collections.Counter(); tabhit_by = collections.Counter()
both = collections.Counter()
for pr, gen in seqs:
    full = pr + gen
    idx = NgramIndex({n: {} for n in range(1, LOOKUP + 1)})
    for t in range(len(pr), len(full) - 1):
        toks = full[:t + 1]
        idx.update(toks)
        tail = toks[-LOOKUP:]
        cg = None; cn = 0
        for n in range(len(tail), 0, -1):
            seen = idx.last[n].get(tuple(tail[-n:]))
            if seen:
                e = seen[-1]
                if e < len(toks): cg = toks[e]; cn = n
                break
        tg = None; tn = 0
        for c in range(N - 1, 0, -1):
            b = best[c].get(tuple(toks[-c:]))
            if b: tg = b[0]; tn = c; break
        y = full[t + 1]
        ctx_by_n[cn] += 1; ctxhit_by_n[cn] += cg == y
        tab_by[tn] += 1; tabhit_by[tn] += tg == y
        both[(cn, cg == y, tg == y)] += 1
print("context lookup by n:", {n: (ctx_by_n[n], round(ctxhit_by_n[n] / ctx_by_n[n], 3)) for n in sorted(ctx_by_n)})
print("table by ctx:", {n: (tab_by[n], round(tabhit_by[n] / tab_by[n], 3)) for n in sorted(tab_by)})
for cn in sorted(ctx_by_n):
    tot = ctx_by_n[cn]
    c_only = sum(v for (n, a, b), v in both.items() if n == cn and a)
    t_only = sum(v for (n, a, b), v in both.items() if n == cn and b)
    print("ctx n", cn, "ctx hit %.3f table hit %.3f either %.3f" % (c_only / tot, t_only / tot, sum(v for (n, a, b), v in both.items() if n == cn and (a or b)) / tot))
