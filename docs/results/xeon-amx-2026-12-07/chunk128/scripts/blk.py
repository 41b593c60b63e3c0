# ruff: noqa
# the tiles' row blocks: K = 8960's matrices at each row count for 1 / 2 / 3 / 4 / 8 groups a block and from the bytes (0)
import sys
from matrices import allm, ext, run
ext.set_isa("amx"); ext.set_amx_min_rows(12, 1); ext.set_amx_min_rows(14, 1)
Ms = [int(x) for x in sys.argv[1].split(",")]
for rnd in range(2):
  for per in (0, 1, 2, 3, 4, 8):
    ext.set_amx_block_groups(per)
    for f in (12, 14):
        ms = [m for m in allm if m.bits == f and m.in_features == 8960]
        print(f"per={per} ({ext.amx_block_groups(8960)}) fmt{f} K=8960 " + " ".join(f"{M}:{run(ms, M)*1e3:.1f}" for M in Ms), flush=True)
