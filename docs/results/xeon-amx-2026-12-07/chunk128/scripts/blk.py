# ruff: noqa
import time, sys
import draftwise  # noqa
import torch
from draftwise.models import load_model
from draftwise.kernels import QLinear, extension
ext = extension()
lm = load_model("qwen2.5-coder-1.5b-instruct")
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
ext.set_isa("amx"); ext.set_amx_min_rows(12, 1); ext.set_amx_min_rows(14, 1)
Ms = [int(x) for x in sys.argv[1].split(",")]
for rnd in range(2):
  for per in (0, 1, 2, 3, 4, 8):
    ext.set_amx_block_groups(per)
    for f in (12, 14):
        ms = [m for m in allm if m.bits == f and m.in_features == 8960]
        print(f"per={per} ({ext.amx_block_groups(8960)}) fmt{f} K=8960 " + " ".join(f"{M}:{run(ms, M)*1e3:.1f}" for M in Ms), flush=True)
