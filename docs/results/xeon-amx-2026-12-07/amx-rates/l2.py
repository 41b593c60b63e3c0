# Per super-block of 16 columns: one matrix (N x K) of zero codes, 1 thread, avx512vnni against amx (the tiles
# from 1 row). python l2.py FMT(12|14) N K ROWS,ROWS,...
# ruff: noqa
import time, sys
import draftwise, torch
from draftwise.kernels import extension
ext = extension()
torch.set_num_threads(1)
fmt = int(sys.argv[1]); N = int(sys.argv[2]); K = int(sys.argv[3])
from draftwise.kernels import zero_matrix
w, Nw, _ = zero_matrix(ext, fmt, K, 64 << 20)
tb = w.numel() // (Nw // 16)
w = w[: (N // 16) * tb].contiguous()
for M in [int(m) for m in sys.argv[4].split(",")]:
    x = torch.randn(M, K)
    res = []
    for isa in ("avx512vnni", "amx"):
        ext.set_isa(isa)
        if isa == "amx": ext.set_amx_min_rows(12, 1); ext.set_amx_min_rows(14, 1)
        for _ in range(3): ext.qmm_kq(x, w, fmt, N)
        best = 1e9
        for r in range(20):
            t0 = time.perf_counter(); ext.qmm_kq(x, w, fmt, N); best = min(best, time.perf_counter() - t0)
        res.append(best)
    sbt = N // 16 * K // 256
    print(f"fmt {fmt} M={M}: vnni {res[0]/sbt*1e9:.0f} ns/sb-tile, amx {res[1]/sbt*1e9:.0f} ns/sb-tile")
