"""This machine's measured costs, which the adaptive γ policy, method auto and layerskip's calibration
price drafting with: the seconds of a batch-1 target pass over T new tokens, and of a draft model's
one-token pass. Each is measured once per decoder, when first needed (about two seconds for the 1.5B
target), with ``gamma.measure_forward_costs``."""

from __future__ import annotations

from .gamma import AdaptiveGamma, measure_forward_costs
from .models.base import MAX_TREE_TOKENS

AUTO_COST_SIZES = (1, 2, 3, 5, 9)  # target pass sizes measured for method auto's cost model


class PassCosts:
    """``costs(T)``: seconds of a batch-1 target pass over T new tokens on this machine — measured at
    AUTO_COST_SIZES and any size measured for this decoder (``measure``), made non-decreasing (timings
    are noisy), linear in between and beyond. ``seconds``: the measured points."""

    def __init__(self, target_model):
        self.model = target_model
        self.seconds: dict[int, float] = {}  # measured forward seconds over T new tokens
        self._draft: dict[int, float] = {}  # id(draft model) -> seconds of its one-token pass

    def measure(self, sizes) -> None:
        """Time the target over each of ``sizes`` new tokens not measured yet (one call for them all)."""
        missing = sorted(set(sizes) - set(self.seconds))
        if missing:
            self.seconds.update(zip(missing, measure_forward_costs(self.model, max(missing), sizes=missing)))

    def __call__(self, tokens: int) -> float:
        self.measure(AUTO_COST_SIZES)
        pts, top = [], 0.0
        for T, c in sorted(self.seconds.items()):
            top = max(top, c)
            pts.append((T, top))
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            if tokens <= t1 or t1 == pts[-1][0]:
                return max(c0 + (c1 - c0) * (tokens - t0) / (t1 - t0), pts[0][1])
        return pts[0][1]

    def draft_pass(self, draft_model) -> float:
        """Seconds of one single-token pass of ``draft_model`` (measured once)."""
        key = id(draft_model)
        if key not in self._draft:
            self._draft[key] = measure_forward_costs(draft_model, 1, logits_for="last")[0]
        return self._draft[key]


def prime(policy: AdaptiveGamma, costs: PassCosts, *, width: int = 1, per_draft: float = 0.0,
          text_drafts: bool = False) -> AdaptiveGamma:
    """Seed an adaptive policy's cost fit with this machine's measured step costs: a target pass over
    1 + min(k·width, MAX_TREE_TOKENS - 1) tokens (a tree of ``width`` branches, k deep) plus k drafted
    tokens at ``per_draft`` seconds each (``text_drafts``: k + 1 of them, a draft with another tokenizer);
    the fit takes the measured pass costs as a feature (``AdaptiveGamma.set_pass_cost``)."""
    fed = [1 + min(k * width, MAX_TREE_TOKENS - 1) for k in range(policy.max_gamma + 1)]  # tokens per pass
    costs.measure(fed)
    policy.set_pass_cost(costs)  # the fit follows the measured shape of a pass's cost in T
    for k, T in enumerate(fed):
        drafts = k + 1 if text_drafts and k else k
        policy.prime(1, k, costs.seconds[T] + drafts * per_draft)
    return policy


__all__ = ["AUTO_COST_SIZES", "PassCosts", "prime"]
