# ruff: noqa
# The 1.5B's K-quant matrices (the LM head left out) and the time of one call over each of a list of them,
# shared by shape.py and blk.py: run(ms, M) is the best of 3 rounds, 2 threads.
import time
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
