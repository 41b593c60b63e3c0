# teacher-forced: the target's greedy text, the draft's argmax and top probability at every output position
import json, sys, torch
from draftwise.api import SpeculativeDecoder, setup_threads
from draftwise.sampling import SamplingParams
setup_threads(2)
dw = SpeculativeDecoder("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", progress=False)
out = []
for path in sys.argv[1:]:
    for line in open(path):
        q = json.loads(line)
        ids = dw.encode(q["turns"][0], False)
        r = dw.generate(ids, SamplingParams(max_tokens=128), method="pld")
        toks = ids + r.token_ids
        m = dw.draft.model
        with torch.inference_mode():
            lg = m.forward(torch.tensor([toks]), m.new_cache(1, len(toks) + 8), logits_for="all").logits[0].float()
        p = torch.softmax(lg, -1)
        top, arg = p.max(-1)
        n = len(ids)
        # position j of the output: predicted from toks[:n+j] -> logits row n+j-1
        rows = range(n - 1, len(toks) - 1)
        out.append({"id": q["question_id"], "cat": q.get("category"), "target": r.token_ids,
                    "arg": [int(arg[i]) for i in rows], "conf": [round(float(top[i]), 4) for i in rows],
                    "ptgt": [round(float(p[i, toks[i + 1]]), 4) for i in rows]})
        print(q["question_id"], len(r.token_ids), sum(a == t for a, t in zip(out[-1]["arg"], r.token_ids)) / len(r.token_ids), flush=True)
json.dump(out, open("tf.json", "w"))
