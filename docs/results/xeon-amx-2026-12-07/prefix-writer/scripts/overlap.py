"""The engine's side of a store with --prefix-cache-dir: the draft model (0.5B) decoding one token a forward while a
2048-token prompt's blocks of the 1.5B (117 MB, fp32) are stored, against the same forwards alone. Prints how
long the store held the caller, how long 20 forwards right after it took, and when the files were all written
(from the store's call; medians of ROUNDS rounds)."""
import statistics
import sys
import tempfile
import time

import torch

from draftwise.models import load_model
from draftwise.prefix import DiskBlocks, PrefixCache

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
torch.set_num_threads(2)
model = load_model("qwen2.5-coder-0.5b-instruct").model
cache = model.new_cache(1, 1024)


class Row:
    def __init__(self, k, v):
        self.k, self.v = k, v

    def length(self):
        return self.k.shape[3]


def forwards(n):
    with torch.inference_mode():
        for i in range(n):
            model.forward(torch.tensor([[100 + i]]), cache, logits_for="last")
            cache.set_lengths(64)


with torch.inference_mode():
    model.forward(torch.randint(0, 3000, (1, 64)), cache, logits_for="last")
alone, after, together, stall = [], [], [], []
for r in range(ROUNDS):
    t = time.perf_counter(); forwards(20); alone.append(time.perf_counter() - t)
    k = torch.randn(28, 1, 2, 2048, 128)
    pc = PrefixCache(0, disk=DiskBlocks(tempfile.mkdtemp(), 1 << 30))
    t = time.perf_counter()
    pc.store(torch.randint(0, 1000, (2048,)).tolist(), Row(k, torch.randn_like(k)))
    stall.append(time.perf_counter() - t)
    t1 = time.perf_counter()
    forwards(20)
    after.append(time.perf_counter() - t1)
    if hasattr(pc.disk, "flush"):
        pc.disk.flush()
    together.append(time.perf_counter() - t)
a, f, b, s = (statistics.median(x) * 1e3 for x in (alone, after, together, stall))
print(f"store held the caller {s:.0f} ms; 20 forwards alone {a:.0f} ms, right after the store {f:.0f} ms; "
      f"files written {b:.0f} ms after the store's call")
