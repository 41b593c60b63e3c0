"""``draftwise agreement``: how much a weight / activation format changes the model's greedy output.

Each variant ``FORMAT[:ACTIVATIONS]`` (``gguf``, ``int4:int8``, ``gguf:fp32``, ``bf16`` ...) decodes the
same prompts greedily with plain autoregressive decoding, and is compared token by token with the
reference (default ``fp32``: the same weights de-quantized exactly, fp32 activations). Reported per
variant: the share of prompts whose whole continuation is identical, the mean length of the common
prefix (as a share of the tokens generated), and decoding speed. Speculative decoding never changes a
format's output; this measures what the format itself costs in quality.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from dataclasses import dataclass

from ..errors import InvalidParameterError
from ..models import WEIGHT_FORMATS

ACTIVATIONS = ("int8", "fp32")


@dataclass(frozen=True)
class Variant:
    weights: str
    activations: str = "int8"  # int8 activations on the quantized kernel's VNNI path, or fp32 (exact)

    @property
    def name(self) -> str:
        return f"{self.weights}:{self.activations}"

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        w, _, a = spec.strip().partition(":")
        if w not in WEIGHT_FORMATS:
            raise InvalidParameterError(f"unknown weight format {w!r} in {spec!r}; choose from {', '.join(WEIGHT_FORMATS)}")
        a = a or ("int8" if w in ("auto", "gguf", "int8", "int4") else "fp32")
        if a not in ACTIVATIONS:
            raise InvalidParameterError(f"unknown activation precision {a!r} in {spec!r}; choose int8 or fp32")
        return cls(w, a)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """Agreement of greedy continuations with the reference's, prompt by prompt."""
    if not reference:
        return {"identical": 0.0, "prefix_share": 0.0, "prompts": 0}
    same = sum(r == o for r, o in zip(reference, outputs))
    shares = [common_prefix(r, o) / max(len(r), 1) for r, o in zip(reference, outputs)]
    return {"identical": same / len(reference), "prefix_share": sum(shares) / len(shares), "prompts": len(reference)}


def forced_top1(model, prompt_ids: list[int], continuation: list[int]) -> tuple[int, int]:
    """(positions where ``model``'s greedy token equals the continuation's, positions) with the model fed
    the prompt and the continuation (teacher forcing): how often the format alone flips a greedy choice,
    each position judged on the same context (a free-running comparison stops at the first flip)."""
    import torch

    from ..kernels import exact_prefill

    if not continuation:
        return 0, 0
    ids = torch.tensor([prompt_ids + continuation[:-1]])  # (1, P + n - 1)
    cache = model.new_cache(1, ids.shape[1] + 1)
    with exact_prefill():
        logits = model.forward(ids, cache, logits_for="all").logits[0, len(prompt_ids) - 1:]  # (n, V)
    return int((logits.argmax(-1) == torch.tensor(continuation)).sum()), len(continuation)


def decode_all(target: str, variant: Variant, prompts: list[str], chat: bool, max_tokens: int,
               progress, reference: list[list[int]] | None = None) -> tuple[list[list[int]], float, float]:
    """Greedy ``ar`` continuations of every prompt with this variant; returns (outputs, mean tok/s, top-1
    agreement with ``reference``'s continuations under teacher forcing — ``forced_top1`` — or 1.0 without)."""
    from ..api import SpeculativeDecoder
    from ..kernels import exact_activations, exact_prefill, set_activation_bits
    from ..models import load_model
    from ..sampling import SamplingParams

    fp32 = variant.activations == "fp32"
    with exact_activations() if fp32 else contextlib.nullcontext():  # Q4_K / Q6_K in a code with fp32 activations
        loaded = load_model(target, variant.weights, "native", progress=False)
    set_activation_bits(loaded.model, 8 if variant.activations == "int8" else 32)
    dw = SpeculativeDecoder(loaded, None)
    params = SamplingParams(max_tokens=max_tokens)
    dw.generate(prompts[0], SamplingParams(max_tokens=4), method="ar", chat=chat)  # warm-up
    outs, speeds, same, seen = [], [], 0, 0
    for i, text in enumerate(prompts):
        with exact_prefill():  # prompts in the format's own numbers (never bf16 GEMM: that is not fp32)
            r = dw.generate(text, params, method="ar", chat=chat)
        outs.append(r.token_ids)
        speeds.append(r.stats.tokens_per_s)
        if reference is not None:
            a, n = forced_top1(loaded.model, dw.encode(text, chat), reference[i])
            same, seen = same + a, seen + n
        progress()
    del dw, loaded
    gc.collect()
    return outs, sum(speeds) / len(speeds), same / seen if seen else 1.0


def run_agreement(target: str, variants: list[Variant], reference: Variant, prompts: list[str],
                  max_tokens: int, chat: bool = False) -> dict:
    from rich.progress import Progress

    results = {"target": target, "reference": reference.name, "max_tokens": max_tokens, "variants": {}}
    with Progress(transient=True) as bar:
        task = bar.add_task("agreement", total=len(prompts) * (len(variants) + 1))
        step = lambda: bar.advance(task)  # noqa: E731
        ref_out, ref_speed, _ = decode_all(target, reference, prompts, chat, max_tokens, step)
        results["variants"][reference.name] = {**compare(ref_out, ref_out), "forced_top1": 1.0,
                                               "tokens_per_s": ref_speed}
        for v in variants:
            out, speed, top1 = decode_all(target, v, prompts, chat, max_tokens, step, reference=ref_out)
            results["variants"][v.name] = {**compare(ref_out, out), "forced_top1": top1, "tokens_per_s": speed}
    return results


def markdown(results: dict) -> str:
    lines = [f"Greedy agreement with `{results['reference']}` ({results['target']}, "
             f"{results['variants'][results['reference']]['prompts']} prompts × {results['max_tokens']} tokens)", "",
             "| weights:activations | identical continuations | mean common prefix | top-1 on the reference's text "
             "| tok/s |", "|---|---|---|---|---|"]
    for name, r in results["variants"].items():
        lines.append(f"| {name} | {r['identical']:.0%} | {r['prefix_share']:.0%} | {r.get('forced_top1', 1.0):.2%} "
                     f"| {r['tokens_per_s']:.2f} |")
    lines += ["", "Top-1 on the reference's text: each variant fed the prompt and the reference's continuation "
              "(teacher forcing); the share of positions where its greedy token is the reference's. A free-running "
              "comparison stops at the first flip, so one near-tie early in a prompt decides it."]
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    p.add_argument("--variants", default="gguf:int8,gguf:fp32,int4:int8,int8:int8,bf16",
                   help="comma-separated FORMAT[:ACTIVATIONS] to compare (activations int8 or fp32)")
    p.add_argument("--reference", default="fp32", help="the variant the others are compared with (default fp32)")
    p.add_argument("--prompts", default=None, help="JSONL prompts (default: Spec-Bench, shipped with draftwise)")
    p.add_argument("--categories", default=None, help="comma-separated categories")
    p.add_argument("--limit", type=int, default=2, help="prompts per category (default 2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    p.add_argument("--out", default=None, help="also write agreement.json and agreement.md into this folder")


def cmd_agreement(args) -> int:
    from ..outputs import out_folder
    from .prompts import load_prompts

    if args.max_tokens < 1:
        raise InvalidParameterError("--max-tokens must be >= 1")
    variants = [Variant.parse(s) for s in args.variants.split(",") if s.strip()]
    reference = Variant.parse(args.reference)
    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    _, prompts = load_prompts(args.prompts, cats, args.limit)
    out = out_folder(args.out, "--out") if args.out else None  # before minutes of decoding
    t0 = time.time()
    results = run_agreement(args.target, variants, reference, [p.text for p in prompts], args.max_tokens, args.chat)
    results["wall_s"] = time.time() - t0
    md = markdown(results)
    print(md)
    if out is not None:
        (out / "agreement.json").write_text(json.dumps(results, indent=2))
        (out / "agreement.md").write_text(md)
    return 0
