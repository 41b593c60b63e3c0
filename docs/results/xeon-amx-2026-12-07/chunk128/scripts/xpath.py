# ruff: noqa
# a 256-token prompt on the avx2, avx512vnni and amx paths (forced) in chunks of 32 and 128: tok/s, and whether every last-position logit is the same bits
import time, torch, draftwise
from draftwise.models import load_model
import draftwise.prefix as pf
from draftwise.kernels import using_isa
m = load_model("qwen2.5-coder-1.5b-instruct").model
torch.set_grad_enabled(False)
P = 256
ids = torch.randint(100, 20000, (P,), generator=torch.Generator().manual_seed(0)).tolist()
out = {}
for isa in ("avx2", "avx512vnni", "amx"):
    with using_isa(isa):
        for chunk in (32, 128):
            pf.PREFILL_CHUNK = chunk
            c = m.new_cache(1, P + 8)
            t = time.perf_counter(); o, _ = pf.prefill(m, ids, c, logits_for="last"); dt = time.perf_counter() - t
            out[(isa, chunk)] = o.logits[0, -1].clone()
            print(isa, chunk, f"{P/dt:.0f} tok/s", flush=True)
ref = out[("avx512vnni", 32)]
print("all equal:", all(torch.equal(v, ref) for v in out.values()))
