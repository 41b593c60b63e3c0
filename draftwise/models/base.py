"""The model protocol every backend implements, and the KV cache it reads and writes.

A backend is a plain module with an explicit cache::

    out = model.forward(input_ids, cache, attn_mask=None, logits_for="all")

``input_ids`` (B, T) are *new* tokens of B sequences. Sequence b's tokens are written to its cache row
at slots ``cache.lengths[b] + t`` and attend to everything before them plus, among the new tokens,
what ``attn_mask`` (B, T, T) allows (default: causal). RoPE positions default to the slots; a token
tree passes its own (depth-based) ``positions``. After the call the cache holds the new tokens
(``lengths += T``). Rolling back a rejection is ``cache.set_lengths(...)``: entries past the valid
length are never read again and are overwritten by the next forward. No tensor surgery.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

# The most tokens one verifying forward feeds a row (a token tree: the root plus its nodes): within the forwards
# that run the row-by-row attention keeping every token's scores the same bits whatever was fed beside it
# (models/transformer.py EXACT_MAX_T, which prompt chunks use up to its end), so a tree's output equals the
# chain's. The decode loop cuts drafts to it, and drafters that size their own trees (lookahead, auto) stay within it.
MAX_TREE_TOKENS = 32


@dataclass
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "hf"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_context: int
    qkv_bias: bool = False
    tie_embeddings: bool = False

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, T', V) float32, T' = T, or 1 (logits_for="last" or per-row positions)
    hidden: torch.Tensor  # (B, T', D) final hidden states (after the last norm), same positions
    # (B, T, len(taps), D) the residual stream after the decoder layers named by forward(taps=...), at
    # every position (EAGLE-3's low- and mid-level features for a draft head); None when none were asked
    taps: torch.Tensor | None = None


# or (B,) int64: one position per row; "none": no logits (B, 0, V) — a prefill chunk before the prompt's last
# (native backend: prefix.prefill)
LogitsFor = Literal["all", "last", "none"] | torch.Tensor


def _reserved(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised tensor whose pages the OS commits as they are first written: on the CPU, its own
    anonymous mapping (unmapped when the tensor goes). ``torch.empty`` gives that only while the allocator
    maps large requests afresh; glibc serves them from its heap, pages already resident, once earlier frees
    have raised its mmap threshold (up to 32 MB), as a long-running process's history does."""
    n = math.prod(shape)
    if torch.device(device).type != "cpu" or n == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, n * torch.empty(0, dtype=dtype).element_size())
    return torch.frombuffer(buf, dtype=dtype, count=n).view(shape)  # the tensor holds the mapping


class KVCache:
    """Preallocated key/value cache; a row per sequence slot, the valid length of a row is a pointer.

    k, v: (layers, rows, kv_heads, capacity, head_dim)
    lengths: (rows,) int64 — valid entries per row
    """

    def __init__(self, num_layers: int, rows: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, rows, num_kv_heads, capacity, head_dim)
        # reserved memory the OS commits page by page as positions are first written, so a 64-token answer
        # in a 4k-token row costs what it uses (entries past a row's length are never read)
        self.k = _reserved(shape, dtype, device)
        self.v = _reserved(shape, dtype, device)
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self.capacity = capacity

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def length(self, row: int = 0) -> int:
        return int(self.lengths[row])

    def set_lengths(self, lengths: torch.Tensor | list[int] | int, rows: slice | None = None) -> None:
        """Roll back (or forward, over entries already written) — the only way lengths change besides
        a forward pass."""
        target = self.lengths if rows is None else self.lengths[rows]
        new = torch.as_tensor(lengths, dtype=torch.long).expand_as(target)
        if bool((new < 0).any()) or bool((new > self.capacity).any()):
            raise ValueError(f"cache lengths {new.tolist()} outside [0, {self.capacity}]")
        target.copy_(new)

    def reset(self, row: int | None = None) -> None:
        if row is None:
            self.lengths.zero_()
        else:
            self.lengths[row] = 0

    def view(self, rows: slice) -> "KVCache":
        """A cache over a subset of rows sharing this one's storage (writes and lengths go through)."""
        sub = KVCache.__new__(KVCache)
        sub.k, sub.v, sub.lengths, sub.capacity = self.k[:, rows], self.v[:, rows], self.lengths[rows], self.capacity
        return sub

    def move_row(self, src: int, dst: int) -> None:
        """Copy row src's valid entries to row dst (batch compaction when a sequence leaves)."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n

    def keep_path(self, row: int, start: int, nodes: list[int]) -> None:
        """After a token tree was verified in row ``row`` from slot ``start``: move the entries of the
        accepted nodes (offsets from ``start``, root first, increasing) to contiguous slots ``start, start+1,
        ...`` and set the row's length past them. A chain's accepted prefix is already in place."""
        n = len(nodes)
        if nodes != list(range(n)):
            src = torch.tensor(nodes) + start  # gathered first (a copy), so overlapping moves are safe
            self.k[:, row, :, start:start + n] = self.k[:, row, :, src]
            self.v[:, row, :, start:start + n] = self.v[:, row, :, src]
        self.lengths[row] = start + n

    def reorder_rows(self, index: torch.Tensor | list[int], start: int = 0) -> None:
        """Row i becomes a copy of row ``index[i]``, for rows 0..len(index)-1 (beam search: each surviving
        beam's parent; a parent chosen twice is forked). Only rows that change are copied, and only entries
        from ``start`` on: those before it are already the same in every row (the prompt, once forked)."""
        index = torch.as_tensor(index, dtype=torch.long)
        dst = torch.nonzero(index != torch.arange(len(index))).flatten()
        if len(dst) == 0:
            return
        src = index[dst]
        n = int(self.lengths[src].max())
        if n > start:  # gathered first (a copy), then written: a source row may also be a destination
            self.k[:, dst, :, start:n] = self.k[:, src, :, start:n]
            self.v[:, dst, :, start:n] = self.v[:, src, :, start:n]
        self.lengths[dst] = self.lengths[src]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def release_rows(self, start: int, stop: int) -> int:
        """Give the memory of rows ``start..stop-1`` back to the OS (their lengths become 0): the OS
        committed their pages as positions were written, and keeps them committed after the sequence
        left unless told. The rows stay usable (the next write commits fresh pages). Returns the bytes
        released; 0 off Linux, on a non-CPU device, or for a layout whose rows are not contiguous."""
        from ..memory import release_pages

        if stop <= start:
            return 0
        self.lengths[start:stop] = 0
        released = 0
        for t in (self.k, self.v):
            if t.device.type != "cpu" or not t[0, 0].is_contiguous() or t.stride(1) != t[0, 0].numel():
                return 0
            per_layer = (stop - start) * t.stride(1) * t.element_size()  # rows start..stop-1 of one layer
            for layer in range(t.shape[0]):
                released += release_pages(t[layer, start].data_ptr(), per_layer)
        return released


class CausalLM(Protocol):
    """What the decode loop needs from a model backend."""

    config: ModelConfig
    dtype: torch.dtype

    def new_cache(self, rows: int = 1, capacity: int | None = None) -> KVCache | object: ...

    def forward(self, input_ids: torch.Tensor, cache, *, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, logits_for: LogitsFor = "all") -> ModelOutput: ...


def is_encoder_decoder(model) -> bool:
    """An encoder-decoder backend (models/seq2seq.py) says so (``is_encoder_decoder = True``) and also has
    ``encode(cache, source_ids)``, run once per sequence before the decoder prefill, and
    ``check_source(source_ids)``; ``forward`` is its decoder's."""
    return bool(getattr(model, "is_encoder_decoder", False))
