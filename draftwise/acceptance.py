"""The one running estimate of a drafter's acceptance, shared by the adaptive γ policy (gamma.py) and the
auto drafter (drafters/auto.py).

α is the probability that a drafted position is accepted given the drafter proposed and every earlier
position was accepted: accepted / tried, where tried counts the positions up to the first rejection (a
position left empty counts as a failed try). π is how often the drafter proposes anything when asked (1
for a draft model; prompt lookup finds no match at times). Both are decayed counts, so old steps fade.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_accepted(alpha: float, depth: int) -> float:
    """α + α² + … + α^depth: drafts accepted out of ``depth`` under i.i.d. acceptance (the bonus token not
    counted)."""
    return sum(alpha ** i for i in range(1, depth + 1))


@dataclass
class Acceptance:
    """Decayed counts: α = accepted / tried, π = proposed / asked."""

    accepted: float = 0.0
    tried: float = 0.0
    proposed: float = 0.0
    asked: float = 0.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0

    @property
    def pi(self) -> float:
        return self.proposed / self.asked if self.asked > 0 else 1.0

    def update(self, accepted: float, tried: float, proposed: float, decay: float, asked: float = 1.0) -> None:
        """Decay the counts by ``decay``, then add a step's: ``asked`` rows (default one) were asked for
        drafts, ``proposed`` of them got some, ``tried`` positions were tried and ``accepted`` accepted."""
        self.accepted = decay * self.accepted + accepted
        self.tried = decay * self.tried + tried
        self.proposed = decay * self.proposed + float(proposed)
        self.asked = decay * self.asked + asked

    def shrunk(self, alpha: float, pi: float, weight: float) -> tuple[float, float]:
        """(α, π) of these counts plus ``weight`` tries at the rates ``alpha``, ``pi`` (a row's own counts
        shrunk towards the pooled rates: a row seen little is judged mostly by the pool)."""
        a = (weight * alpha + self.accepted) / (weight + self.tried) if weight + self.tried > 0 else alpha
        p = (weight * pi + self.proposed) / (weight + self.asked) if weight + self.asked > 0 else pi
        return a, p

    def expected(self, depth: int) -> float:
        """π · (α + … + α^depth): drafts accepted when ``depth`` are asked for."""
        return self.pi * expected_accepted(self.alpha, depth)


__all__ = ["Acceptance", "expected_accepted"]
