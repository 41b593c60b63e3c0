"""Prompt lookup decoding: find the latest earlier occurrence of the last n tokens in prompt + output
and propose the tokens that followed it (n from ``max_ngram`` down to ``min_ngram``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sequence import Sequence
from .base import Draft, StatelessDrafter


@dataclass
class _Index:
    # per n: n-gram -> position just after its latest occurrence that is not the sequence's suffix
    last: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    upto: int = 0  # n-grams ending before this position are indexed


class PromptLookupDrafter(StatelessDrafter):
    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, seq: Sequence) -> None:
        seq.drafter_state = _Index({n: {} for n in range(self.min_ngram, self.max_ngram + 1)})

    def _index(self, idx: _Index, toks: list[int]) -> None:
        end = len(toks) - 1  # index n-grams ending at positions < end (not the suffix itself)
        for e in range(idx.upto + 1, end + 1):  # n-gram toks[e-n:e], followed by toks[e]
            for n, table in idx.last.items():
                if e >= n:
                    table[tuple(toks[e - n:e])] = e
        idx.upto = max(idx.upto, end)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        out = []
        for s, k in zip(seqs, ks):
            draft: list[int] = []
            if k > 0:
                toks = s.tokens
                self._index(s.drafter_state, toks)
                for n in range(self.max_ngram, self.min_ngram - 1, -1):
                    if len(toks) < n:
                        continue
                    pos = s.drafter_state.last[n].get(tuple(toks[-n:]))
                    if pos is not None:
                        # copy what followed; past the end keep copying from the draft itself, so a
                        # repeating pattern whose latest match is recent still yields k tokens
                        ext = toks[pos:]
                        while len(draft) < k:
                            draft.append(ext[len(draft)] if len(draft) < len(ext) else draft[len(draft) - len(ext)])
                        break
            out.append(Draft(draft))
        return out
