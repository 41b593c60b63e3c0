# ruff: noqa
import draftwise, torch, time, statistics
from draftwise.api import SpeculativeDecoder
sd = SpeculativeDecoder(progress=False)
d = sd.draft.model; t = sd.target.model
ids = torch.tensor([[(i*7919+13)%30000 for i in range(200)]])
def tm(model, T, n=15):
    c = model.new_cache(1, 256); model.forward(ids[:, :64], c, logits_for="last")
    ts=[]
    for r in range(n):
        c.set_lengths(64); t0=time.perf_counter(); model.forward(ids[:, 64:64+T], c, logits_for="all"); ts.append(time.perf_counter()-t0)
    return min(ts)*1e3, statistics.median(ts)*1e3
for r in range(3):
    print("draft T1 %.2f/%.2f  T2 %.2f/%.2f | target T1 %.2f/%.2f T5 %.2f/%.2f" % (*tm(d,1), *tm(d,2), *tm(t,1), *tm(t,5)))
