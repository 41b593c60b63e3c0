import time, torch, collections
from draftwise.models import load_model
from draftwise.kernels import QLinear
torch.set_num_threads(1)
lm = load_model("qwen2.5-coder-1.5b-instruct")
mods=[m for n,m in lm.model.named_modules() if isinstance(m,QLinear)]
seen=set()
for m in mods:
    key=(m.bits,m.out_features,m.in_features)
    if key in seen: continue
    seen.add(key)
    x=torch.randn(1,m.in_features)
    for _ in range(20): m(x)
    n=200 if m.out_features<20000 else 10
    best=1e9
    for r in range(5):
        t0=time.perf_counter()
        for _ in range(n): m(x)
        best=min(best,(time.perf_counter()-t0)/n)
    nbytes = m.out_features*m.in_features*(6.5625 if key[0]==14 else 4.5)/8
    print(key, f"{best*1e6:8.1f} us  {nbytes/best/1e9:5.1f} GB/s  ({nbytes/1e6:.2f} MB)")
