# ruff: noqa
import time, sys, torch, statistics
import draftwise
from draftwise.models import load_model
import draftwise.models.transformer as tr, draftwise.prefix as pf
from draftwise.kernels import extension
from draftwise.kernels.gguf_quant import KQ_TYPES
ext = extension()
m = load_model("qwen2.5-coder-1.5b-instruct").model
torch.set_grad_enabled(False)
from draftwise.models.base import KVCache
P = int(sys.argv[1]) if len(sys.argv) > 1 else 512
ids = torch.randint(100, 20000, (P,), generator=torch.Generator().manual_seed(0)).tolist()
def run(chunk, tiles):
    tr.EXACT_MAX_T = chunk; pf.PREFILL_CHUNK = chunk
    for n in ("Q4_K", "Q6_K"):
        ext.set_amx_min_rows(KQ_TYPES[n], 1 if tiles else 1 << 30)
    cache = m.new_cache(1, P + 8)
    best = []
    for r in range(3):
        cache.set_lengths(0)
        t = time.perf_counter(); out, _ = pf.prefill(m, ids, cache, logits_for="last"); best.append(time.perf_counter() - t)
        last = out.logits[0, -1].clone()
    return min(best), last
ref = None
for chunk in (32, 64, 128, 256):
    for tiles in (False, True):
        t, last = run(chunk, tiles)
        if ref is None: ref = last
        print(f"P={P} chunk={chunk} tiles={tiles}: {t*1000:.0f} ms = {P/t:.0f} tok/s  same={torch.equal(ref,last)}", flush=True)
