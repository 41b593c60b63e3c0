# ruff: noqa
# python estats.py [question.jsonl]: the fraction of (row, super-block) and (16-row group, super-block) pairs whose 8 blocks of 32 all have e = 3
import json, sys, torch, numpy as np
import draftwise.kernels as K
from draftwise.models import load_model
lm = load_model("qwen2.5-coder-1.5b-instruct")
m = lm.model; tok = lm.tokenizer
torch.set_grad_enabled(False)
m.fused_layers = False
qs = [json.loads(l) for l in open(sys.argv[1] if len(sys.argv) > 1 else '../shared/data/spec_bench/question.jsonl')]
stats = {}
orig = K.QLinear.forward
def fwd(self, x):
    x2 = x.reshape(-1, x.shape[-1]).float()
    Kd = x2.shape[1]
    if self.bits in K.KQ_BITS and Kd % 256 == 0 and x2.shape[0] >= 16:
        a = x2.abs().reshape(x2.shape[0], Kd // 256, 8, 32)
        bm = a.amax(-1)            # (M, nb, 8)
        am = bm.amax(-1, keepdim=True)
        # s = largest s in 0..3 with bm * 2^s <= am ; e = 3 - s ; uniform iff every block has s = 0 iff bm*2 > am
        uni = ((bm * 2 > am) | (am == 0)).all(-1)  # (M, nb)
        M = uni.shape[0] // 16 * 16
        g = uni[:M].reshape(-1, 16, uni.shape[1]).all(1)
        key = (self.bits, Kd, self.out_features)
        s = stats.setdefault(key, [0, 0, 0, 0])
        s[0] += uni.sum().item(); s[1] += uni.numel(); s[2] += g.sum().item(); s[3] += g.numel()
    return orig(self, x)
K.QLinear.forward = fwd
n = 0
for q in qs[::40][:8]:
    text = q["turns"][0]
    ids = tok.encode(text)[:512]
    if len(ids) < 32: continue
    cache = m.new_cache(1, len(ids) + 4)
    m(torch.tensor([ids]), cache)
    n += 1
print("prompts", n)
tot = [0]*4
for k, s in sorted(stats.items()):
    print(k, f"rows uniform {s[0]/s[1]:.3f}  groups uniform {s[2]/s[3]:.3f}")
    tot = [a+b for a,b in zip(tot, s)]
print("all", f"{tot[0]/tot[1]:.3f} {tot[2]/tot[3]:.3f}")
