"""Adaptive draft length: pick γ (0 = speculation off) to maximise expected tokens per second.

A step that drafts k tokens for each of B rows costs one target pass over B·(k+1) tokens plus the
drafter's work. Verification is nearly free while the target pass is bound by reading its weights
(small B·(k+1)); once the batch is large it is bound by compute and every drafted token costs about as
much as a generated one, so speculation stops paying. This policy measures that instead of guessing:

    cost(B, k)   = θ · [1, B, k, B·k, P(B·(k+1)) / P(1)]  seconds — fitted online by decayed least squares
    tokens(B, k) = Σ_rows 1 + A_row(k_i)   expected tokens the step emits (the target's own token + accepted)
    A_row(j)     = π_row · (α_row + α_row² + … + α_row^j)
    γ            = argmax_k tokens(B, k) / cost(B, k)

P(T) is the measured cost of one target pass over T new tokens (``set_pass_cost``; the last feature is
left out without it). A pass's cost is not linear in T: on an AVX2 CPU the int8 kernel hides the second
token under the weight reads (1.1-1.2x one token) and pays for every token after it (1.5x for 3, 1.9x for
4, measured on the Qwen 1.5B), and on AMX it stays flat to 32. A fit linear in k alone averages that out
and over-prices k = 1 by a third there, refusing γ = 1 to drafters with α 0.2-0.5 for which it pays.

k_i is k clipped to the row's cap and remaining budget. π is how often the drafter proposes anything
when asked (1 for a draft model; prompt lookup and NASD find no match at times) and α the probability a
draft position is accepted given the drafter proposed and all earlier positions were accepted: accepted
/ tried (accepted / drafted would undercount it for j > 1; a position left empty counts as a failed
try). Both are decayed running estimates pooled over all rows and draft lengths, so they are usable
after a few steps, and each row has its own (decayed by ``row_decay`` at each step that asked it for
drafts, not at every step as the pool is), shrunk towards the pooled ones with the weight of
``row_weight`` tries: a request unlike the ones before it (prose after code) is
judged by its own drafts within a few steps instead of the pool's memory of ~100 steps. Without π, a
drafter whose proposals are all-or-nothing (a long, likely run or nothing) would look like one with a
low α and never get to draft.

Before any step is seen, ``prime`` feeds the fit with measured costs (``measure_forward_costs`` times
the target over T = 1..γ+1 new tokens at load), so the first request already knows where verification
gets expensive on this machine; real steps then take over (the decay forgets the priming).

Every ``explore_every``-th step tries a neighbour of the best k (alternately above and below) so the cost
slope and A stay measured as the batch changes. Works with any drafter and any Decoder (the server uses
it; ``SpeculativeDecoder.generate(gamma=AdaptiveGamma(4))`` too).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from .acceptance import Acceptance, expected_accepted
from .errors import InvalidParameterError
from .sequence import Sequence

MAX_GAMMA = 8  # gamma "auto": the adaptive policy chooses γ in [0, MAX_GAMMA] per step (method auto: its deepest)


def parse_gamma(value: int | str, *, any_policy: bool = False) -> int | str:
    """γ as a user gives it (the one parser: the command line, the benchmark and ``generate`` use it): an
    integer >= 1 (an int, or its digits), or "auto" (``any_policy``: any other policy name too, passed on
    to the engine as it is)."""
    if isinstance(value, bool):
        raise InvalidParameterError(f"gamma must be an integer >= 1 or 'auto', got {value!r}")
    if isinstance(value, int) or str(value).strip().lstrip("-").isdigit():
        g = int(value)
        if g < 1:
            raise InvalidParameterError(f"gamma must be >= 1, got {g}")
        return g
    name = str(value).strip()
    if name == "auto" or (any_policy and name):
        return name
    raise InvalidParameterError(f"gamma must be an integer >= 1 or 'auto', got {value!r}")


class AdaptiveGamma:
    """A ``GammaPolicy`` choosing γ in [0, max_gamma] from measured step costs and acceptance.

    ``cap(seq)`` optionally bounds a row's draft length (a request that asked for a smaller γ, or none);
    the policy counts only the drafts each row will really be asked for. ``ready(seqs)`` optionally says
    whether the drafter can draft for this batch at all (a server that switched its draft model off);
    when not, γ is 0 but ``best`` still tells what the model would choose. ``last`` is the γ of the
    latest step (after caps), ``predicted`` the tokens/s it expected.
    """

    def __init__(self, max_gamma: int = 4, *, explore_every: int = 16, decay: float = 0.99,
                 prior_alpha: float = 0.6, prior_weight: float = 4.0, row_decay: float = 0.99,
                 row_weight: float = 8.0, cap: Callable[[Sequence], int | None] | None = None,
                 ready: Callable[[list[Sequence]], bool] | None = None):
        if not isinstance(max_gamma, int) or max_gamma < 1:
            raise InvalidParameterError(f"max_gamma must be an integer >= 1, got {max_gamma!r}")
        for name, v in (("decay", decay), ("row_decay", row_decay)):
            if not 0.0 < v <= 1.0:
                raise InvalidParameterError(f"{name} must be in (0, 1], got {v}")
        self.max_gamma = max_gamma
        self.explore_every = explore_every
        self.decay = decay
        self.prior_weight = prior_weight
        self.row_decay, self.row_weight = row_decay, row_weight
        self.cap, self.ready = cap, ready
        self._pass: Callable[[int], float] | None = None  # P(T): set_pass_cost
        self._pass1 = 1.0  # P(1)
        self._reset_fit()
        # decayed counts: α = accepted / tried, π = rows that got drafts / rows asked for drafts
        self._pool = Acceptance(prior_alpha * prior_weight, prior_weight, prior_weight, prior_weight)
        # the same counts per row of the current batch: id(seq) -> (seq, its counts)
        self._rows: dict[int, tuple[Sequence, Acceptance]] = {}
        self._steps = 0
        self._explore_next = 0
        self._asked: list[tuple[Sequence, int, int]] = []  # (row, drafts asked, its drafted count before)
        self.last = self.best = max_gamma
        self._prev_k = max_gamma  # γ of the step before the latest
        # whether the target's pass runs each row's own tokens only (a packed, ragged batch: the native model;
        # the Decoder sets it): then a step costs the drafts the rows really fed, else B·(longest + 1) tokens
        self.packed = False
        self.predicted = 0.0

    def set_pass_cost(self, pass_cost: Callable[[int], float] | None) -> None:
        """Fit step costs with the shape of ``pass_cost(T)`` (seconds of one target pass over T new tokens,
        measured on this machine) as a feature, or without it (None). Starts the cost fit afresh: call it
        before ``prime``."""
        self._pass = pass_cost
        self._pass1 = pass_cost(1) if pass_cost is not None else 1.0
        if self._pass is not None and not self._pass1 > 0:
            raise InvalidParameterError(f"pass_cost(1) must be > 0, got {self._pass1}")
        self._reset_fit()

    def _reset_fit(self) -> None:
        d = 4 if self._pass is None else 5
        # decayed least-squares sums for cost = θ·φ (_features)
        self._A = np.zeros((d, d))  # Σ w φφᵀ
        self._b = np.zeros(d)  # Σ w φ·seconds
        self._n = 0.0  # Σ w

    # ---- GammaPolicy -----------------------------------------------------------------------------
    def choose(self, seqs: list[Sequence]) -> int:
        self._steps += 1
        B = len(seqs)
        before, self._rows = self._rows, {}  # rows that left the batch are forgotten
        for s in seqs:
            row = before.get(id(s))
            self._rows[id(s)] = row if row is not None and row[0] is s else (s, Acceptance())
        limits = [self._row_limit(s) for s in seqs]
        accepted = [self.accepted_by_length(s) for s in seqs]
        pis = [self.row_rates(s)[1] for s in seqs]
        rates = [self._rate(B, k, limits, accepted, pis) for k in range(self.max_gamma + 1)]
        k = self.best = int(np.argmax(rates))
        if self.ready is not None and not self.ready(seqs):  # the drafter cannot draft for this batch now
            k = 0
        elif self.explore_every and self._steps % self.explore_every == 0:
            # a neighbour of the best: measures the cost slope and A where it matters, at a small price
            near = [j for j in (self.best + 1, self.best - 1) if 0 <= j <= self.max_gamma]
            k = near[self._explore_next % len(near)]
            self._explore_next += 1
        self.predicted = rates[k]
        self._asked = [(s, min(k, lim), s.stats.drafted) for s, lim in zip(seqs, limits)]
        self.last = max((min(k, lim) for lim in limits), default=0)
        return k

    def observe(self, k: int, accepted: list[int], step_s: float) -> None:
        d, rd = self.decay, self.row_decay
        d_acc = d_tried = d_asked = d_proposed = 0
        for (s, asked, drafted_before), a in zip(self._asked, accepted):
            if asked == 0:
                continue
            proposed = s.stats.drafted > drafted_before  # the drafter proposed something for this row
            tried = a + (a < asked) if proposed else 0  # positions up to the first rejection (or missing draft)
            d_asked += 1
            d_proposed += proposed
            d_acc += a if proposed else 0
            d_tried += tried
            row = self._rows.get(id(s))
            if row is not None and row[0] is s:
                row[1].update(a if proposed else 0, tried, proposed, rd)
        self._pool.update(d_acc, d_tried, d_proposed, d, asked=d_asked)
        # A step that drafts right after steps that did not pays for the drafter catching up on every token
        # it skipped (a draft model's cache), which is not the cost of drafting k tokens: leave it out of
        # the fit, or one exploration after a run of γ = 0 steps makes drafting look expensive for good.
        if not (self._prev_k == 0 and self.last > 0):
            fed = sum(s.stats.drafted - before for s, _, before in self._asked) if self.packed else None
            self.prime(len(accepted), self.last, step_s, fed)  # the draft length the step really had
        self._prev_k = self.last

    def prime(self, B: int, k: int, seconds: float, fed: int | None = None) -> None:
        """Add a measured step cost (B rows drafting up to k tokens each, ``fed`` drafted tokens in all;
        None: B·k) to the cost fit without a step."""
        phi = self._features(B, k, fed)
        self._A = self.decay * self._A + np.outer(phi, phi)
        self._b = self.decay * self._b + phi * seconds
        self._n = self.decay * self._n + 1.0

    # ---- model -----------------------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        """α: a proposed draft position's acceptance probability over recent steps (prior-weighted at first)."""
        return self._pool.alpha

    @property
    def proposal_rate(self) -> float:
        """π: how often the drafter proposed at least one token when asked (prior-weighted at the start)."""
        return self._pool.pi

    def row_rates(self, seq: Sequence) -> tuple[float, float]:
        """(α, π) of one row of the current batch: its own decayed counts plus ``row_weight`` tries at the
        pooled rates (the pooled rates for a row not seen yet)."""
        row = self._rows.get(id(seq))
        counts = row[1] if row is not None and row[0] is seq else Acceptance()
        return counts.shrunk(self.acceptance_rate, self.proposal_rate, self.row_weight)

    def accepted_by_length(self, seq: Sequence | None = None) -> np.ndarray:
        """A(j) = π·(α + … + α^j) for j = 0..max_gamma: expected drafts accepted when j are asked for, at
        the pooled rates, or at row ``seq``'s (``row_rates``)."""
        alpha, pi = (self.acceptance_rate, self.proposal_rate) if seq is None else self.row_rates(seq)
        return np.array([pi * expected_accepted(alpha, j) for j in range(self.max_gamma + 1)])

    def cost(self, B: int, k: int, fed: float | None = None) -> float:
        """Predicted seconds of a step with B rows drafting up to k tokens each, ``fed`` drafted tokens in
        all (None: B·k, every row k) (0 before any observation)."""
        if self._n == 0:
            return 0.0
        # ridge on the slopes only, scaled to the data, keeps the fit defined while B or k never varied
        d = len(self._b)
        reg = np.diag([0.0] + [1.0] * (d - 1)) * 1e-6 * max(np.trace(self._A), 1.0)
        theta = np.linalg.solve(self._A + reg + np.eye(d) * 1e-12, self._b)
        floor = 0.1 * self._b[0] / self._A[0, 0]  # a tenth of the mean step: never zero or negative
        return max(float(theta @ self._features(B, k, fed)), floor)

    def _rate(self, B: int, k: int, limits: list[int], accepted: list[np.ndarray], pis: list[float]) -> float:
        asked = [min(k, lim) for lim in limits]
        tokens = sum(1.0 + acc[j] for acc, j in zip(accepted, asked))
        if self._n == 0:  # nothing measured yet: assume verification is free (start by speculating)
            return tokens
        # packed passes: a row feeds its draft only when the drafter proposed one (π), else the longest draft
        # sets every row's width
        fed = sum(pi * j for pi, j in zip(pis, asked)) if self.packed else None
        return tokens / self.cost(B, max(asked, default=0), fed)

    def _row_limit(self, s: Sequence) -> int:
        lim = min(self.max_gamma, s.remaining - 1)
        c = self.cap(s) if self.cap is not None else None
        return max(0, lim if c is None else min(lim, c))

    def _features(self, B: int, k: int, fed: float | None = None) -> np.ndarray:
        fed = B * k if fed is None else fed  # drafted tokens the pass runs
        phi = [1.0, B, k, fed]
        if self._pass is not None:
            phi.append(self._pass(max(1, round(B + fed))) / self._pass1)
        return np.array(phi, dtype=np.float64)


@torch.inference_mode()
def measure_forward_costs(model, max_tokens: int, *, context: int = 32, logits_for: str = "all",
                          sizes: list[int] | None = None) -> list[float]:
    """Seconds of one batch-1 forward over T = 1..max_tokens new tokens (or each T of ``sizes``) after
    ``context`` cached ones (the fastest of two timings each, after a warm-up). Works on any ``CausalLM``."""
    vocab = model.config.vocab_size
    sizes = list(sizes) if sizes is not None else list(range(1, max_tokens + 1))
    max_tokens = max(sizes)
    ids = (torch.arange(context + max_tokens, dtype=torch.long) * 7919 % vocab).view(1, -1)  # (1, C + T)
    cache = model.new_cache(1, context + max_tokens + 1)
    model.forward(ids[:, :context], cache, logits_for="last")
    costs = []
    for T in [max_tokens] + sizes:  # the first one warms up
        best = float("inf")
        for _ in range(2):
            cache.set_lengths(context)
            t0 = time.perf_counter()
            model.forward(ids[:, context:context + T], cache, logits_for=logits_for)
            best = min(best, time.perf_counter() - t0)
        costs.append(best)
    cache.set_lengths(0)
    return costs[1:]
