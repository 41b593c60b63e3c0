# greedy tokens of the real 1.5B with the AMX tiles taking every call of 2+ rows, against AVX512-VNNI's
import time
from draftwise import SamplingParams, SpeculativeDecoder
from draftwise.kernels import extension, set_isa
ext = extension()
dw = SpeculativeDecoder(progress=False)
params = SamplingParams(max_tokens=64)
prompt = "def quicksort(arr):"
long = "Summarize: " + " ".join(["The tile kernel multiplies bytes."] * 60)  # a prompt of several 32-token chunks
out = {}
for isa in ("avx512vnni", "amx"):
    set_isa(isa)
    if isa == "amx":
        ext.set_amx_min_rows(12, 2), ext.set_amx_min_rows(14, 2)
    for p in (prompt, long):
        for m in ("ar", "draft", "pld", "draft-tree"):
            t0 = time.perf_counter()
            r = dw.generate(p, params, method=m, gamma=4 if m != "draft-tree" else "auto")
            out[(isa, p[:10], m)] = r.token_ids
            print(isa, p[:10], m, len(r.token_ids), f"{time.perf_counter() - t0:.2f}s", flush=True)
ref = out[("avx512vnni", prompt[:10], "ar")], out[("avx512vnni", long[:10], "ar")]
bad = [k for k, v in out.items() if v != (ref[0] if k[1] == prompt[:10] else ref[1])]
print("mismatches:", bad or "none")
