# Every Q4_K / Q6_K matrix of the 1.5B at each row count, 2 threads, avx512vnni and amx (tiles from 1 row),
# two alternated rounds. python fmt.py ROWS,ROWS,... [isa,isa]
# ruff: noqa
import time, sys
import draftwise  # noqa
import torch
from draftwise.models import load_model
from draftwise.kernels import QLinear, extension
ext = extension()
lm = load_model("qwen2.5-coder-1.5b-instruct")
Ms = [int(x) for x in sys.argv[1].split(",")]
isas = sys.argv[2].split(",") if len(sys.argv) > 2 else ["avx512vnni", "amx"]
allm = [m for m in lm.model.modules() if isinstance(m, QLinear)]
fmts = sorted({m.bits for m in allm})
def run(ms, M):
    xs = {m.in_features: torch.randn(M, m.in_features) for m in ms}
    calls = [(xs[m.in_features], m.q.view(-1), m.bits, m.out_features) for m in ms]
    for c in calls: ext.qmm_kq(*c)
    best = 1e9
    for r in range(3):
        t0 = time.perf_counter()
        for c in calls: ext.qmm_kq(*c)
        best = min(best, time.perf_counter() - t0)
    return best
for rnd in range(2):
    for isa in isas:
        ext.set_isa(isa)
        if isa == "amx": ext.set_amx_min_rows(12, 1); ext.set_amx_min_rows(14, 1)
        line = []
        for f in fmts:
            ms = [m for m in allm if m.bits == f]
            line.append(f"fmt{f}({len(ms)}) " + " ".join(f"{M}:{run(ms, M)*1e3:.1f}" for M in Ms))
        print(f"{isa:11s}", " | ".join(line), flush=True)
