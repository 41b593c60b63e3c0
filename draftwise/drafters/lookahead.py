"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding"): no draft model. Each step feeds the target, in the one pass that also verifies, a 2-D Jacobi
window of guesses about the next ``window`` positions; the target's outputs there move the window one
Jacobi iteration on and yield n-grams for a pool, and up to ``guesses`` pooled n-grams that start with
the current token are verified.

The window (``_State.chain``, ``_State.cols``), offsets counted from the sequence's last token (offset 0,
the tree's root):

    chain    c_1 … c_{W-1}          guesses at offsets 1..W-1, a chain hanging from the root
    column i cols[i] = l_1 … l_{N-2}  guesses at offsets i+1 .. i+N-2, hanging from c_i (column 0: the root)

so column i with its base (c_i, or the root token for i = 0) is a trajectory of N-1 tokens. The target's
output o_i after the top of column i closes an n-gram (base, l_1, …, l_{N-2}, o_i) for the pool, and the
iteration moves every column up a level: c_i <- l_1, cols[i] <- (l_2, …, l_{N-2}, o_i) (N = 2: the chain
itself is iterated, c_i <- o_i — plain Jacobi decoding). The window always moves on by one position,
however many tokens the step emitted (the reference implementation's default, ``ALWAYS_FWD_ONE``): it is
a source of n-grams, not an aligned draft.

The whole step is one token tree (decode.py verifies trees): the attention pattern of the paper's
lookahead branch — a token sees the chain up to its column and the tokens above it in its column — is
exactly "a node sees its ancestors" for the tree above, and the verification branch (each pooled n-gram
sees the root and its own earlier tokens) is a trie of chains from the root. Branches are merged as a
trie over their token paths: a node's output depends only on its path, so two branches with the same
prefix share nodes, the tree's children are distinct tokens, and every node of the comb is an ordinary
draft node — accepting along the chain or a column is as legal as along a pooled n-gram (greedy: the
target's argmax; sampling: one-hot q, the multi-branch rejection sampler of verify.py). Sizes: the comb
is W(N-1)-1 nodes, the verification branch at most G(N-1).

The drafter asks the loop for the target's logits at every fed node (``Needs.all_logits``) and finds
each column's output by its path; a column the step did not feed (the loop asked for a shallower tree,
or cut it to the rows' room) keeps its tokens.

Pool: per first token, the continuations (N-1 tokens) seen latest, at most ``pool_size`` of them (least
recently seen dropped), each with the token seen before it; seeded with the prompt's n-grams, grown with
every emitted token's and with the window's. ``guesses`` of them are verified: those seen after the
text's token before the last too first, then the latest.

Sizes on a CPU: a step feeds up to (W+G)(N-1) tokens, and on a 2-core CPU every token fed costs (AVX2,
1.5B target: a pass over 2 tokens ~1.16x one, 4 tokens ~1.65x, 8 ~3.5x) where a GPU has them for free —
so the defaults are the smallest window that still makes n-gram trajectories (W=1, N=3, G=1: at most 4
tokens). The reference code's GPU sizes (windows and guess sets of tens of tokens, N up to 8) would not
fit a tree step here, nor pay.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from ..models.base import MAX_TREE_TOKENS
from ..sequence import Sequence
from .base import Draft, Needs, trie
from .registry import Method, register

WINDOW, NGRAM, GUESSES = 1, 3, 1  # defaults: the smallest window with n-gram trajectories (see above)
POOL_SIZE = 8  # continuations kept per first token
MAX_NODES = MAX_TREE_TOKENS - 1  # a tree step feeds the root and at most this many nodes


@dataclass
class _State:
    chain: list[int]  # (W-1,) guesses at offsets 1..W-1
    cols: list[list[int]]  # (W, N-2) column i: guesses at offsets i+1..i+N-2
    age: list[int]  # (W,) times each column was iterated (its n-gram is all the target's own from N-1 on)
    # first token -> {continuation (N-1 tokens): the token before the first (-1: unknown)}, latest last
    pool: dict[int, OrderedDict[tuple[int, ...], int]] = field(default_factory=dict)
    upto: int = 0  # n-grams of the text starting before this position are pooled


def parse_lookahead(spec: str) -> dict:
    """"W,N,G" (window, n-gram size, n-grams verified) -> drafter options; InvalidParameterError if bad."""
    parts = [p.strip() for p in str(spec).split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise InvalidParameterError(f"lookahead takes W,N,G (window, n-gram size, guesses), e.g. "
                                    f"{WINDOW},{NGRAM},{GUESSES}; got {spec!r}")
    w, n, g = (int(p) for p in parts)
    LookaheadDrafter(w, n, g)  # validates
    return {"window": w, "ngram": n, "guesses": g}


class LookaheadDrafter:
    """Lookahead decoding as a drafter: ``window`` W, ``ngram`` N (2..), ``guesses`` G n-grams verified."""

    name = "lookahead"
    needs = Needs(all_logits=True)  # accept() gets the target's logits at every fed node (``draft``, ``all_logits``)

    def __init__(self, window: int = WINDOW, ngram: int = NGRAM, guesses: int = GUESSES, *,
                 pool_size: int = POOL_SIZE, seed: int = 0):
        for name, v, lo in (("window", window, 1), ("ngram", ngram, 2), ("guesses", guesses, 0),
                            ("pool_size", pool_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidParameterError(f"lookahead {name} must be an integer >= {lo}, got {v!r}")
        fed = (window + guesses) * (ngram - 1)  # the root, W(N-1) - 1 window nodes, at most G(N-1) n-gram nodes
        if fed > MAX_NODES + 1:
            raise InvalidParameterError(f"lookahead W={window}, N={ngram}, G={guesses} feeds (W+G)(N-1) = {fed} "
                                        f"tokens per step; at most {MAX_NODES + 1} fit a tree step")
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.pool_size, self.seed = pool_size, seed

    # ---- protocol --------------------------------------------------------------------------------
    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        # the window starts as tokens drawn from the prompt (the reference implementation's choice); the
        # first N-1 iterations replace them with the target's own, and only then are columns pooled
        rng = random.Random(self.seed)
        draw = lambda n: [rng.choice(seq.prompt_ids) for _ in range(n)]  # noqa: E731
        st = _State(draw(self.window - 1), [draw(self.ngram - 2) for _ in range(self.window)], [0] * self.window)
        self._observe(st, seq.tokens)
        seq.drafter_state = st

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [self._tree(s, k) for s, k in zip(seqs, ks)]

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None, draft: Draft | None = None,
               all_logits: torch.Tensor | None = None) -> None:
        # all_logits: (1 + len(draft.tokens), V) the target's scores after the root and after each fed node
        st: _State = seq.drafter_state
        if draft is not None and all_logits is not None:
            self._iterate(st, seq.tokens[max(0, n_before - 2):n_before], draft, all_logits.argmax(-1).tolist())
        self._observe(st, seq.tokens)

    def release(self, seq: Sequence) -> None:
        pass

    def move_row(self, src: int, dst: int) -> None:
        pass

    # ---- the tree --------------------------------------------------------------------------------
    def column_path(self, st: _State, i: int) -> list[int]:
        """Tokens from the root down to the top of column i."""
        return st.chain[:i] + st.cols[i]

    def candidates(self, st: _State, last: int, before: int = -1) -> list[list[int]]:
        """The ``guesses`` pooled continuations of ``last``: those seen after ``before`` too first, each
        group latest first."""
        conts = st.pool.get(last)
        if not conts or not self.guesses:
            return []
        latest = list(reversed(conts.items()))
        ranked = [c for c, b in latest if b == before >= 0] + [c for c, b in latest if not b == before >= 0]
        return [list(c) for c in ranked[:self.guesses]]

    def _tree(self, seq: Sequence, k: int) -> Draft:
        """The pooled n-grams first (the loop tries siblings in order, and cuts a tree short from its end),
        then the window column by column; at most k deep (a column deeper than k is left out whole)."""
        if k <= 0:
            return Draft([])
        st: _State = seq.drafter_state
        self._observe(st, seq.tokens)
        columns = [p for p in (self.column_path(st, i) for i in range(self.window)) if 0 < len(p) <= k]
        before = seq.tokens[-2] if len(seq.tokens) > 1 else -1
        return trie([c[:k] for c in self.candidates(st, seq.tokens[-1], before)] + columns)

    def _iterate(self, st: _State, tail: list[int], draft: Draft, best: list[int]) -> None:
        """One Jacobi iteration of the window from the target's argmax after each fed node (``best``:
        (1 + nodes,) row 0 after the root), pooling the columns' n-grams. ``tail``: the text's last tokens
        before the step (the root last)."""
        paths: dict[tuple[int, ...], int] = {(): 0}  # node path -> row of best
        node_paths: list[tuple[int, ...]] = []
        for j, (t, q) in enumerate(zip(draft.tokens, draft.parents or range(-1, len(draft.tokens) - 1))):
            node_paths.append((node_paths[q] if q >= 0 else ()) + (t,))
            paths[node_paths[-1]] = j + 1
        chain = list(st.chain)
        line = [tail[-2] if len(tail) > 1 else -1] + tail[-1:] + st.chain  # tokens at offsets -1, 0 (root), 1..W-1
        for i in range(self.window):
            row = paths.get(tuple(self.column_path(st, i)))
            if row is None:  # not fed this step: the column waits
                continue
            ext = st.cols[i] + [best[row]]  # (N-1,) offsets i+1..i+N-1
            if st.age[i] >= self.ngram - 1:
                self._pool(st, line[i + 1], tuple(ext), line[i])  # base i at offset i
            if i > 0:
                chain[i - 1] = ext[0]
            st.cols[i] = ext[1:]
            st.age[i] += 1
        st.chain = chain

    # ---- the pool --------------------------------------------------------------------------------
    def _pool(self, st: _State, first: int, cont: tuple[int, ...], before: int = -1) -> None:
        conts = st.pool.setdefault(first, OrderedDict())
        conts[cont] = before
        conts.move_to_end(cont)
        if len(conts) > self.pool_size:
            conts.popitem(last=False)

    def _observe(self, st: _State, toks: list[int]) -> None:
        """Pool the n-grams of the text (prompt and emitted tokens) not pooled yet."""
        n = self.ngram
        for s in range(st.upto, len(toks) - n + 1):
            self._pool(st, toks[s], tuple(toks[s + 1:s + n]), toks[s - 1] if s > 0 else -1)
        st.upto = max(st.upto, len(toks) - n + 1)


def _options(width: int | None, heads: str | None, lookahead: str | None) -> dict:
    return parse_lookahead(lookahead) if lookahead is not None else {}  # --tree-width is not lookahead's


register(Method("lookahead", lambda dw, rows, capacity, **opts: LookaheadDrafter(**opts),
                help="Jacobi window + n-gram pool verified in the same pass", options=_options,
                own_gamma=MAX_TREE_TOKENS - 1))  # W, N, G size the tree; the window must be fed every step
