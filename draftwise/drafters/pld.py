"""Prompt lookup decoding: find the latest earlier occurrence of the last n tokens in prompt + output
(an encoder-decoder target: source + output, ``Sequence.lookup_context``) and propose the tokens that
followed it (n from ``max_ngram`` down to ``min_ngram``).

With ``branches`` > 1 it proposes a token tree: the continuations of up to ``branches`` different earlier
occurrences (longest n first, latest first), merged where they share a prefix (a trie)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from ..sequence import Sequence
from .base import Draft, StatelessDrafter, trie
from .registry import Method, register


@dataclass
class NgramIndex:
    # per n: n-gram -> positions just after its latest occurrences (latest last, at most ``keep``) that
    # are not the sequence's suffix
    last: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)
    upto: int = 0  # n-grams ending before this position are indexed
    keep: int = 1

    def update(self, toks: list[int]) -> None:
        """Index the n-grams of ``toks`` (a sequence that only grows) not indexed yet: those ending before its
        last position, each followed by a token."""
        end = len(toks) - 1  # index n-grams ending at positions < end (not the suffix itself)
        for e in range(self.upto + 1, end + 1):  # n-gram toks[e-n:e], followed by toks[e]
            for n, table in self.last.items():
                if e >= n:
                    seen = table.setdefault(tuple(toks[e - n:e]), [])
                    seen.append(e)
                    if len(seen) > self.keep:
                        del seen[0]
        self.upto = max(self.upto, end)


class PromptLookupDrafter(StatelessDrafter):
    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidParameterError("need 1 <= min_ngram <= max_ngram")
        if not isinstance(branches, int) or branches < 1:
            raise InvalidParameterError(f"branches must be an integer >= 1, got {branches!r}")
        self.max_ngram, self.min_ngram, self.branches = max_ngram, min_ngram, branches

    def start(self, seq: Sequence, *, hidden: torch.Tensor | None = None) -> None:
        seq.drafter_state = NgramIndex({n: {} for n in range(self.min_ngram, self.max_ngram + 1)}, keep=self.branches)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        out = []
        for s, k in zip(seqs, ks):
            if k <= 0:
                out.append(Draft([]))
                continue
            toks = s.lookup_context
            s.drafter_state.update(toks)
            starts: list[int] = []  # where candidate continuations start, best first
            for n in range(self.max_ngram, self.min_ngram - 1, -1):
                if len(toks) >= n:
                    for pos in reversed(s.drafter_state.last[n].get(tuple(toks[-n:]), [])):
                        if pos not in starts:
                            starts.append(pos)
                if len(starts) >= self.branches:
                    break
            out.append(trie([_continuation(toks, pos, k) for pos in starts[:self.branches]]))
        return out


def _continuation(toks: list[int], pos: int, k: int) -> list[int]:
    """k tokens copied from ``pos``; past the end keep copying from the draft itself, so a repeating
    pattern whose latest match is recent still yields k tokens."""
    ext, draft = toks[pos:], []
    while len(draft) < k:
        draft.append(ext[len(draft)] if len(draft) < len(ext) else draft[len(draft) - len(ext)])
    return draft


register(Method("pld", lambda dw, rows, capacity, **opts: PromptLookupDrafter(**opts),
                help="prompt lookup: continuations of n-grams found in the prompt and output", seq2seq=True,
                auto_child=True, tree_variant=True))
