"""SuffixDecoding (Oliaro et al. 2024): draft a token tree from what followed earlier occurrences of the
context's suffix, in this request (prompt + output so far) and in earlier requests of the process.

Two token stores, searched alike:

- per request: the sequence's own tokens (``_Local``, on ``seq.drafter_state``), grown as it decodes;
- global: ``SuffixCache``, earlier requests' prompts and outputs, added when a request leaves the batch
  (``release``) and shared by every suffix drafter of one ``SpeculativeDecoder`` (chat turns, bench
  prompts, server requests). Bounded: it holds at most ``max_tokens`` tokens, evicting whole oldest
  requests.

Structure: each store is one flat int32 array, sequences separated by ``SEP`` (no suffix tree). For the
last ``max_match`` tokens of the context, ``_occurrences`` finds every earlier position where the suffix
of length m ends, for m = 1, 2, ... (each set filters the previous one with one vectorised comparison, so
it costs a scan of the store plus a few small array ops). What followed the occurrences of a suffix is
exactly the subtree under that suffix's node in a suffix tree of the store: ``_grow`` walks it best-first
by path probability, the product of count(child) / count(parent) along the path, where counts are
occurrences whose continuation is known (a sequence's end, ``SEP``, is not evidence of anything).

A step (``propose``), per sequence: for each store and each distinct occurrence set (the longest m that
has it), grow a tree of at most min(``max_nodes``, ``alpha`` · m) nodes (the paper's max_spec = α ·
match length: a longer match earns a bigger draft), nodes with path probability >= ``min_prob`` only, no
deeper than the step's γ; keep the tree of the highest score (the sum of its nodes' probabilities: the
expected number of accepted tokens if the probabilities were right). The two stores' best trees are then
merged (a node's probability: the larger of the two) and the ``max_nodes`` most probable nodes proposed,
best first (ancestors first).

Lossless: the draft is deterministic (``probs=None``: q one-hot), a function of the sequence's tokens and
of earlier requests; the verifier decides every output token from the target's own distribution, so
nothing of another request can reach this one's output, only its speed.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidParameterError
from ..sequence import Sequence
from .base import Draft
from .registry import Method, register

SEP = -1  # between sequences in a store, and after a request's last token: never a token
MAX_NODES = 6  # default node budget: verifying T tokens costs ~T/2 passes on AVX2, so small trees
MAX_MATCH = 32  # longest context suffix matched
ALPHA = 1.0  # nodes <= alpha * match length
MIN_PROB = 0.1  # nodes below this path probability are not proposed
CACHE_TOKENS = 1 << 18  # tokens the global cache holds by default (1 MiB of int32)
MAX_OCCURRENCES = 256  # most recent occurrences a tree is grown from (bounds a step's cost)


class SuffixCache:
    """Earlier requests' token sequences, one int32 array ``[SEP, seq, SEP, seq, SEP, ...]``, at most
    ``max_tokens`` tokens: adding a sequence evicts whole oldest ones (a sequence longer than the cache
    keeps its last ``max_tokens`` tokens).

    Thread-safe: writers take a lock and publish a new array; readers take ``buffer`` (a snapshot that
    is never written to), so a server thread and a library caller can share one cache.
    """

    def __init__(self, max_tokens: int = CACHE_TOKENS):
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidParameterError(f"suffix cache size must be an integer >= 0 tokens, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self._buf = np.full(1, SEP, dtype=np.int32)  # (1 + Σ (len + 1),)
        self._lens: deque[int] = deque()  # tokens of each held sequence, oldest first
        self._lock = threading.Lock()
        self._pending: list[list[int]] | None = None  # additions held back by ``deferred``

    @contextmanager
    def deferred(self):
        """Hold additions back until the block ends, then add each distinct sequence once. ``bench`` runs
        every method on one prompt inside this, so no method drafts from another method's output of the
        same prompt (only earlier prompts' outputs are in the cache, as in a server)."""
        self._pending = []
        try:
            yield self
        finally:
            pending, self._pending = self._pending, None
            seen: set[tuple[int, ...]] = set()
            for tokens in pending:
                if tuple(tokens) not in seen:
                    seen.add(tuple(tokens))
                    self.add(tokens)

    @property
    def buffer(self) -> np.ndarray:
        return self._buf

    def __len__(self) -> int:
        """Tokens held (separators not counted)."""
        return len(self._buf) - 1 - len(self._lens)

    @property
    def sequences(self) -> int:
        return len(self._lens)

    @property
    def nbytes(self) -> int:
        return self._buf.nbytes

    def add(self, tokens: list[int]) -> None:
        if self._pending is not None:
            self._pending.append(list(tokens))
            return
        tokens = tokens[len(tokens) - self.max_tokens:] if len(tokens) > self.max_tokens else tokens
        if not tokens:
            return
        with self._lock:
            held, drop = len(self), 0
            while self._lens and held + len(tokens) > self.max_tokens:
                n = self._lens.popleft()
                held -= n
                drop += n + 1
            self._lens.append(len(tokens))
            self._buf = np.concatenate([self._buf[drop:], np.asarray(tokens, dtype=np.int32),
                                        np.full(1, SEP, dtype=np.int32)])

    def clear(self) -> None:
        with self._lock:
            self._lens.clear()
            self._buf = np.full(1, SEP, dtype=np.int32)


class _Local:
    """A sequence's own tokens as a store: ``buf[1..n]`` = tokens, ``buf[0]`` and ``buf[n+1]`` = SEP."""

    def __init__(self, capacity: int):
        self.buf = np.full(capacity + 2, SEP, dtype=np.int32)  # (capacity + 2,)
        self.n = 0

    def sync(self, tokens: list[int]) -> None:
        new = tokens[self.n:]
        if not new:
            return
        end = self.n + len(new)
        if end + 2 > len(self.buf):
            grown = np.full(max(end + 2, 2 * len(self.buf)), SEP, dtype=np.int32)
            grown[:self.n + 1] = self.buf[:self.n + 1]
            self.buf = grown
        self.buf[self.n + 1:end + 1] = new
        self.buf[end + 1] = SEP
        self.n = end


def _occurrences(buf: np.ndarray, limit: int, rev: np.ndarray) -> list[np.ndarray]:
    """sets[m-1]: the positions p < limit where ``buf[p-m+1..p]`` equals the context's last m tokens
    (``rev`` is the context reversed, newest first), for m = 1, 2, ... while any remain. ``buf[0]`` is
    SEP, so a match never runs off the front."""
    ends = np.flatnonzero(buf[:limit] == rev[0])
    sets = []
    j = 0
    while ends.size:
        sets.append(ends)
        j += 1
        if j == len(rev):
            break
        ends = ends[buf[ends - j] == rev[j]]
    return sets


@dataclass
class _Tree:
    paths: list[tuple[int, ...]]  # each node's tokens from the root, best first (ancestors first)
    probs: list[float]  # each node's path probability

    @property
    def score(self) -> float:
        return sum(self.probs)


def _grow(buf: np.ndarray, ends: np.ndarray, budget: int, depth: int, min_prob: float) -> _Tree:
    """Best-first tree over what followed ``ends`` (positions of the matched suffix's last token): up to
    ``budget`` nodes, at most ``depth`` deep, path probability >= ``min_prob``."""
    paths: list[tuple[int, ...]] = []
    probs: list[float] = []
    heap: list[tuple[float, int, tuple[int, ...], np.ndarray]] = []  # (-prob, tiebreak, path, positions)
    tiebreak = itertools.count()  # equal probabilities: the earlier pushed (shallower) first

    def expand(path: tuple[int, ...], prob: float, pos: np.ndarray) -> None:
        if len(path) >= depth:
            return
        nxt = buf[pos + 1]
        known = nxt != SEP
        nxt, pos = nxt[known], pos[known] + 1
        if not nxt.size:
            return
        toks, counts = np.unique(nxt, return_counts=True)
        floor = min_prob / prob * nxt.size  # children below this count fall under min_prob
        for t, c in zip(toks.tolist(), counts.tolist()):
            if c >= floor:
                heapq.heappush(heap, (-prob * c / nxt.size, next(tiebreak), path + (t,),
                                      pos[nxt == t]))

    expand((), 1.0, ends)
    while heap and len(paths) < budget:
        negp, _, path, pos = heapq.heappop(heap)
        paths.append(path)
        probs.append(-negp)
        expand(path, -negp, pos)
    return _Tree(paths, probs)


def _best_tree(buf: np.ndarray, limit: int, rev: np.ndarray, max_nodes: int, alpha: float, depth: int,
               min_prob: float) -> _Tree:
    """The highest-scoring tree over the occurrence sets of the context's suffixes in one store."""
    sets = _occurrences(buf, limit, rev)
    best = _Tree([], [])
    for m in range(len(sets), 0, -1):
        if m < len(sets) and len(sets[m - 1]) == len(sets[m]):
            continue  # the same occurrences as the longer match, which earned a bigger budget
        budget = min(max_nodes, int(alpha * m + 1e-9))
        if budget < 1:
            break
        tree = _grow(buf, sets[m - 1][-MAX_OCCURRENCES:], budget, depth, min_prob)
        if tree.score > best.score:
            best = tree
    return best


def _merge(trees: list[_Tree], max_nodes: int) -> Draft:
    """One draft from several trees: a node's probability is its best in any tree; the ``max_nodes``
    most probable nodes, best first (a child is never more probable than its parent, and ties put the
    shallower first, so ancestors come first)."""
    prob: dict[tuple[int, ...], float] = {}
    for t in trees:
        for path, p in zip(t.paths, t.probs):
            if p > prob.get(path, 0.0):
                prob[path] = p
    order = sorted(prob, key=lambda path: (-prob[path], len(path)))[:max_nodes]
    index: dict[tuple[int, ...], int] = {}
    tokens, parents = [], []
    for path in order:
        parent = index.get(path[:-1], -1) if len(path) > 1 else -1
        if len(path) > 1 and parent < 0:
            continue  # its parent fell out (cannot happen with consistent probabilities; kept safe)
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(parent)
    return Draft(tokens, parents=parents)


class SuffixDrafter:
    """``--method suffix``. ``cache``: the global ``SuffixCache`` this drafter reads and adds finished
    requests to (None: per-request only). Options: ``max_nodes`` (node budget of a step's tree, the CLI's
    ``--tree-width``), ``max_match``, ``alpha``, ``min_prob`` (see the module docstring)."""

    name = "suffix"

    def __init__(self, cache: SuffixCache | None = None, *, max_nodes: int = MAX_NODES, max_match: int = MAX_MATCH,
                 alpha: float = ALPHA, min_prob: float = MIN_PROB):
        for what, v, lo in (("max_nodes", max_nodes, 1), ("max_match", max_match, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidParameterError(f"suffix {what} must be an integer >= {lo}, got {v!r}")
        if not isinstance(alpha, (int, float)) or not alpha > 0:
            raise InvalidParameterError(f"suffix alpha must be > 0, got {alpha!r}")
        if not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob <= 1.0:
            raise InvalidParameterError(f"suffix min_prob must be in [0, 1], got {min_prob!r}")
        self.cache = cache
        self.max_nodes, self.max_match, self.alpha, self.min_prob = max_nodes, max_match, float(alpha), float(min_prob)

    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        local = _Local(seq.prompt_len + seq.params.max_tokens + 1)
        local.sync(seq.tokens)
        seq.drafter_state = local

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        out = []
        shared = self.cache.buffer if self.cache is not None else None  # one snapshot for the step
        for s, k in zip(seqs, ks):
            local: _Local = s.drafter_state
            local.sync(s.tokens)
            if k <= 0:
                out.append(Draft([]))
                continue
            rev = np.asarray(s.tokens[:-self.max_match - 1:-1], dtype=np.int32)  # (<= max_match,) newest first
            args = (rev, self.max_nodes, self.alpha, k, self.min_prob)
            trees = [_best_tree(local.buf, local.n, *args)]  # local.n: the context's own end is no match
            if shared is not None and len(shared) > 1:
                trees.append(_best_tree(shared, len(shared), *args))
            out.append(_merge(trees, self.max_nodes))
        return out

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor, *,
               path: list[int] | None = None, hidden: torch.Tensor | None = None) -> None:
        pass  # the sequence's tokens are read at the next propose

    def release(self, seq: Sequence) -> None:
        """A request left: its prompt and output join the global cache (not a failed one's)."""
        if self.cache is not None and isinstance(seq.drafter_state, _Local) and seq.error is None:
            self.cache.add(seq.tokens)

    def move_row(self, src: int, dst: int) -> None:
        pass


def _build(dw, rows: int, capacity: int, share: bool = True, **opts) -> SuffixDrafter:
    """Option share=False: this request's own tokens only (else also earlier requests', ``dw.suffix_cache``)."""
    return SuffixDrafter(dw.suffix_cache if share else None, **opts)


register(Method("suffix", _build, help="SuffixDecoding: trees from this request and earlier ones",
                auto_child=True, width_option="max_nodes"))
