import time, torch
from draftwise.kernels import extension, KQ_BLOCK, _GGUF_BLOCK_BYTES
torch.set_num_threads(2)
ext = extension()
from draftwise.api import setup_threads; setup_threads(2)
def mat(fmt, K, MB):
    row = K // KQ_BLOCK[fmt] * _GGUF_BLOCK_BYTES[fmt]
    N = (MB << 20) // row // 16 * 16
    return ext.kq_pack(torch.zeros(N * row, dtype=torch.uint8), fmt, N, K, torch.empty(0, dtype=torch.uint8)), N, N * row
res = {}
cases = [(12, 1536), (12, 896*2), (103, 896), (103, 1536), (102, 896), (108, 896), (106, 896)]
mats = {c: mat(c[0], c[1], 128) for c in cases}
for r in range(6):
    for c in cases:
        w, N, b = mats[c]
        x = torch.randn(1, c[1])
        t0 = time.perf_counter(); ext.qmm_kq(x, w, c[0], N); dt = time.perf_counter() - t0
        if r: res.setdefault(c, []).append(b / dt / 1e9)
for c in cases: print(c, "GB/s (gguf bytes) best %.1f median %.1f" % (max(res[c]), sorted(res[c])[2]), "l2" if ext.kq_prefetch_l2(c[0]) else "l1")
