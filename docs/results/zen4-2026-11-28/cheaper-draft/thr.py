# ruff: noqa
import draftwise, torch, time, statistics
from draftwise.api import SpeculativeDecoder
sd = SpeculativeDecoder(progress=False)
d = sd.draft.model; t = sd.target.model
ids = torch.tensor([[(i*7919+13)%30000 for i in range(200)]])
def tm(model, T, n=10):
    c = model.new_cache(1, 256); model.forward(ids[:, :64], c, logits_for="last")
    ts=[]
    for r in range(n):
        c.set_lengths(64); t0=time.perf_counter(); model.forward(ids[:, 64:64+T], c, logits_for="all"); ts.append(time.perf_counter()-t0)
    return min(ts)*1e3
for r in range(3):
    out = []
    for th in (1, 2):
        torch.set_num_threads(th)
        out.append("th%d draft %.2f target %.2f" % (th, tm(d, 1), tm(t, 1)))
    print(" | ".join(out))
