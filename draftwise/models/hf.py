"""Adapter: any HF ``AutoModelForCausalLM`` behind the draftwise model protocol.

The HF cache wrapper and the checks shared with the encoder-decoder adapter are in hf_common.py (so
seq2seq.py does not import this module, which loads it). One sequence at a time, or beams of one length:
batching ragged sequences is the native backend's job.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelNotFoundError
from ..kernels import parallel_torch
from .base import LogitsFor, ModelConfig, ModelOutput
from .hf_common import HFCache, begin_forward, select_positions
from .seq2seq import HFSeq2SeqLM


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
        with parallel_torch():  # transformers' GEMMs: torch's threads even inside the decode loop's serial_torch
            out = self.hf(input_ids=input_ids, past_key_values=cache.hf, position_ids=positions, use_cache=True,
                          output_hidden_states=True, logits_to_keep=1 if last else 0)
        cache.lengths[:B] = start + T
        return select_positions(out.logits.float(), out.hidden_states[-1], logits_for)


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
        return HFSeq2SeqLM(model, cfg, max_source=positions), tok
    return HFCausalLM(model, cfg), tok
