import time, torch
from draftwise.models import load_model
from draftwise.kernels import QLinear, extension
torch.set_num_threads(2)
ext=extension()
lm = load_model("qwen2.5-coder-1.5b-instruct")
mods=[m for n,m in lm.model.named_modules() if isinstance(m,QLinear)]
head=[m for m in mods if m.out_features==151936][0]
downs=[m for m in mods if m.bits==14 and m.in_features==8960]
w=head._buffers["q"].view(-1) if "q" in head._buffers else None
print(type(head), [k for k in head._buffers])
def t(fn, reps=5):
    fn(); best=1e9
    for _ in range(reps):
        t0=time.perf_counter(); fn(); best=min(best,time.perf_counter()-t0)
    return best*1e3
x=torch.randn(1,1536); x2=torch.randn(1,8960)
for r in range(2):
  for l2 in (False,True):
    ext.set_kq_prefetch_l2(14,l2)
    print("l2" if l2 else "l1", "head %.2f ms"%t(lambda: ext.qmm_kq(x, head._buffers["q"].view(-1), 14, 151936)),
          "downs %.2f ms"%t(lambda: [ext.qmm_kq(x2, m._buffers["q"].view(-1), 14, 1536) for m in downs]))
# synthetic in anon memory, K=1536
N=65536; K=1536; row=210*K//256
w=ext.kq_pack(torch.zeros(N*row,dtype=torch.uint8),14,N,K,torch.empty(0,dtype=torch.uint8))
wr=ext.kq_pack(torch.randint(0,256,(N*row,),dtype=torch.uint8),14,N,K,torch.empty(0,dtype=torch.uint8))
hc=head._buffers["q"].view(-1).clone()
for r in range(2):
  for l2 in (False,True):
    ext.set_kq_prefetch_l2(14,l2)
    print("l2" if l2 else "l1", "synthetic zeros %.2f ms"%t(lambda: ext.qmm_kq(x, w, 14, N)), "random %.2f ms"%t(lambda: ext.qmm_kq(x, wr, 14, N)),
      "head clone (anon) %.2f"%t(lambda: ext.qmm_kq(x, hc, 14, 151936)))
