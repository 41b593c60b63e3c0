"""Adapter: any HF ``AutoModelForCausalLM`` behind the draftwise model protocol.

The HF ``DynamicCache`` is wrapped in an object with the same pointer semantics as ``KVCache``:
``set_lengths`` only moves the pointer; the HF cache is cropped lazily at the next forward.
One sequence at a time (rows=1), or beams of one length (rows=N, beam search: ``reorder_rows`` forks
them with ``DynamicCache.reorder_cache``): batching ragged sequences is the native backend's job.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidParameterError, ModelNotFoundError
from .base import LogitsFor, ModelConfig, ModelOutput


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


class HFCausalLM:
    def __init__(self, model, config: ModelConfig):
        self.hf = model.eval()
        self.config = config
        self.dtype = next(model.parameters()).dtype

    def new_cache(self, rows: int = 1, capacity: int | None = None) -> HFCache:
        return HFCache(capacity or self.config.max_context, rows)  # rows > 1: beams of one length only

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: HFCache, *, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, logits_for: LogitsFor = "all") -> ModelOutput:
        B, T = input_ids.shape
        start = begin_forward(cache, B, attn_mask)
        if positions is None:
            positions = start + torch.arange(T)[None].expand(B, T)
        last = isinstance(logits_for, str) and logits_for == "last"
        out = self.hf(input_ids=input_ids, past_key_values=cache.hf, position_ids=positions, use_cache=True,
                      output_hidden_states=True, logits_to_keep=1 if last else 0)
        cache.lengths[:B] = start + T
        return select_positions(out.logits.float(), out.hidden_states[-1], logits_for)


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


def load_hf(src: Path | str, dtype: torch.dtype):
    """Load with transformers from a folder, a hub id, or a GGUF file (de-quantized by transformers).
    A config with ``is_encoder_decoder`` (T5, BART, Marian, ...) loads as ``HFSeq2SeqLM`` (models/seq2seq.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    kw: dict = {}
    if isinstance(src, Path) and src.is_file():
        kw = {"gguf_file": src.name}
        src = src.parent
    try:
        seq2seq = bool(getattr(AutoConfig.from_pretrained(str(src), **kw), "is_encoder_decoder", False))
        tok = AutoTokenizer.from_pretrained(str(src), **kw)
        auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
        model = auto.from_pretrained(str(src), dtype=dtype, **kw)
    except OSError as e:
        raise ModelNotFoundError(f"transformers could not load {src}: {str(e).splitlines()[0]}") from None
    c = model.config
    heads = getattr(c, "num_attention_heads", 1)
    positions = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None) or 2048
    cfg = ModelConfig(
        arch="hf", vocab_size=model.get_output_embeddings().weight.shape[0],
        hidden_size=getattr(c, "hidden_size", 0), intermediate_size=getattr(c, "intermediate_size", 0),
        num_layers=getattr(c, "num_hidden_layers", 0), num_heads=heads,
        num_kv_heads=getattr(c, "num_key_value_heads", heads) or heads,
        head_dim=getattr(c, "head_dim", None) or getattr(c, "hidden_size", 0) // max(heads, 1),
        rope_theta=0.0, rms_eps=0.0, max_context=positions)
    if seq2seq:
        from .seq2seq import HFSeq2SeqLM

        return HFSeq2SeqLM(model, cfg, max_source=positions), tok
    return HFCausalLM(model, cfg), tok
