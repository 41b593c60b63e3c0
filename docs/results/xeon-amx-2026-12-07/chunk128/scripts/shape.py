# ruff: noqa
# per (format, K) group of the 1.5B's matrices, ms at each row count, avx512vnni vs amx tiles
import time, sys
import draftwise  # noqa
import torch
from draftwise.models import load_model
from draftwise.kernels import QLinear, extension
ext = extension()
lm = load_model("qwen2.5-coder-1.5b-instruct")
Ms = [int(x) for x in sys.argv[1].split(",")]
allm = [m for m in lm.model.modules() if isinstance(m, QLinear) and m.out_features < 100000]
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
groups = sorted({(m.bits, m.in_features) for m in allm})
for isa in ("avx512vnni", "amx"):
    ext.set_isa(isa)
    if isa == "amx": ext.set_amx_min_rows(12, 1); ext.set_amx_min_rows(14, 1)
    for g in groups:
        ms = [m for m in allm if (m.bits, m.in_features) == g]
        print(f"{isa:11s} fmt{g[0]} K={g[1]} ({len(ms)}, N={sorted({m.out_features for m in ms})}) " + " ".join(f"{M}:{run(ms, M)*1e3:.1f}" for M in Ms), flush=True)
