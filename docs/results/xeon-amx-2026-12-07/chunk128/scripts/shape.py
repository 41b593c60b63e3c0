# ruff: noqa
# per (format, K) group of the 1.5B's matrices, ms at each row count, avx512vnni vs amx tiles
import sys
from matrices import allm, ext, run
Ms = [int(x) for x in sys.argv[1].split(",")]
groups = sorted({(m.bits, m.in_features) for m in allm})
for isa in ("avx512vnni", "amx"):
    ext.set_isa(isa)
    if isa == "amx": ext.set_amx_min_rows(12, 1); ext.set_amx_min_rows(14, 1)
    for g in groups:
        ms = [m for m in allm if (m.bits, m.in_features) == g]
        print(f"{isa:11s} fmt{g[0]} K={g[1]} ({len(ms)}, N={sorted({m.out_features for m in ms})}) " + " ".join(f"{M}:{run(ms, M)*1e3:.1f}" for M in Ms), flush=True)
