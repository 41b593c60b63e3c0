import time, torch, sys
from draftwise.models import load_model
from draftwise.kernels import QLinear, extension
torch.set_num_threads(2)
ext=extension()
lm = load_model(sys.argv[1])
mods=[m for n,m in lm.model.named_modules() if isinstance(m,QLinear)]
by={}
for m in mods: by.setdefault(m.bits,[]).append(m)
xs={m:torch.randn(1,m.in_features) for m in mods}
def run(ms):
    t0=time.perf_counter()
    for m in ms: ext.qmm_kq(xs[m], m._buffers["q"].view(-1), m.bits, m.out_features)
    return time.perf_counter()-t0
res={}
for r in range(7):
  for fmt,ms in by.items():
    for l2 in (False,True):
      ext.set_kq_prefetch_l2(fmt,l2)
      t=run(ms)
      if r: res.setdefault((fmt,l2),[]).append(t*1e3)
for (fmt,l2),v in sorted(res.items()):
    v.sort(); print(fmt, "l2" if l2 else "l1", "median %.2f ms min %.2f"%(v[len(v)//2], v[0]))
