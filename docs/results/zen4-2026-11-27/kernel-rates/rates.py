"""Time every distinct quantized matrix of a model (format id, N, K) at M = 1, 4, 8, 16 activation rows
(best of 5 rounds over all matrices of that shape) and print ms and GMAC/s. Usage: python rates.py [MODEL]"""
import time, torch, sys, collections
from draftwise.models import load_model
from draftwise.kernels import QLinear
torch.set_num_threads(2)
lm = load_model(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct")
mods=[(n,m) for n,m in lm.model.named_modules() if isinstance(m,QLinear)]
groups=collections.defaultdict(list)
for n,m in mods: groups[(m.bits,m.out_features,m.in_features)].append(m)
tot=collections.Counter()
for key,ms in sorted(groups.items()):
    row=[]
    for M in (1,4,8,16):
        x=torch.randn(M,key[2])
        m=ms[0]
        for _ in range(3): m(x)
        best=1e9
        for r in range(5):
            t0=time.perf_counter()
            for mm in ms: mm(x)
            best=min(best,time.perf_counter()-t0)
        tot[M]+=best
        gm=M*key[1]*key[2]*len(ms)/best/1e9
        row.append(f"M{M} {best*1e3:6.2f}ms {gm:5.0f}GMAC/s")
    print(key,len(ms)," | ".join(row))
print({k:round(v*1e3,2) for k,v in tot.items()})
