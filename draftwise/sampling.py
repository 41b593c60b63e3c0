"""Sampling parameters and logits → probabilities. Pure functions of tensors.

The same transform (temperature, then top-k, then top-p) is applied to the target's and the drafter's
logits, so the draft distribution q the drafts are sampled from is exactly the q the verifier divides by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import InvalidParameterError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise InvalidParameterError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidParameterError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidParameterError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise InvalidParameterError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits → (..., V) float32 probabilities after temperature, top-k and top-p.

    Greedy params give a one-hot on the argmax (what greedy decoding samples from).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of (..., V) probabilities with the given generator → (...) int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
