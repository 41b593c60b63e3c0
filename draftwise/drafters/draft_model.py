"""A separate, smaller draft model with its own KV cache (same tokenizer as the target). For an
encoder-decoder target the draft is a smaller encoder-decoder model: it encodes the source once, in ``start``."""

from __future__ import annotations

import torch

from ..errors import IncompatibleModelsError, InvalidParameterError
from ..models.base import CausalLM, is_encoder_decoder
from ..models.transformer import VocabSubset
from ..sampling import logits_to_probs, sample, sample_at, top_indices
from ..sequence import Sequence
from .base import Draft
from .registry import Method, register


class DraftModelDrafter:
    """Drafts autoregressively with a small model; q is its (transformed) distribution.

    Seeded sampled sequences draft the coupled draw ``sample_at(q, seed, i)`` (the target's position-keyed
    noise applied to q) as a one-hot draft; the verifier keeps it while it equals the target's own keyed
    draw, so the output is plain decoding's seeded text (see sampling.py).

    ``branches`` > 1 drafts a token tree: the chain, plus at every depth the next ``branches - 1`` choices
    of the draft as leaves beside the chain's token (greedy: the next best tokens; sampling: further draws
    without replacement from the same q; seeded: the next best by q). They cost no draft forward, and
    where the chain's token is rejected the target may still accept one of them.

    Its cache row mirrors the sequence's engine row. ``seq.drafter_state`` is the number of the
    sequence's leading tokens whose keys/values are valid in the draft cache.

    A draft whose head computes part of its vocabulary (``transformer.VocabSubset``) also computes every token
    a running sequence holds — its prompt's and output's — from ``start`` to ``release``.
    """

    name = "draft"

    def __init__(self, model: CausalLM, rows: int, capacity: int, branches: int = 1):
        if not isinstance(branches, int) or branches < 1:
            raise InvalidParameterError(f"branches must be an integer >= 1, got {branches!r}")
        self.model = model
        self.cache = model.new_cache(rows, capacity)
        self.branches = branches
        head = getattr(model, "lm_head", None)
        self.vocab = head if isinstance(head, VocabSubset) else None
        self._held: dict[int, set[int]] = {}  # id(seq) -> the head tiles its tokens hold (VocabSubset.hold)

    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        cache = self.cache.view(slice(seq.row, seq.row + 1))
        cache.reset()
        if self.vocab is not None:
            self.vocab.hold(seq.tokens, self._held.setdefault(id(seq), set()))
        if is_encoder_decoder(self.model):  # an encoder-decoder draft encodes the source into its own cache
            self.model.encode(cache, seq.encoder_ids)
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
        # 2) draft K tokens autoregressively (and, for a tree, the alternatives beside each)
        W = self.branches
        tokens = torch.zeros(B, K, dtype=torch.long)
        alts: list[list[list[int]]] = [[] for _ in seqs]  # [row][depth] -> alternative tokens
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(K):
            for i, s in enumerate(seqs):
                if s.params.greedy:
                    top = top_indices(step_logits[i], W).tolist()
                    tokens[i, j], alt = top[0], top[1:]
                elif s.params.seed is not None:  # coupled draw: the target's keyed noise at that position
                    q = logits_to_probs(step_logits[i], s.params)
                    pos = s.num_output + j
                    tokens[i, j] = x = sample_at(q, s.params.seed, pos, s.uniforms(pos, q.shape[-1]))
                    alt = [t for t in q.topk(min(W, q.shape[-1])).indices.tolist() if t != x][:W - 1]
                else:
                    q = logits_to_probs(step_logits[i], s.params)  # (V,)
                    tokens[i, j] = x = sample(q, s.generator)
                    probs[i].append(q)
                    alt = _without_replacement(q, [int(x)], W - 1, s.generator)
                alts[i].append(alt)
            if j + 1 < K:
                step_logits = self.model.forward(tokens[:, j:j + 1], cache, logits_for="last").logits[:, -1]
        drafts = []
        for i, s in enumerate(seqs):
            k = ks[i]
            s.drafter_state = len(s.tokens) + max(k - 1, 0)  # drafts past k are discarded
            chain = tokens[i, :k].tolist()
            q = torch.stack(probs[i][:k]) if probs[i] and k else None
            if W == 1 or k == 0:
                drafts.append(Draft(chain, q))
                continue
            # the chain's nodes first (0..k-1), then each depth's alternatives as leaves of the same parent
            toks, parents, rows = list(chain), list(range(-1, k - 1)), list(range(k))
            for j in range(k):
                for t in alts[i][j]:
                    toks.append(t)
                    parents.append(j - 1)
                    rows.append(j)
            drafts.append(Draft(toks, None if q is None else q[rows], parents))
        return drafts

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        # the draft cache holds the chain: valid up to the first accepted node that is not a chain node
        on_chain = num_accepted if path is None else next(
            (d for d, node in enumerate(path) if node != d), len(path))
        seq.drafter_state = min(seq.drafter_state, n_before + on_chain)
        if self.vocab is not None:
            self.vocab.hold(seq.tokens[n_before:], self._held.setdefault(id(seq), set()))

    def release(self, seq: Sequence) -> None:
        self.cache.reset(seq.row)
        if self.vocab is not None:
            self.vocab.release(self._held.pop(id(seq), set()))

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)


def _without_replacement(q: torch.Tensor, taken: list[int], m: int, generator) -> list[int]:
    """m further draws from q without replacement, after ``taken`` (each from q without the earlier ones)."""
    out: list[int] = []
    rest = q.clone()
    rest[taken] = 0.0
    for _ in range(m):
        total = rest.sum()
        if total <= 0:
            break
        x = int(sample(rest / total, generator))
        out.append(x)
        rest[x] = 0.0
    return out


def check_compatible(target_tok, draft_tok, target_cfg, draft_cfg) -> None:
    """Draft and target must share the vocabulary (same token ids mean the same strings)."""
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise IncompatibleModelsError(
            f"draft and target have different vocabulary sizes ({draft_cfg.vocab_size} vs "
            f"{target_cfg.vocab_size}); a draft model must use the target's tokenizer")
    fast = getattr(target_tok, "fast", None)
    if fast is not None and fast is getattr(draft_tok, "fast", None):
        return  # one tokenizer, read from byte-identical files (tokenizer.py _rust_tokenizer)
    if target_tok.vocab_signature() != draft_tok.vocab_signature():
        raise IncompatibleModelsError("draft and target tokenizers differ (same size, different tokens); "
                                      "a draft model must use the target's tokenizer")


def _build(dw, rows: int, capacity: int, **opts):
    """The draft model's drafter; one with another tokenizer drafts through a vocabulary bridge."""
    if dw.bridge is not None:
        from .cross_vocab import CrossVocabDrafter

        return CrossVocabDrafter(dw.draft.model, dw.bridge, rows, capacity, **opts)
    return DraftModelDrafter(dw.draft.model, rows, capacity, **opts)


register(Method("draft", _build, help="a smaller draft model (--draft) proposes tokens", draft_model=True,
                seq2seq=True, tree_variant=True))
