# ruff: noqa
import json, torch
import draftwise
from draftwise.api import SpeculativeDecoder
from draftwise.sampling import SamplingParams
prompts = [json.loads(l)["turns"][0] for l in open("prompts.jsonl")]
sd = SpeculativeDecoder(progress=False)
tok = sd.target.tokenizer if hasattr(sd.target, "tokenizer") else None
seqs = []
for p in prompts:
    out = sd.generate(p, SamplingParams(max_tokens=128), method="ar")
    ids = sd.encode(p) if hasattr(sd, "encode") else None
    seqs.append((out.prompt_token_ids if hasattr(out, "prompt_token_ids") else ids, list(out.token_ids)))
d = sd.draft.model
L = d.config.num_layers
head = d.lm_head
def run(layers=None, taps=()):
    agree = tot = 0; infl = torch.zeros(L)
    for pr, gen in seqs:
        ids = list(pr) + gen
        if hasattr(head, "hold"): head.hold(ids, set())
        c = d.new_cache(1, len(ids) + 8)
        o = d.forward(torch.tensor([ids]), c, layers=layers, taps=taps)
        am = o.logits[0].argmax(-1)  # (T,)
        P = len(pr)
        pred = am[P - 1:len(ids) - 1]
        agree += int((pred == torch.tensor(gen)).sum()); tot += len(gen)
        if taps:
            hs = o.taps[0]  # (T, L, D)
            emb = d.embed(torch.tensor([ids]))[0]
            prev = torch.cat([emb[:, None], hs[:, :-1]], 1)
            infl += (1 - torch.nn.functional.cosine_similarity(prev, hs, dim=-1)).mean(0)
    return agree / tot, infl / len(seqs)
a0, infl = run(taps=tuple(range(L)))
print("all layers agreement %.4f" % a0)
print("influence", [round(float(x), 4) for x in infl])
order = [i for i in infl.argsort().tolist() if i not in (0, L - 1)]
for m in (1, 2, 3, 4, 5, 6):
    skip = set(order[:m]); keep = tuple(i for i in range(L) if i not in skip)
    a, _ = run(layers=keep)
    print("skip", sorted(skip), "agreement %.4f" % a)
