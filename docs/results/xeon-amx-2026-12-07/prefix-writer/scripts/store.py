"""How long ``PrefixCache.store`` holds its caller (the engine thread) with --prefix-cache-dir, and when the files
are written: the Qwen 1.5B's cache shape (28 layers, 2 KV heads, head_dim 128), prompts of 512 and 2048 tokens,
a fresh folder a round, medians of ROUNDS rounds (default 5). Run it on two commits to compare."""
import statistics
import sys
import tempfile
import time

import torch

from draftwise.prefix import DiskBlocks, PrefixCache

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5


class Row:  # a one-row cache view: what store reads
    def __init__(self, k, v):
        self.k, self.v = k, v

    def length(self):
        return self.k.shape[3]


for dtype in (torch.float32, torch.bfloat16):
    for T in (512, 2048):
        held, written = [], []
        for r in range(ROUNDS):
            k = torch.randn(28, 1, 2, T, 128).to(dtype)
            row = Row(k, torch.randn_like(k))
            cache = PrefixCache(0, disk=DiskBlocks(tempfile.mkdtemp(), 1 << 30))
            ids = torch.randint(0, 1000, (T,)).tolist()
            t = time.perf_counter()
            cache.store(ids, row)
            held.append(time.perf_counter() - t)
            if hasattr(cache.disk, "flush"):
                cache.disk.flush()
            written.append(time.perf_counter() - t)
        mb = 2 * k.numel() * k.element_size() / 1e6
        print(f"{str(dtype)[6:]:9s} {T:5d} tokens {mb:6.1f} MB: store returns {statistics.median(held) * 1e3:6.1f} ms "
              f"(range {min(held) * 1e3:.1f}-{max(held) * 1e3:.1f}), files written {statistics.median(written) * 1e3:6.1f} ms")
