"""How a seeded draft model should draft: coupled keyed draws vs rejection sampling, measured.

For a seeded sampled request the draft model can
- draft the *coupled* draw ``sample_at(q, seed, i)`` (the target's keyed noise applied to q) and have it
  verified by equality with the target's keyed draw: the text then equals plain decoding's with that
  seed, for every γ, batch and load; a draft is accepted with P(argmax p/E = argmax q/E);
- or keep *rejection sampling* (with position-keyed uniforms): a draft is accepted with
  sum_x min(p(x), q(x)) = 1 - TV(p, q), the most any scheme can accept — but the text then depends on
  which positions were drafted, i.e. on γ, so on load.

This measures both per-token acceptance rates on real trajectories: plain decoding with a seed at the
given temperature on Spec-Bench prompts, then at every output position the target's p and the draft's q
given the same prefix; 1 - TV exactly, the coupled rate as the mean over ``--draws`` keyed draws.

    python -m draftwise.bench.coupling --limit 2 --max-tokens 64 --temperature 0.8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from ..api import ModelSpec, SpeculativeDecoder, build_decoder
from ..sampling import SamplingParams, logits_to_probs, position_uniforms, sample_at
from .prompts import load_prompts


def position_rates(p: torch.Tensor, q: torch.Tensor, draws: int, key: int) -> tuple[float, float]:
    """(1 - TV(p, q), fraction of ``draws`` keyed draws where p's and q's draws agree) for (V,) p, q."""
    V = min(p.shape[-1], q.shape[-1])
    rej = float(torch.minimum(p[:V], q[:V]).sum())
    same = 0
    for d in range(draws):
        u = position_uniforms(key, d, max(p.shape[-1], q.shape[-1]))
        same += sample_at(p, key, d, u) == sample_at(q, key, d, u)
    return rej, same / draws


def measure(dw: SpeculativeDecoder, texts: list[tuple[str, str]], params: SamplingParams, draws: int,
            progress=None) -> dict:
    per_cat: dict[str, list[tuple[float, float]]] = {}
    for n, (cat, text) in enumerate(texts):
        ids = dw.encode(text, chat=False)  # as the bench encodes by default
        out = dw.generate(ids, params, method="ar").token_ids
        seq = ids + out
        rows = []
        with torch.inference_mode():
            logits = {}
            head, held = getattr(dw.draft.model, "lm_head", None), set()
            if hasattr(head, "hold"):  # a cut draft head computes the context's tokens too, as when drafting
                # (here the whole output's at every position; a drafter's grow as it decodes)
                head.hold(seq, held)
            for name, model in (("p", dw.target.model), ("q", dw.draft.model)):
                cache = model.new_cache(1, len(seq) + 1)
                logits[name] = model.forward(torch.tensor([seq]), cache, logits_for="all").logits[0]  # (T, V)
            if held:
                head.release(held)
            for i in range(len(out)):
                t = len(ids) - 1 + i  # scores of the token at output position i
                p = logits_to_probs(logits["p"][t], params)
                q = logits_to_probs(logits["q"][t], params)
                rows.append(position_rates(p, q, draws, key=n * 1_000_003 + i))
        per_cat.setdefault(cat, []).extend(rows)
        if progress:
            progress(n + 1, len(texts))
    result = {"temperature": params.temperature, "top_p": params.top_p, "draws": draws, "categories": {}}
    everything = [r for rows in per_cat.values() for r in rows]
    for cat, rows in [*per_cat.items(), ("all", everything)]:
        result["categories"][cat] = {
            "positions": len(rows),
            "rejection_sampling": round(statistics.fmean(r[0] for r in rows), 4),
            "coupled_draws": round(statistics.fmean(r[1] for r in rows), 4)}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draftwise.bench.coupling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--limit", type=int, default=2, help="prompts per category (default 2)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draws", type=int, default=32, help="keyed draws per position for the coupled rate")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    kwargs = {k: v for k, v in (("target", args.target), ("draft", args.draft)) if v}
    dw = build_decoder(ModelSpec(**kwargs), progress=True)
    _, prompts = load_prompts(args.prompts, limit=args.limit)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    res = measure(dw, [(p.category, p.text) for p in prompts], params, args.draws,
                  progress=lambda i, n: print(f"  {i}/{n} prompts", file=sys.stderr, flush=True))
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
