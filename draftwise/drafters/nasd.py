"""NASD: counted k-gram storage with a top-k filler.

Storage: for every context length c in [1, N-1] (k-grams, k = c+1 in [2, N]) a table
context -> {next token: weight, ...} with the running best next token. It is seeded with the prompt's
k-grams, grows with every emitted token, and is *filled* after every verification with the target's
top-k tokens at each verified position (what the target itself would say after that context), weighted
below real observations. Drafting walks forward greedily: at each step the longest context present in
storage wins (back-off from N-1 to 1), and its best next token is proposed; the draft stops at the first
context no table knows. An encoder-decoder target's source is seeded too (``Sequence.lookup_context``).

With ``branches`` > 1 it proposes a token tree: the ``branches`` best first tokens (backing off for more),
each followed by its greedy walk.

Lossless under sampling: the drafter is deterministic, so q is one-hot on each proposed token and the
verifier accepts x with probability p(x) and resamples from p without x on rejection (verify.py). The
original design accepted filler tokens without that correction, which biases sampled output.
"""

from __future__ import annotations

import torch

from ..errors import InvalidParameterError
from ..sampling import top_indices
from ..sequence import Sequence
from .base import Draft, StatelessDrafter, trie
from .registry import Method, register


class _Table:
    __slots__ = ("counts", "best", "best_w")

    def __init__(self):
        self.counts: dict[int, float] = {}
        self.best = -1
        self.best_w = 0.0

    def add(self, tok: int, w: float) -> None:
        c = self.counts.get(tok, 0.0) + w
        self.counts[tok] = c
        if c > self.best_w:
            self.best, self.best_w = tok, c


class _Storage:
    def __init__(self, max_ctx: int):
        self.max_ctx = max_ctx
        self.tables: list[dict[tuple[int, ...], _Table]] = [{} for _ in range(max_ctx + 1)]  # by ctx len
        self.upto = 0  # transitions into positions < upto are counted

    def observe(self, toks: list[int]) -> None:
        for e in range(max(self.upto, 1), len(toks)):  # token toks[e] after context toks[..e]
            for c in range(1, min(self.max_ctx, e) + 1):
                self._table(c, tuple(toks[e - c:e])).add(toks[e], 1.0)
        self.upto = max(self.upto, len(toks))

    def fill(self, context: list[int], tokens: list[int], weights: list[float]) -> None:
        for c in range(1, min(self.max_ctx, len(context)) + 1):
            t = self._table(c, tuple(context[-c:]))
            for tok, w in zip(tokens, weights):
                t.add(tok, w)

    def _table(self, c: int, key: tuple[int, ...]) -> _Table:
        t = self.tables[c].get(key)
        if t is None:
            t = self.tables[c][key] = _Table()
        return t

    def candidates(self, context: list[int], m: int) -> list[int]:
        """Up to m distinct next tokens, best first: by weight in the longest known context, then backing
        off to shorter contexts for more."""
        out: list[int] = []
        for c in range(min(self.max_ctx, len(context)), 0, -1):
            t = self.tables[c].get(tuple(context[-c:]))
            if t is not None:
                for tok in [t.best] + [tok for tok, _ in sorted(t.counts.items(), key=lambda kv: -kv[1])]:
                    if tok not in out:
                        out.append(tok)
                    if len(out) >= m:
                        return out
        return out

    def predict(self, context: list[int]) -> int | None:
        for c in range(min(self.max_ctx, len(context)), 0, -1):
            t = self.tables[c].get(tuple(context[-c:]))
            if t is not None:
                return t.best
        return None


class NASDDrafter(StatelessDrafter):
    name = "nasd"

    def __init__(self, max_ngram: int = 5, top_k: int = 4, filler_weight: float = 0.5, branches: int = 1):
        if max_ngram < 2:
            raise InvalidParameterError("max_ngram must be >= 2")
        if not isinstance(branches, int) or branches < 1:
            raise InvalidParameterError(f"branches must be an integer >= 1, got {branches!r}")
        self.max_ngram, self.top_k, self.filler_weight = max_ngram, top_k, filler_weight
        self.branches = branches

    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        st = _Storage(self.max_ngram - 1)
        st.observe(seq.lookup_context)
        seq.drafter_state = st

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        out = []
        for s, k in zip(seqs, ks):
            st: _Storage = s.drafter_state
            toks = s.lookup_context
            st.observe(toks)
            ctx = toks[-st.max_ctx:]
            first = st.candidates(ctx, self.branches) if k > 0 else []
            branches = [self._extend(st, ctx, t, k) for t in first]
            out.append(trie(branches))
        return out

    @staticmethod
    def _extend(st: _Storage, ctx: list[int], first: int, k: int) -> list[int]:
        """``first`` then greedy predictions, k tokens at most (stopping at an unknown context)."""
        draft = [first]
        while len(draft) < k:
            ctx = (ctx + [draft[-1]])[-st.max_ctx:]
            nxt = st.predict(ctx)
            if nxt is None:
                break
            draft.append(nxt)
        return draft

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        st: _Storage = seq.drafter_state
        if self.top_k <= 0:
            return
        top = top_indices(target_logits, min(self.top_k, target_logits.shape[-1]))  # (n+1, k)
        weights = [self.filler_weight / (r + 1) for r in range(top.shape[1])]
        toks = seq.lookup_context
        off = len(toks) - len(seq.tokens)  # the source before the tokens (encoder-decoder), else 0
        for i in range(target_logits.shape[0]):  # row i: distribution after tokens[:n_before + i]
            end = off + n_before + i
            st.fill(toks[max(0, end - st.max_ctx):end], top[i].tolist(), weights)
        st.observe(toks)


register(Method("nasd", lambda dw, rows, capacity, **opts: NASDDrafter(**opts),
                help="n-gram tables built from the request's own tokens", seq2seq=True, auto_child=True,
                tree_variant=True))
