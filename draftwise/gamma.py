"""Adaptive draft length: pick γ (0 = speculation off) to maximise expected tokens per second.

A step that drafts k tokens for each of B rows costs one target pass over B·(k+1) tokens plus k draft
passes over B rows. Verification is nearly free while the target pass is bound by reading its weights
(small B·(k+1)); once the batch is large it is bound by compute and every drafted token costs about as
much as a generated one, so speculation stops paying. This policy measures that instead of guessing:

    cost(B, k)   = θ · [1, B, k, B·k]  seconds — fitted online by decayed least squares on observed steps
    tokens(B, k) = Σ_rows E(k_i; α_i),  E(k; α) = 1 + α + … + α^k = (1 − α^(k+1)) / (1 − α)
    γ            = argmax_k tokens(B, k) / cost(B, k)

where k_i is k clipped to the row's cap and remaining budget and α_i the row's per-token acceptance
probability so far, shrunk towards the running global one (a new row has not drafted yet). α is estimated
as accepted / tried, a draft position being tried when all before it were accepted — not accepted /
drafted, which undercounts α for k > 1 (drafts after a rejection are never tried). A position the
drafter left empty (prompt lookup found no match) counts as a failed try, so α also prices in how often
a drafter has nothing to propose. Every ``explore_every``-th step
tries a neighbour of the best k (alternately above and below) so the cost slope stays measured as the
batch changes. Works
with any drafter and in any Decoder (the server uses it; ``generate(gamma=AdaptiveGamma(4))`` too).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .errors import InvalidParameterError
from .sequence import Sequence


def expected_tokens(k: int, alpha: float) -> float:
    """Expected tokens one verification emits (accepted drafts + the target's own token), i.i.d. acceptance."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class AdaptiveGamma:
    """A ``GammaPolicy`` choosing γ in [0, max_gamma] from measured step costs and acceptance rates.

    ``cap(seq)`` optionally bounds a row's draft length (a request that asked for a smaller γ, or none);
    the policy counts only the drafts each row will really make. ``ready(seqs)`` optionally says whether
    the drafter can draft for this batch at all (a server that switched its draft model off); when not,
    γ is 0 but ``best`` still tells what the model would choose. ``last`` is the γ of the latest step
    (after caps), ``predicted`` the tokens/s it expected.
    """

    def __init__(self, max_gamma: int = 4, *, explore_every: int = 16, decay: float = 0.99,
                 prior_alpha: float = 0.6, prior_weight: float = 8.0,
                 cap: Callable[[Sequence], int | None] | None = None,
                 ready: Callable[[list[Sequence]], bool] | None = None):
        if not isinstance(max_gamma, int) or max_gamma < 1:
            raise InvalidParameterError(f"max_gamma must be an integer >= 1, got {max_gamma!r}")
        if not 0.0 < decay <= 1.0:
            raise InvalidParameterError(f"decay must be in (0, 1], got {decay}")
        self.max_gamma = max_gamma
        self.explore_every = explore_every
        self.decay = decay
        self.prior_weight = prior_weight
        self.cap = cap
        self.ready = ready
        # decayed least-squares sums for cost = θ·φ, φ = [1, B, k, B·k]
        self._A = np.zeros((4, 4))  # Σ w φφᵀ
        self._b = np.zeros(4)  # Σ w φ·seconds
        self._n = 0.0  # Σ w
        self._acc, self._tried = prior_alpha * prior_weight, prior_weight  # decayed global α counts
        self._rows: dict[int, list[int]] = {}  # id(seq) -> [accepted, tried] of the running rows
        self._steps = 0
        self._explore_next = 0
        self._pending: list[tuple[Sequence, int]] = []  # (row, drafts asked of it) of the current step
        self.last = max_gamma
        self.best = max_gamma  # the γ the model finds best for the latest batch (before exploring)
        self.predicted = 0.0

    # ---- GammaPolicy -----------------------------------------------------------------------------
    def choose(self, seqs: list[Sequence]) -> int:
        self._steps += 1
        B = len(seqs)
        self._rows = {id(s): self._rows.get(id(s), [0, 0]) for s in seqs}
        alphas = [self._row_alpha(s) for s in seqs]
        limits = [self._row_limit(s) for s in seqs]
        rates = [self._rate(B, k, alphas, limits) for k in range(self.max_gamma + 1)]
        best = self.best = int(np.argmax(rates))
        k = best
        if self.ready is not None and not self.ready(seqs):  # the drafter cannot draft for this batch now
            k = 0
        elif self.explore_every and self._steps % self.explore_every == 0:
            # a neighbour of the best: measures the cost slope in k where it matters, at a small price
            near = [j for j in (best + 1, best - 1) if 0 <= j <= self.max_gamma]
            k = near[self._explore_next % len(near)]
            self._explore_next += 1
        self.predicted = rates[k]
        self.last = max((min(k, lim) for lim in limits), default=0)
        self._pending = [(s, min(k, lim)) for s, lim in zip(seqs, limits)]
        return k

    def observe(self, k: int, accepted: list[int], step_s: float) -> None:
        B = len(accepted)
        d_acc = d_tried = 0
        for (s, asked), a in zip(self._pending, accepted):
            tried = a + (a < asked)  # positions up to the first rejection (or missing draft) were tried
            row = self._rows.setdefault(id(s), [0, 0])
            row[0] += a
            row[1] += tried
            d_acc += a
            d_tried += tried
        self._pending = []
        self._acc = self.decay * self._acc + d_acc
        self._tried = self.decay * self._tried + d_tried
        phi = self._features(B, self.last)  # the draft length the step really had
        self._A = self.decay * self._A + np.outer(phi, phi)
        self._b = self.decay * self._b + phi * step_s
        self._n = self.decay * self._n + 1.0

    # ---- model -----------------------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        """Per-token acceptance probability α over recent steps (prior-weighted at the start)."""
        return self._acc / self._tried if self._tried > 0 else 0.0

    def cost(self, B: int, k: int) -> float:
        """Predicted seconds of a step with B rows drafting k tokens each (0 before any observation)."""
        if self._n == 0:
            return 0.0
        # ridge on the slopes only, scaled to the data, keeps the fit defined while B or k never varied
        reg = np.diag([0.0, 1.0, 1.0, 1.0]) * 1e-6 * max(np.trace(self._A), 1.0)
        theta = np.linalg.solve(self._A + reg + np.eye(4) * 1e-12, self._b)
        floor = 0.1 * self._b[0] / self._A[0, 0]  # a tenth of the mean step: never zero or negative
        return max(float(theta @ self._features(B, k)), floor)

    def _rate(self, B: int, k: int, alphas: list[float], limits: list[int]) -> float:
        tokens = sum(expected_tokens(min(k, lim), a) for a, lim in zip(alphas, limits))
        if self._n == 0:  # nothing measured yet: assume verification is free (start by speculating)
            return tokens
        return tokens / self.cost(B, max((min(k, lim) for lim in limits), default=0))

    def _row_alpha(self, s: Sequence) -> float:
        acc, tried = self._rows[id(s)]
        return (acc + self.prior_weight * self.acceptance_rate) / (tried + self.prior_weight)

    def _row_limit(self, s: Sequence) -> int:
        lim = min(self.max_gamma, s.remaining - 1)
        c = self.cap(s) if self.cap is not None else None
        return max(0, lim if c is None else min(lim, c))

    @staticmethod
    def _features(B: int, k: int) -> np.ndarray:
        return np.array([1.0, B, k, B * k], dtype=np.float64)
