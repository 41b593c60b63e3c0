# The int4 draft's block format: teacher-forced top-1 agreement with the 1.5B's greedy text, and the token's time.
# python q4exp.py Q4_1,Q4_0,Q5_0 TF_JSON HOME
#   TF_JSON: tf.json of ../../zen4-2026-11-27/draft-stop/tf.py (the target's greedy tokens per prompt)
#   HOME: a scratch DRAFTWISE_HOME whose models/ and kernels/ link to the real ones (its converted/ is rebuilt)
import os, sys
os.environ["DRAFTWISE_HOME"] = sys.argv[3]
import draftwise  # noqa: F401  (before torch)
import json, time, statistics, torch
from pathlib import Path
from draftwise.api import setup_threads
from draftwise.models import load_model, loading
from draftwise.models.transformer import restrict_vocab
import draftwise.models.loading as L
setup_threads(2)
variants = sys.argv[1].split(",")
tf = json.load(open(sys.argv[2]))
prompts = {}
for f in ("code", "specbench12"):
    for line in open(Path(__file__).parents[2] / "zen4-2026-11-27" / "draft-lookup" / f"{f}.jsonl"):
        q = json.loads(line); prompts[str(q["question_id"])] = q["turns"][0]
models = {}
import shutil
for v in variants:
    # the int4 conversion with this block format (loading.quantize_linears, its qtype changed)
    def ql(sd, bits, _v=v):
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize
        from draftwise.kernels.gguf_quant import kq_format, repack
        out = {}
        tied = "lm_head.weight" not in sd
        for k, w in sd.items():
            qt = _v
            if w.dim() == 2 and (k != L.EMBED or tied) and w.shape[1] % 32 == 0 and kq_format(qt, tuple(w.shape)) is not None:
                raw = quantize(np.ascontiguousarray(w.float().numpy()), getattr(GGMLQuantizationType, qt))
                code = repack(raw, qt, tuple(w.shape))
                out.update({k + ".q": code.q, k + ".scale": code.scale, k + ".qmeta": torch.tensor([code.group, code.bits])})
            else:
                out[k] = w
        return out
    L.quantize_linears = ql
    conv = os.path.join(sys.argv[3], "converted")
    shutil.rmtree(conv, ignore_errors=True)
    t = time.time()
    lm = load_model("qwen2.5-coder-0.5b-instruct", dtype="int4", progress=False)
    print(v, "loaded", round(time.time() - t, 1), "s", flush=True)
    restrict_vocab(lm.model, 32768, set())
    models[v] = lm
tok = models[variants[0]].tokenizer
# agreement, exact path (chunks of 32)
def agree(m, ids, target):
    toks = ids + target
    cache = m.new_cache(1, len(toks) + 8)
    rows = []
    with torch.inference_mode():
        for i in range(0, len(toks), 32):
            lg = m.forward(torch.tensor([toks[i:i + 32]]), cache, logits_for="all").logits[0]
            rows.append(lg.argmax(-1))
    arg = torch.cat(rows)
    n = len(ids)
    return [int(arg[n - 1 + j]) == target[j] for j in range(len(target))]
res = {v: {} for v in variants}
for rec in tf:
    ids = tok.encode(prompts[str(rec["id"])]) if hasattr(tok, "encode") else None
    for v in variants:
        a = agree(models[v].model, ids, rec["target"])
        res[v][str(rec["id"])] = sum(a) / len(a)
    print(rec["id"], {v: round(res[v][str(rec["id"])], 3) for v in variants}, flush=True)
for v in variants:
    code = [x for k, x in res[v].items() if k.startswith("code")]
    sb = [x for k, x in res[v].items() if not k.startswith("code")]
    print(v, "agreement code", round(statistics.mean(code), 4), "specbench", round(statistics.mean(sb), 4))
# token time, alternated
caches = {}
for v in variants:
    m = models[v].model
    c = m.new_cache(1, 1024); m.forward(torch.randint(0, 30000, (1, 64)), c, logits_for="last"); caches[v] = c
times = {v: [] for v in variants}
ids1 = torch.tensor([[100]])
for r in range(12):
    for v in variants:
        m, c = models[v].model, caches[v]
        ts = []
        for k in range(20):
            c.set_lengths([64]); t = time.perf_counter(); m.forward(ids1, c, logits_for="last"); ts.append(time.perf_counter() - t)
        times[v].append(statistics.median(ts) * 1e3)
for v in variants:
    print(v, "token ms median of rounds", round(statistics.median(times[v]), 2), [round(x, 2) for x in times[v]])
