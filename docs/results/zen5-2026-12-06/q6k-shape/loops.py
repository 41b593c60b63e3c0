# ruff: noqa
import statistics, time, sys
import draftwise  # noqa
import torch
from draftwise.models import load_model
from draftwise.kernels import QLinear, extension
ext = extension()
lm = load_model("qwen2.5-coder-1.5b-instruct")
mods = [m for m in lm.model.modules() if isinstance(m, QLinear) and m.bits == 14]
Ms = [int(x) for x in sys.argv[1].split(",")]
def run(ms, M):
    xs = {m.in_features: torch.randn(M, m.in_features) for m in ms}
    calls = [(xs[m.in_features], m.q.view(-1), m.bits, m.out_features) for m in ms]
    for c in calls: ext.qmm_kq(*c)
    best = 1e9
    for r in range(5):
        t0 = time.perf_counter()
        for c in calls: ext.qmm_kq(*c)
        best = min(best, time.perf_counter() - t0)
    return best
groups = {"head": [m for m in mods if m.out_features > 100000], "down": [m for m in mods if m.in_features == 8960], "v": [m for m in mods if m.out_features == 256]}
for rnd in range(3):
    for many in (0, 1):
        ext.set_kq6_many(bool(many))
        print("many" if many else "few ", " | ".join(g + " " + " ".join(f"{M}:{run(ms, M)*1e3:.2f}" for M in Ms) for g, ms in groups.items()), flush=True)
