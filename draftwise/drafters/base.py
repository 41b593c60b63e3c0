"""The drafter protocol. The decode loop drives every drafting method through these four methods and
knows nothing else about them.

- ``start(seq)``: a sequence was prefilled; set up its per-sequence state (``seq.drafter_state``).
- ``propose(seqs, ks)``: up to ``ks[i]`` draft tokens for each sequence (fewer is fine, 0 is fine).
- ``accept(seq, n_before, num_accepted, target_logits)``: the sequence grew from ``n_before`` tokens by
  ``num_accepted`` accepted drafts plus one target token; ``target_logits`` (num_accepted+1, V) are the
  target's scores at the verified positions. Roll back / update the state here.
- ``release(seq)``: the sequence left the batch.
- ``move_row(src, dst)``: the engine compacted its batch; per-row resources follow (cache rows).

Per-sequence state lives on the sequence (``seq.drafter_state``), shared resources (a draft model) on the
drafter, so a sequence can be forked per branch without touching the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sequence import Sequence


@dataclass
class Draft:
    tokens: list[int]  # proposed tokens, in order
    probs: torch.Tensor | None = None  # (len(tokens), V) draft distribution q; None = deterministic


class Drafter(Protocol):
    name: str

    def start(self, seq: Sequence) -> None: ...

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]: ...

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor) -> None: ...

    def release(self, seq: Sequence) -> None: ...

    def move_row(self, src: int, dst: int) -> None: ...


class StatelessDrafter:
    """Convenience base for drafters without per-sequence resources."""

    name = "base"

    def start(self, seq: Sequence) -> None:
        pass

    def accept(self, seq: Sequence, n_before: int, num_accepted: int, target_logits: torch.Tensor) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def move_row(self, src: int, dst: int) -> None:
        pass
