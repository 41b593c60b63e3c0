# ruff: noqa
# a 512-token prompt's prefill (best and median of 5) and T = 1 (median of 10) on the checkout in PYTHONPATH,
# with the sum of the last logits (the same bits: the same sum): PYTHONPATH=<checkout> python ab.py 512
import time, sys, torch, statistics
import draftwise
from draftwise.models import load_model
import draftwise.prefix as pf
m = load_model("qwen2.5-coder-1.5b-instruct").model
torch.set_grad_enabled(False)
P = int(sys.argv[1]) if len(sys.argv) > 1 else 512
ids = torch.randint(100, 20000, (P,), generator=torch.Generator().manual_seed(0)).tolist()
cache = m.new_cache(1, P + 8)
ts = []
for r in range(5):
    cache.set_lengths(0)
    t = time.perf_counter(); out, _ = pf.prefill(m, ids, cache, logits_for="last"); ts.append(time.perf_counter() - t)
last = out.logits[0, -1]
dec = []
for r in range(10):
    cache.set_lengths(P)
    t = time.perf_counter(); m(torch.tensor([[5]]), cache); dec.append(time.perf_counter() - t)
print(f"{draftwise.__file__.split('/')[1:3]} P={P}: prefill best {P/min(ts):.0f} med {P/statistics.median(ts):.0f} tok/s; T=1 med {1000*statistics.median(dec):.1f} ms; sum {last.double().sum().item():.6f}", flush=True)
