"""Adapter: any HF ``AutoModelForSeq2SeqLM`` (T5, BART, Marian, ...) behind the draftwise model protocol.

The decode loop sees the decoder only: ``forward`` takes new *decoder* tokens, exactly as ``HFCausalLM``
does. The source is encoded once per sequence (``encode``, called by ``Decoder.add`` and by a draft model's
``start``); its output and attention mask live in the cache beside a transformers ``EncoderDecoderCache``
(decoder self-attention + cross-attention keys/values). Rolling back is ``HFCache``'s pointer: the
self-attention cache is cropped lazily at the next forward; the cross-attention cache and the encoder
output depend on the source only and are never recomputed.

The decoder's "prompt" is ``decoder_prompt``: the decoder start token, plus the generation config's
forced first token (mBART's language code, BART's ``<s>``) when it has one. Tokens the generation config
bans outright (``bad_words_ids`` of one token, Marian's pad) get logit -inf, as ``generate`` does. Other
processors of a generation config (``forced_eos_token_id`` at the length limit, ``no_repeat_ngram_size``,
``min_length``, repetition penalties) are not applied: the output is the model's own distribution.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import InvalidParameterError, PromptTooLongError
from ..kernels import parallel_torch
from .base import LogitsFor, ModelConfig, ModelOutput
from .hf_common import HFCache, begin_forward, select_positions


class Seq2SeqCache(HFCache):
    """``HFCache`` (pointer-style length, lazy crop) over an ``EncoderDecoderCache``, plus the encoded
    source of the sequence in it (one sequence at a time, or beams of one source)."""

    def __init__(self, capacity: int, rows: int = 1):
        super().__init__(capacity, rows)
        self.hf = _empty_cache()
        self.encoder_out: torch.Tensor | None = None  # (rows, S, D) encoder's last hidden state
        self.encoder_mask: torch.Tensor | None = None  # (rows, S) int64, 1 = source token

    def set_source(self, encoder_out: torch.Tensor, encoder_mask: torch.Tensor) -> None:
        """A new source: its encoding, and an empty decoder cache (cross-attention is computed from it)."""
        self.encoder_out, self.encoder_mask = encoder_out, encoder_mask
        self.hf = _empty_cache()
        self.set_lengths(0)

    def reorder_rows(self, index: torch.Tensor | list[int], start: int = 0) -> None:
        super().reorder_rows(index, start)
        if self.encoder_out is not None:
            index = torch.as_tensor(index, dtype=torch.long)
            self.encoder_out, self.encoder_mask = self.encoder_out[index], self.encoder_mask[index]


def _empty_cache():
    from transformers import DynamicCache, EncoderDecoderCache

    return EncoderDecoderCache(DynamicCache(), DynamicCache())


class HFSeq2SeqLM:
    """The decoder of an encoder-decoder model as a ``CausalLM``, plus ``encode(cache, source_ids)``."""

    is_encoder_decoder = True

    def __init__(self, model, config: ModelConfig, max_source: int):
        self.hf = model.eval()
        self.config = config  # max_context: the decoder's positions
        self.max_source = max_source  # source tokens the encoder takes at most
        self.dtype = next(model.parameters()).dtype
        gen, cfg = model.generation_config, model.config
        start = _first(*(getattr(c, "decoder_start_token_id", None) for c in (gen, cfg)),
                       *(getattr(c, "bos_token_id", None) for c in (gen, cfg)))
        if start is None:
            raise InvalidParameterError("this encoder-decoder model's config names no decoder_start_token_id")
        forced = _first(*(getattr(c, "forced_bos_token_id", None) for c in (gen, cfg)))
        self.decoder_prompt: list[int] = [start] + ([forced] if forced is not None else [])
        eos = _first(*(getattr(c, "eos_token_id", None) for c in (gen, cfg)))
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        bad = getattr(gen, "bad_words_ids", None) or []
        self.banned = sorted({w[0] for w in bad if len(w) == 1})  # token ids whose logit is -inf
        # transformers 5 names the decoder cache argument ``cache``, 4.x ``past_key_values``
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def new_cache(self, rows: int = 1, capacity: int | None = None) -> Seq2SeqCache:
        return Seq2SeqCache(capacity or self.config.max_context, rows)

    def check_source(self, source_ids: list[int] | None) -> None:
        if source_ids is None:
            raise InvalidParameterError("an encoder-decoder model decodes from a source: give its tokens "
                                        "(Sequence.encoder_ids)")
        if len(source_ids) == 0:
            raise InvalidParameterError("empty source: give at least one token")
        if len(source_ids) > self.max_source:
            raise PromptTooLongError(f"source is {len(source_ids)} tokens; the encoder takes at most "
                                     f"{self.max_source}")

    @torch.inference_mode()
    def encode(self, cache: Seq2SeqCache, source_ids: list[int]) -> None:
        """Run the encoder once over the source; every row of ``cache`` decodes from it."""
        self.check_source(source_ids)
        x = torch.tensor([source_ids]).expand(cache.rows, -1)  # (rows, S)
        mask = torch.ones_like(x)  # (rows, S)
        with parallel_torch():  # transformers' GEMMs: torch's threads even inside the decode loop's serial_torch
            out = self.hf.get_encoder()(input_ids=x, attention_mask=mask)
        cache.set_source(out.last_hidden_state, mask)  # (rows, S, D), (rows, S)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: Seq2SeqCache, *, positions: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None, logits_for: LogitsFor = "all") -> ModelOutput:
        if cache.encoder_out is None:
            raise InvalidParameterError("encode the source first (HFSeq2SeqLM.encode)")
        B, T = input_ids.shape  # new decoder tokens
        start = begin_forward(cache, B, attn_mask)
        if positions is not None and not bool((positions == start + torch.arange(T)).all()):
            raise InvalidParameterError("an encoder-decoder decoder takes its positions from the cache")
        from transformers.modeling_outputs import BaseModelOutput

        with parallel_torch():
            out = self.hf(encoder_outputs=BaseModelOutput(last_hidden_state=cache.encoder_out[:B]),
                          attention_mask=cache.encoder_mask[:B], decoder_input_ids=input_ids,
                          use_cache=True, output_hidden_states=True, **{self._cache_arg: cache.hf})
        cache.lengths[:B] = start + T
        picked = select_positions(out.logits.float(), out.decoder_hidden_states[-1], logits_for)  # (B, T', V/D)
        if self.banned:
            picked.logits[..., self.banned] = float("-inf")
        return picked


def _first(*values):
    return next((v for v in values if v is not None), None)
