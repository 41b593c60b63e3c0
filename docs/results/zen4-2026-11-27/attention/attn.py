# One layer's decode_attention (the 1.5B's shape: 12 heads over 2 KV heads of 128) after L cached tokens for T new
# ones: median of 30 calls, and the multiply-adds per second. python attn.py
import time, torch, sys
from draftwise.kernels import extension
ext = extension()
nh, nkv, hd, cap = 12, 2, 128, 4096
kc = torch.randn(1, nkv, cap, hd); vc = torch.randn(1, nkv, cap, hd)
empty = torch.empty(0, dtype=torch.long)
for L in (64, 512, 1024, 2048):
    for T in (1, 4, 8, 16):
        qkv0 = torch.randn(1, T, (nh + 2 * nkv) * hd)
        cos = torch.ones(1, T, hd); sin = torch.zeros(1, T, hd)
        ts = []
        for r in range(30):
            qkv = qkv0.clone()
            t0 = time.perf_counter()
            ext.decode_attention(qkv, cos, sin, kc, vc, [L], nh, nkv, empty, empty)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        us = ts[len(ts)//2] * 1e6
        mac = 2 * T * nh * (L + T) * hd
        print(f"L={L:5d} T={T:2d} {us:8.1f} us/layer  x28={us*28/1000:6.2f} ms  {mac/us/1e3:6.1f} GMAC/s")
