"""Peers: HF transformers ``generate`` on the same model files, dtype, prompt ids, EOS set and budget.

- ``hf-ar``: plain greedy ``generate``.
- ``hf-assisted``: ``generate(assistant_model=draft)``; with an integer γ the assistant drafts exactly γ
  tokens per step (constant schedule, HF's confidence early-exit off), i.e. what the native ``draft`` does.
  With a non-integer γ (an adaptive policy) HF keeps its own defaults (20 tokens, confidence exit).
- ``hf-pld``: ``generate(prompt_lookup_num_tokens=γ)`` (10 for an adaptive γ), n-grams up to 3 like ``pld``.

HF exposes no drafting statistics, so they are read off the target's forward passes with hooks: a pass
over T new tokens verifies T-1 drafts (the first pass: T - prompt length) and emits accepted+1 tokens,
so drafted = Σ T − prompt − (passes − 1), accepted = new tokens − passes; time inside the target's
forward is verification (the first pass is prefill), the rest of the wall time is drafting + overhead.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidParameterError, ModelNotFoundError

PEERS = ("hf-ar", "hf-assisted", "hf-pld")
HF_ADAPTIVE_PLD_TOKENS = 10
PLD_MAX_NGRAM = 3  # draftwise's PromptLookupDrafter default


@dataclass
class PeerRun:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) | "length"
    wall_s: float
    target_passes: int
    drafted: int
    accepted: int
    prefill_s: float
    verify_s: float
    past_eos: int  # tokens HF emitted after the first EOS (dropped from the output)


class _PassCounter:
    """Forward hooks on the HF target: per pass, new tokens fed and seconds spent."""

    def __init__(self, model):
        self.passes: list[tuple[int, float]] = []  # (T new tokens, seconds)
        self._t0 = 0.0
        self._T = 0
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post)]

    def _pre(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds", args[0] if args else None)
        self._T = int(x.shape[1]) if x is not None else 0
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        self.passes.append((self._T, time.perf_counter() - self._t0))

    def reset(self) -> None:
        self.passes = []

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def load_hf_model(src, dtype: torch.dtype):
    """An HF ``AutoModelForCausalLM`` from a GGUF file (de-quantized to ``dtype``, as the native backend
    runs it — never left in GGUF blocks), an HF folder or a hub id; quiet (no progress bars)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    kw: dict = {}
    if isinstance(src, Path) and src.is_file():
        kw = {"gguf_file": src.name, "quantization_config": GgufConfig(dequantize=True)}
        src = src.parent
    try:  # transformers' GGUF de-quantization draws its own tqdm bar on stderr: hidden with the rest
        with _quiet(), open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            return AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype, **kw).eval()
    except OSError as e:
        raise ModelNotFoundError(f"transformers could not load {src}: {str(e).splitlines()[0]}") from None


@contextlib.contextmanager
def _quiet():
    """transformers without warnings and progress bars (they would tear the benchmark's progress bar)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)


class HFPeers:
    """The HF target (and, for ``hf-assisted``, the HF draft), loaded once from the same sources."""

    def __init__(self, target_src, draft_src, dtype: torch.dtype, methods: list[str], gamma: int | str,
                 eos_ids: frozenset[int]):
        unknown = [m for m in methods if m not in PEERS]
        if unknown:
            raise InvalidParameterError(f"unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")
        self.gamma = gamma
        self.eos_ids = sorted(eos_ids)
        self.target = load_hf_model(target_src, dtype)
        self.draft = None
        if "hf-assisted" in methods:
            if draft_src is None:
                raise InvalidParameterError("hf-assisted needs a draft model (--draft NAME_OR_PATH)")
            self.draft = load_hf_model(draft_src, dtype)
            gc = self.draft.generation_config
            if isinstance(gamma, int):
                gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = gamma, "constant"
                gc.assistant_confidence_threshold = 0.0
        self.counter = _PassCounter(self.target)

    def settings(self) -> dict:
        """What each peer was asked for (goes into results.json's config)."""
        s: dict = {"hf-ar": {}, "hf-pld": {"prompt_lookup_num_tokens": self._pld_tokens(),
                                           "max_matching_ngram_size": PLD_MAX_NGRAM}}
        if self.draft is not None:
            gc = self.draft.generation_config
            s["hf-assisted"] = {"num_assistant_tokens": gc.num_assistant_tokens,
                                "num_assistant_tokens_schedule": gc.num_assistant_tokens_schedule,
                                "assistant_confidence_threshold": gc.assistant_confidence_threshold}
        return s

    def _pld_tokens(self) -> int:
        return self.gamma if isinstance(self.gamma, int) else HF_ADAPTIVE_PLD_TOKENS

    def generate(self, method: str, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0) -> PeerRun:
        from transformers import GenerationConfig

        kw: dict = {}  # GenerationConfig fields of the method
        if method == "hf-pld":
            kw.update(prompt_lookup_num_tokens=self._pld_tokens(), max_matching_ngram_size=PLD_MAX_NGRAM)
        elif method not in PEERS:
            raise InvalidParameterError(f"unknown peer {method!r}; choose from {', '.join(PEERS)}")
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
            else {"do_sample": False}
        # a full config, so nothing is inherited from the GGUF's defaults (repetition penalty, sampling, ...)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, num_beams=1, repetition_penalty=1.0,
                               eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0] if self.eos_ids else None,
                               **sampling, **kw)
        x = torch.tensor([prompt_ids])  # (1, P)
        self.counter.reset()
        with torch.inference_mode(), _quiet():
            t0 = time.perf_counter()
            out = self.target.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=cfg,
                                       **({"assistant_model": self.draft} if method == "hf-assisted" else {}))
            wall = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        eos = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
        past = 0 if eos is None else len(new) - eos - 1
        ids = new if eos is None else new[:eos + 1]
        passes = self.counter.passes
        fed = sum(T for T, _ in passes)
        drafted = max(0, fed - len(prompt_ids) - (len(passes) - 1)) if passes else 0
        return PeerRun(token_ids=ids, finish_reason="stop" if eos is not None else "length", wall_s=wall,
                       target_passes=len(passes), drafted=drafted,
                       accepted=max(0, len(new) - len(passes)) if drafted else 0,
                       prefill_s=passes[0][1] if passes else 0.0,
                       verify_s=sum(s for _, s in passes[1:]), past_eos=past)
