# ruff: noqa
import draftwise, torch, time
from draftwise.api import SpeculativeDecoder
sd = SpeculativeDecoder(progress=False)
d = sd.draft.model
ids = torch.tensor([[(i*7919+13)%30000 for i in range(300)]])
c = d.new_cache(1, 512); d.forward(ids[:, :64], c, logits_for="last")
t0 = time.perf_counter(); n = 0
while time.perf_counter() - t0 < 20:
    c.set_lengths(64); d.forward(ids[:, 64:65], c, logits_for="last"); n += 1
print("ms/pass", 1e3 * (time.perf_counter() - t0) / n)
