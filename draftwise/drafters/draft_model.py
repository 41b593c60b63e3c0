"""A separate, smaller draft model with its own KV cache (same tokenizer as the target)."""

from __future__ import annotations

import torch

from ..errors import IncompatibleModelsError
from ..models.base import CausalLM
from ..sampling import logits_to_probs, sample, sample_at
from ..sequence import Sequence
from .base import Draft


class DraftModelDrafter:
    """Drafts autoregressively with a small model; q is its (transformed) distribution.

    Seeded sampled sequences draft the coupled draw ``sample_at(q, seed, i)`` (the target's position-keyed
    noise applied to q) as a one-hot draft; the verifier keeps it while it equals the target's own keyed
    draw, so the output is plain decoding's seeded text (see sampling.py).

    Its cache row mirrors the sequence's engine row. ``seq.drafter_state`` is the number of the
    sequence's leading tokens whose keys/values are valid in the draft cache.
    """

    name = "draft"

    def __init__(self, model: CausalLM, rows: int, capacity: int):
        self.model = model
        self.cache = model.new_cache(rows, capacity)

    def start(self, seq: Sequence) -> None:
        cache = self.cache.view(slice(seq.row, seq.row + 1))
        cache.reset()
        prefix = seq.tokens[:-1]
        self.model.forward(torch.tensor([prefix]), cache, logits_for="last")
        seq.drafter_state = len(prefix)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        K = max(ks, default=0)
        if K == 0:
            return [Draft([]) for _ in seqs]
        B = len(seqs)
        assert all(s.row == i for i, s in enumerate(seqs)), "engine rows must be 0..B-1"
        cache = self.cache.view(slice(0, B))
        # 1) catch up on tokens the draft cache lacks (the last target token, and after a fully accepted
        #    block the last draft too), right-padded to a common length
        pending = [s.tokens[s.drafter_state:] for s in seqs]  # each has >= 1 token
        P = max(len(p) for p in pending)
        x = torch.zeros(B, P, dtype=torch.long)
        for i, p in enumerate(pending):
            x[i, :len(p)] = torch.tensor(p)
        cache.set_lengths([s.drafter_state for s in seqs])
        last = torch.tensor([len(p) - 1 for p in pending])  # (B,) each row's last real token
        step_logits = self.model.forward(x, cache, logits_for=last).logits[:, 0]  # (B, V)
        cache.set_lengths([len(s.tokens) for s in seqs])
        # 2) draft K tokens autoregressively
        tokens = torch.zeros(B, K, dtype=torch.long)
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(K):
            for i, s in enumerate(seqs):
                if s.params.greedy:
                    tokens[i, j] = step_logits[i].argmax()
                elif s.params.seed is not None:  # coupled draw: the target's keyed noise at that position
                    q = logits_to_probs(step_logits[i], s.params)
                    pos = s.num_output + j
                    tokens[i, j] = sample_at(q, s.params.seed, pos, s.uniforms(pos, q.shape[-1]))
                else:
                    q = logits_to_probs(step_logits[i], s.params)  # (V,)
                    tokens[i, j] = sample(q, s.generator)
                    probs[i].append(q)
            if j + 1 < K:
                step_logits = self.model.forward(tokens[:, j:j + 1], cache, logits_for="last").logits[:, -1]
        drafts = []
        for i, s in enumerate(seqs):
            k = ks[i]
            s.drafter_state = len(s.tokens) + max(k - 1, 0)  # drafts past k are discarded
            drafts.append(Draft(tokens[i, :k].tolist(), torch.stack(probs[i][:k]) if probs[i] and k else None))
        return drafts

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor) -> None:
        seq.drafter_state = min(seq.drafter_state, n_before + num_accepted)

    def release(self, seq: Sequence) -> None:
        self.cache.reset(seq.row)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)


def check_compatible(target_tok, draft_tok, target_cfg, draft_cfg) -> None:
    """Draft and target must share the vocabulary (same token ids mean the same strings)."""
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise IncompatibleModelsError(
            f"draft and target have different vocabulary sizes ({draft_cfg.vocab_size} vs "
            f"{target_cfg.vocab_size}); a draft model must use the target's tokenizer")
    if target_tok.vocab_signature() != draft_tok.vocab_signature():
        raise IncompatibleModelsError("draft and target tokenizers differ (same size, different tokens); "
                                      "a draft model must use the target's tokenizer")
