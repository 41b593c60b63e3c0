# ruff: noqa: I001  (draftwise before torch: its OpenMP settings)
import statistics
import time

import draftwise  # noqa: F401
import torch
from draftwise.models import load_model
from draftwise.kernels import QLinear
lm = load_model("qwen2.5-coder-1.5b-instruct")
mods = [m for m in lm.model.modules() if isinstance(m, QLinear)]
for fmt in (14,):
    ms = [m for m in mods if m.bits == fmt]
    for M in (1, 8, 16, 32):
        xs = {m.in_features: torch.randn(M, m.in_features) for m in ms}
        for m in ms: m(xs[m.in_features])
        ts = []
        for r in range(7):
            t0 = time.perf_counter()
            for m in ms: m(xs[m.in_features])
            ts.append(time.perf_counter() - t0)
        print(f"fmt {fmt} M {M}: {len(ms)} matrices {statistics.median(ts)*1e3:.2f} ms (min {min(ts)*1e3:.2f})", flush=True)
