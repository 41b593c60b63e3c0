"""What both hf adapters share (hf.py's decoder-only ``HFCausalLM``, seq2seq.py's ``HFSeq2SeqLM``): the
HF ``DynamicCache`` behind ``KVCache``'s pointer semantics, the checks before a forward, and picking the
positions a caller asked logits for.

The cache wrapper has the same pointer semantics as ``KVCache``: ``set_lengths`` only moves the pointer;
the HF cache is cropped lazily at the next forward. One sequence at a time (rows=1), or beams of one
length (rows=N, beam search: ``reorder_rows`` forks them with ``DynamicCache.reorder_cache``).
"""

from __future__ import annotations

import torch

from ..errors import InvalidParameterError
from .base import LogitsFor, ModelOutput


class HFCache:
    def __init__(self, capacity: int, rows: int = 1):
        from transformers import DynamicCache

        self.hf = DynamicCache()
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self.capacity = capacity

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def length(self, row: int = 0) -> int:
        return int(self.lengths[0])

    def view(self, rows: slice) -> "HFCache":
        if rows.start not in (0, None) or (rows.stop is not None and rows.stop > 1 and rows.stop != self.rows):
            raise InvalidParameterError("the hf backend decodes one sequence at a time")
        return self

    def set_lengths(self, lengths, rows=None) -> None:
        n = int(torch.as_tensor(lengths).reshape(-1)[0])
        if not 0 <= n <= self.capacity:
            raise ValueError(f"cache length {n} outside [0, {self.capacity}]")
        self.lengths[:] = n  # every row (rows > 1: beams, all of one length)

    def keep_path(self, row: int, start: int, nodes: list[int]) -> None:
        """Chains only (the hf backend verifies no trees): the accepted prefix is in place."""
        if nodes != list(range(len(nodes))):
            raise InvalidParameterError("the hf backend verifies chains, not token trees")
        self.set_lengths(start + len(nodes))

    def reset(self, row: int | None = None) -> None:
        self.set_lengths(0)

    def move_row(self, src: int, dst: int) -> None:
        raise InvalidParameterError("the hf backend decodes one sequence at a time")

    def reorder_rows(self, index: torch.Tensor | list[int], start: int = 0) -> None:
        """Beams: row i becomes a copy of row ``index[i]`` (``KVCache.reorder_rows``). The DynamicCache
        gathers every entry of every row (``start``, the native cache's saving, does not apply)."""
        self.sync()
        index = torch.as_tensor(index, dtype=torch.long)
        self.hf.reorder_cache(index)
        self.lengths[:len(index)] = self.lengths[index].clone()

    def sync(self) -> None:
        """Apply a pending rollback to the HF cache."""
        n, cur = int(self.lengths[0]), self.hf.get_seq_length()
        if cur > n:
            self.hf.crop(n - cur)  # negative = drop that many (the form every transformers version takes)


def begin_forward(cache: HFCache, rows: int, attn_mask: torch.Tensor | None) -> int:
    """What every hf adapter checks before a forward: no tree mask, the pending rollback applied, the
    ``rows`` fed rows of one length (returned: the slot the new tokens start at)."""
    if attn_mask is not None:
        raise InvalidParameterError("the hf backend does not take custom (tree) attention masks")
    cache.sync()
    start = cache.length()
    if bool((cache.lengths[:rows] != start).any()):
        raise InvalidParameterError("the hf backend batches rows of one length only (beams)")
    return start


def select_positions(logits: torch.Tensor, hidden: torch.Tensor, logits_for: LogitsFor) -> ModelOutput:
    """(B, T, V) logits and (B, T, D) hidden states → the positions ``logits_for`` asks for (all; the last;
    or one per row). Positions already cut to the last one (``logits_to_keep=1``) stay as they are."""
    if isinstance(logits_for, torch.Tensor):
        rows = torch.arange(logits.shape[0])
        logits, hidden = logits[rows, logits_for].unsqueeze(1), hidden[rows, logits_for].unsqueeze(1)
    elif logits_for == "last":
        logits, hidden = logits[:, -1:], hidden[:, -1:]
    return ModelOutput(logits=logits, hidden=hidden)
