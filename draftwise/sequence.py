"""Per-request state: tokens, sampling parameters, its own generator, statistics, drafter state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .sampling import SamplingParams, make_generator, position_uniforms

# how each output token came to be (the CLI colours them)
PLAIN, ACCEPTED, RECOVERED, BONUS = "plain", "accepted", "recovered", "bonus"


@dataclass
class GenerationStats:
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0  # target forwards that emitted tokens, prefill included
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache (not computed)
    accepted_by_position: list[int] = field(default_factory=list)  # accepted[i]: drafts at position i kept
    drafted_by_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    gammas: list[int] = field(default_factory=list)  # draft length asked for at each step
    choices: dict[str, int] = field(default_factory=dict)  # method auto: steps per drafter chosen ("none": ar)

    @property
    def acceptance_rate(self) -> float:
        """α = accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """τ = tokens emitted per target forward pass, bonus included; 1.00 for plain decoding."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def record_step(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One target pass over ``drafted`` draft tokens (a tree's nodes, ``depth`` levels deep; a chain's
        depth is its length), ``accepted`` of them kept; acceptance by position counts depth levels."""
        self.drafted += drafted
        self.accepted += accepted
        self.target_passes += 1
        for i in range(drafted if depth is None else depth):
            if i >= len(self.drafted_by_position):
                self.drafted_by_position.append(0)
                self.accepted_by_position.append(0)
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += int(i < accepted)

    def summary(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "wall_s": round(self.wall_s, 4),
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "target_passes": self.target_passes,
            "cached_tokens": self.cached_tokens,
            "acceptance_by_position": [round(a / d, 4) if d else 0.0 for a, d in
                                       zip(self.accepted_by_position, self.drafted_by_position)],
            **({"choices": dict(self.choices)} if self.choices else {}),
        }


@dataclass
class Sequence:
    """One request being decoded. ``tokens`` = prompt + output; the target cache holds all but the last.

    An encoder-decoder target also takes ``encoder_ids`` (the source, encoded once when the sequence is
    added); its ``prompt_ids`` are then the decoder's prompt (``HFSeq2SeqLM.decoder_prompt``)."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    encoder_ids: list[int] | None = None  # source tokens of an encoder-decoder target; None = decoder-only
    tokens: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # per output token: PLAIN/ACCEPTED/RECOVERED/BONUS
    generator: torch.Generator | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    drafter_state: Any = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (then ``error`` says why)
    error: Exception | None = None
    stop_text_end: int | None = None  # output text is cut here when a stop string matched
    row: int = -1  # row in the engine's caches
    started: float = field(default_factory=time.perf_counter)
    _uniforms: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def uniforms(self, position: int, size: int) -> np.ndarray:
        """A seeded sequence's keyed uniforms at output position ``position`` (``position_uniforms``),
        at least ``size`` of them (a prefix of a longer draw is the shorter draw), cached while the
        position lies ahead of the output: a drafter drawing there (coupled) and the verifier share them."""
        u = self._uniforms.get(position)
        if u is None or len(u) < size:
            for old in [q for q in self._uniforms if q < self.num_output]:
                del self._uniforms[old]
            u = self._uniforms[position] = position_uniforms(self.params.seed, position, size)
        return u

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        if self.generator is None:
            self.generator = make_generator(self.params.seed)

    @property
    def lookup_context(self) -> list[int]:
        """What copying drafters (prompt lookup, NASD) search: source + tokens for an encoder-decoder
        target (translation and summaries copy from the source), else ``tokens`` itself."""
        return self.tokens if self.encoder_ids is None else self.encoder_ids + self.tokens

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - self.num_output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
