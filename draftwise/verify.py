"""The rejection sampler: pure functions of tensors (no model, no cache).

Vocabulary of a verification step over k drafted tokens:
  *output tokens = accepted drafts + one recovered (on rejection) or bonus (all accepted) token*,
so every step emits between 1 and k+1 tokens.

- greedy: accept while the draft equals the target's argmax; the next token is the target's argmax at
  the first mismatch (the recovered token) or after the last draft (the bonus token).
- sampling (Leviathan et al. / Chen et al.): accept draft x_i with probability min(1, p_i(x)/q_i(x));
  on the first rejection emit a sample of norm(max(0, p_i - q_i)); if all k are accepted emit a sample of
  p_k. The emitted sequence is distributed exactly as sampling from p alone.
- deterministic drafters (n-gram, lookup) have no q: q_i is one-hot on the drafted token, so x is
  accepted with probability p_i(x) and the recovered token is drawn from p_i with x removed.
- seeded requests (``verify_keyed``): the target's token at output position i is its position-keyed draw
  ``sample_at(p_i, seed, i)`` — the very draw plain decoding makes there — and drafts are accepted while
  they equal it. For a one-hot draft this accepts x with probability p_i(x), as rejection sampling does;
  every output token is the target's own keyed sample, so the text is plain decoding's with that seed,
  whatever the drafter, γ or batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .sampling import sample, sample_at


@dataclass
class VerifyResult:
    num_accepted: int  # drafts accepted (0..k)
    tokens: list[int]  # accepted drafts + recovered-or-bonus token: num_accepted + 1 tokens
    bonus: bool  # True when all k drafts were accepted and tokens[-1] is the bonus token


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyResult:
    """target_logits: (k+1, V) — row i scores the token after draft i-1; draft_tokens: (k,)."""
    k = draft_tokens.shape[0]
    best = target_logits.argmax(-1)  # (k+1,)
    mismatch = (best[:k] != draft_tokens).nonzero()
    n = int(mismatch[0]) if mismatch.numel() else k
    return VerifyResult(n, draft_tokens[:n].tolist() + [int(best[n])], bonus=n == k)


def verify_sampled(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None) -> VerifyResult:
    """Speculative rejection sampling for one sequence.

    target_probs: (k+1, V) — p_0..p_k (same sampling transform as q)
    draft_tokens: (k,) — x_1..x_k, x_i sampled from draft_probs[i-1]
    draft_probs:  (k, V) — q, or None for a deterministic drafter (one-hot q)
    """
    k = draft_tokens.shape[0]
    idx = torch.arange(k)
    p_x = target_probs[idx, draft_tokens]  # (k,)
    q_x = torch.ones(k) if draft_probs is None else draft_probs[idx, draft_tokens]
    u = torch.rand(k, generator=generator)
    # accept iff u < p/q  (written as u*q < p: no division, and q(x) = 0 never happens for a sampled x)
    rejected = (u * q_x >= p_x).nonzero()
    n = int(rejected[0]) if rejected.numel() else k
    if n == k:
        return VerifyResult(k, draft_tokens.tolist() + [int(sample(target_probs[k], generator))], bonus=True)
    p = target_probs[n]
    if draft_probs is None:
        residual = p.clone()
        residual[draft_tokens[n]] = 0.0
    else:
        residual = (p - draft_probs[n]).clamp_min(0.0)
    total = residual.sum()
    # total == 0 only if p == q exactly, where rejection has probability 0; guard against float dust
    residual = residual / total if total > 0 else p
    return VerifyResult(n, draft_tokens[:n].tolist() + [int(sample(residual, generator))], bonus=False)


def verify_keyed(target_probs: torch.Tensor, draft_tokens: torch.Tensor, seed: int, position: int,
                 uniforms: Callable[[int], np.ndarray] | None = None) -> VerifyResult:
    """Position-keyed verification for a seeded sequence.

    target_probs: (k+1, V) — p_0..p_k, p_i the target's distribution at output position ``position + i``
    draft_tokens: (k,) — however they were drafted (one-hot, coupled draws, ...): only equality counts
    uniforms: position -> ``position_uniforms(seed, position, >= V)`` (a cache), or None to compute them
    """
    k = draft_tokens.shape[0]
    drafts = draft_tokens.tolist()
    for i in range(k + 1):
        pos = position + i
        t = sample_at(target_probs[i], seed, pos, None if uniforms is None else uniforms(pos))
        if i == k or t != drafts[i]:
            return VerifyResult(i, drafts[:i] + [t], bonus=i == k)
    raise AssertionError("unreachable")


def verify_reference(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None) -> VerifyResult:
    """Slow, obviously-correct loop version of verify_sampled (tests compare the two).

    Consumes the generator in the same order: k uniforms, then one sample.
    """
    k = len(draft_tokens)
    us = torch.rand(k, generator=generator).tolist()
    out: list[int] = []
    for i in range(k):
        x = int(draft_tokens[i])
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft_probs[i]
        if us[i] < min(1.0, float(p[x]) / float(q[x])):
            out.append(x)
            continue
        residual = torch.clamp(p - q, min=0.0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return VerifyResult(i, out, bonus=False)
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return VerifyResult(k, out, bonus=True)
