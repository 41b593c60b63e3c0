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

Token trees (``verify_tree_*``): from the root (the sequence's last token) walk down while a child is
accepted; each node's children are tried in order.
- greedy: the child whose token is the target's argmax, if any.
- sampling (SpecInfer / EAGLE multi-branch; with q, recursive rejection sampling for siblings drawn
  without replacement, Jeon et al. 2024): child x_j is accepted with probability min(1, p(x_j) / q_j(x_j));
  on rejection p <- norm(max(p - q_j, 0)) and, for sampled siblings, q loses x_j (q_{j+1} = norm(q_j
  without x_j)). One-hot q (deterministic drafts): x_j is accepted with probability p(x_j), else p loses
  x_j. When every child is rejected the token is a sample of what is left of p; at a leaf, of p.
  Every emitted token is distributed as the target's (tests/test_verify.py checks trees of several shapes).
- seeded: the child equal to the target's keyed draw at that depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .sampling import argmax, sample, sample_at


@dataclass
class VerifyResult:
    num_accepted: int  # drafts accepted (0..k)
    tokens: list[int]  # accepted drafts + recovered-or-bonus token: num_accepted + 1 tokens
    bonus: bool  # True when all k drafts were accepted and tokens[-1] is the bonus token
    path: list[int] | None = None  # a tree's accepted nodes, root to leaf (None: drafts 0..num_accepted-1)

    @property
    def nodes(self) -> list[int]:
        return list(range(self.num_accepted)) if self.path is None else self.path


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyResult:
    """target_logits: (k+1, V) — row i scores the token after draft i-1; draft_tokens: (k,)."""
    k = draft_tokens.shape[0]
    best = argmax(target_logits)  # (k+1,)
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


def _children(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {-1: []}
    for i, q in enumerate(parents):
        kids.setdefault(q, []).append(i)
        kids.setdefault(i, [])
    return kids


def _tree_result(path: list[int], tokens: list[int], last: int, leaf: bool) -> VerifyResult:
    return VerifyResult(len(path), [tokens[i] for i in path] + [last], bonus=leaf, path=path)


def verify_tree_greedy(target_logits: torch.Tensor, tokens: list[int], parents: list[int]) -> VerifyResult:
    """target_logits: (n+1, V) — row 0 scores the token after the root, row i+1 the token after node i."""
    kids = _children(parents)
    best = argmax(target_logits).tolist()  # (n+1,)
    node, path = -1, []
    while True:
        want = best[node + 1]
        nxt = next((c for c in kids[node] if tokens[c] == want), None)
        if nxt is None:
            return _tree_result(path, tokens, want, leaf=not kids[node])
        path.append(nxt)
        node = nxt


def verify_tree_sampled(target_probs: torch.Tensor, tokens: list[int], parents: list[int],
                        draft_probs: torch.Tensor | None, generator: torch.Generator | None) -> VerifyResult:
    """Multi-branch rejection sampling. target_probs: (n+1, V) as in ``verify_tree_greedy``; draft_probs:
    (n, V) q per node (siblings share it: drawn without replacement), or None (one-hot q)."""
    kids = _children(parents)
    node, path = -1, []
    while True:
        p = target_probs[node + 1]
        children = kids[node]
        if not children:
            return _tree_result(path, tokens, int(sample(p, generator)), leaf=True)
        q = None if draft_probs is None else draft_probs[children[0]].clone()
        accepted = None
        for c in children:
            x = tokens[c]
            u = float(torch.rand(1, generator=generator))
            if q is None:  # one-hot q: accept with probability p(x)
                if u < float(p[x]):
                    accepted = c
                    break
                p = p.clone()
                p[x] = 0.0
            else:
                if float(q[x]) <= 0.0:  # a repeated sibling (not a draw without replacement): skip it
                    continue
                if u * float(q[x]) < float(p[x]):
                    accepted = c
                    break
                p = (p - q).clamp_min(0.0)
                q[x] = 0.0
                qs = q.sum()
                q = q / qs if qs > 0 else q
            ps = p.sum()
            # ps == 0 only if p was covered by the rejected q exactly (probability 0); guard float dust
            p = p / ps if ps > 0 else target_probs[node + 1]
        if accepted is None:
            return _tree_result(path, tokens, int(sample(p, generator)), leaf=False)
        path.append(accepted)
        node = accepted


def verify_tree_keyed(target_probs: torch.Tensor, tokens: list[int], parents: list[int], seed: int, position: int,
                      uniforms: Callable[[int], np.ndarray] | None = None) -> VerifyResult:
    """Seeded: at depth d the target's keyed draw at output position ``position + d`` picks the child."""
    kids = _children(parents)
    node, path = -1, []
    while True:
        pos = position + len(path)
        t = sample_at(target_probs[node + 1], seed, pos, None if uniforms is None else uniforms(pos))
        nxt = next((c for c in kids[node] if tokens[c] == t), None)
        if nxt is None:
            return _tree_result(path, tokens, t, leaf=not kids[node])
        path.append(nxt)
        node = nxt
