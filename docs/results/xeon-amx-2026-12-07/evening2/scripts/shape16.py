# ruff: noqa
# the 1.5B's K-quant matrices by (format, K) on AVX512-VNNI and on the tiles (from 1 row), ms: python shape16.py 1,16,32,128
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "chunk128" / "scripts"))  # matrices.py
from matrices import allm, ext, run
Ms = [int(x) for x in sys.argv[1].split(",")]
groups = sorted({(m.bits, m.in_features) for m in allm})
for isa in ["avx512vnni", "amx"]:
    ext.set_isa(isa); ext.set_amx_min_rows(12, 1); ext.set_amx_min_rows(14, 1)
    for g in groups:
        ms = [m for m in allm if (m.bits, m.in_features) == g]
        print(f"{isa} fmt{g[0]} K={g[1]} ({len(ms)}) " + " ".join(f"{M}:{run(ms, M)*1e3:.1f}" for M in Ms), flush=True)
