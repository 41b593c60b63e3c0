# ruff: noqa: I001  (draftwise before torch: its OpenMP settings)
import statistics, time, sys
import draftwise  # noqa: F401
import torch
from draftwise.models import load_model
from draftwise.kernels import QLinear
lm = load_model("qwen2.5-coder-1.5b-instruct", "auto")
mods = [m for m in lm.model.modules() if isinstance(m, QLinear)]
fmt = int(sys.argv[1]); Ms = [int(x) for x in sys.argv[2].split(",")]
ms = [m for m in mods if m.bits == fmt and m is not lm.model.lm_head]
nw = sum(m.in_features * m.out_features for m in ms)
res = {M: [] for M in Ms}
for rnd in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    for M in Ms:
        xs = {m.in_features: torch.randn(M, m.in_features) for m in ms}
        for m in ms: m(xs[m.in_features])
        ts = []
        for r in range(3):
            t0 = time.perf_counter()
            for m in ms: m(xs[m.in_features])
            ts.append(time.perf_counter() - t0)
        res[M].append(min(ts))
for M in Ms:
    t = statistics.median(res[M])
    print(f"fmt {fmt} M={M}: {t*1e3:.1f} ms  {nw*M/t/1e9:.0f} GMAC/s", flush=True)
