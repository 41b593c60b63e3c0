"""The adaptive draft-length policy's cost model and per-row acceptance (draftwise/gamma.py). The
batch-level behaviour (speculation off under load, caps, catch-up costs) is tested in test_serve.py."""

import random

import pytest

from draftwise.errors import InvalidParameterError
from draftwise.gamma import AdaptiveGamma
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence

# Seconds of one Qwen-1.5B target pass over T new tokens on an AVX2 CPU (medians measured on Zen 3): the
# second token hides under the weight reads, every one after it costs about a fifth of a pass.
AVX2_PASS = {1: 0.060, 2: 0.070, 3: 0.092, 4: 0.111, 5: 0.147, 6: 0.168, 7: 0.190, 8: 0.212, 9: 0.234}
HEAD = 0.004  # a draft head's seconds per drafted token


def _pass(T: int) -> float:
    return AVX2_PASS[T] if T in AVX2_PASS else AVX2_PASS[9] + 0.022 * (T - 9)


def _primed(alpha: float, shape: bool, **kw) -> AdaptiveGamma:
    policy = AdaptiveGamma(8, prior_alpha=alpha, prior_weight=1e6, explore_every=0, **kw)
    if shape:
        policy.set_pass_cost(_pass)
    for k in range(9):
        policy.prime(1, k, _pass(k + 1) + HEAD * k)
    return policy


def _seq() -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(max_tokens=10_000))


def _true_rate(k: int, alpha: float) -> float:
    return (1 + sum(alpha ** i for i in range(1, k + 1))) / (_pass(k + 1) + HEAD * k)


@pytest.mark.parametrize("alpha", [0.3, 0.4, 0.45])
def test_pass_cost_shape_prices_gamma_one_right(alpha):
    """With a fit linear in k, the measured costs of k = 0..8 give k = 1 a price ~1.5x a plain pass (it
    is 1.17x + a head token) and γ = 1 is refused to drafters with α 0.2-0.5, for which it pays; with the
    measured pass costs as a feature the fit reproduces them and γ is the one that really is fastest."""
    shaped, linear = _primed(alpha, True), _primed(alpha, False)
    best = max(range(9), key=lambda k: _true_rate(k, alpha))
    assert best == 1 and _true_rate(1, alpha) > 1.03 * _true_rate(0, alpha)
    assert shaped.choose([_seq()]) == best
    assert linear.choose([_seq()]) == 0  # the old model's mistake this feature fixes
    assert [shaped.cost(1, k) for k in (0, 1, 2)] == pytest.approx([_pass(k + 1) + HEAD * k for k in (0, 1, 2)],
                                                                   rel=0.02)
    assert linear.cost(1, 1) / linear.cost(1, 0) > 1.5  # really (0.070 + 0.004) / 0.060 = 1.23


def test_pass_cost_shape_keeps_long_drafts_for_strong_drafters():
    """Where every verified token costs (AVX2), a strong drafter still drafts more than one token; where a
    pass costs the same for 1 and 9 tokens (AMX), the longest draft."""
    assert _primed(0.9, True).choose([_seq()]) >= 3
    flat = AdaptiveGamma(8, prior_alpha=0.9, prior_weight=1e6, explore_every=0)
    flat.set_pass_cost(lambda T: 0.06)
    for k in range(9):
        flat.prime(1, k, 0.06 + HEAD * k)
    assert flat.choose([_seq()]) == 8  # 6.1 tokens for 0.092 s


def test_set_pass_cost_checks_and_restarts_the_fit():
    policy = AdaptiveGamma(4)
    policy.prime(1, 0, 0.1)
    policy.set_pass_cost(_pass)
    assert policy.cost(1, 0) == 0.0  # nothing measured since
    with pytest.raises(InvalidParameterError):
        policy.set_pass_cost(lambda T: 0.0)
    with pytest.raises(InvalidParameterError):
        AdaptiveGamma(4, row_decay=0.0)


def _run(policy: AdaptiveGamma, seq: Sequence, alpha: float, steps: int, rng: random.Random) -> list[int]:
    chosen = []
    for _ in range(steps):
        k = policy.choose([seq])
        keff = policy.last
        chosen.append(keff)
        n = 0
        while n < keff and rng.random() < alpha:
            n += 1
        seq.stats.record_step(keff, n)
        policy.observe(k, [n], (_pass(keff + 1) + HEAD * keff) * rng.uniform(0.97, 1.03))
    return chosen


@pytest.mark.parametrize("row_weight", [8.0, 1e9])
def test_a_request_unlike_the_last_is_judged_by_its_own_drafts(row_weight):
    """After a long code request (α 0.85) the pooled α stays high for ~100 steps; a prose request whose
    drafts are all rejected stops drafting after ~20 steps by its own counts (row_weight 8), while a
    policy that only pools (row_weight huge) keeps drafting for it through 100 steps."""
    rng = random.Random(0)
    policy = AdaptiveGamma(8, explore_every=16, row_weight=row_weight)
    policy.set_pass_cost(_pass)
    for k in range(9):
        policy.prime(1, k, _pass(k + 1) + HEAD * k)
    code = _run(policy, _seq(), 0.85, 150, rng)
    assert sorted(code[-50:])[25] >= 2
    prose = _run(policy, _seq(), 0.0, 100, rng)
    early, late = sum(k > 0 for k in prose[:40]), sum(k > 0 for k in prose[40:])  # steps that drafted
    if row_weight == 8.0:
        assert early <= 28 and late <= 6  # late: the explorations (every 16th step) only
        assert policy.acceptance_rate > 0.5  # the pool still remembers the code request
    else:
        assert early >= 38 and late >= 50


def test_rows_of_one_batch_count_their_own_acceptance():
    """Two rows in one batch: the expected tokens of a step sum each row's own A(j)."""
    policy = AdaptiveGamma(4, explore_every=0)
    good, bad = _seq(), _seq()
    for _ in range(30):
        policy.choose([good, bad])
        k = policy.last
        good.stats.record_step(k, k)
        bad.stats.record_step(k, 0)
        policy.observe(k, [k, 0], 0.1)
    a_good, _ = policy.row_rates(good)
    a_bad, _ = policy.row_rates(bad)
    assert a_good > 0.8 and a_bad < 0.3
    pooled = policy.accepted_by_length()
    assert policy.accepted_by_length(good)[2] > pooled[2] > policy.accepted_by_length(bad)[2]
    assert policy.row_rates(_seq()) == pytest.approx((policy.acceptance_rate, policy.proposal_rate))


def test_packed_passes_price_only_the_rows_that_propose():
    """A batch of 8 where one row's drafter always proposes (α 0.9) and seven never do (prompt lookup
    finding no match). With packed passes (the native model: each row feeds its own tokens) the step
    costs 8 + k tokens and drafting pays; padded, it would cost 8 (k + 1) and the policy keeps γ 0."""

    def run(packed: bool) -> list[int]:
        policy = AdaptiveGamma(4, explore_every=4)
        policy.packed = packed
        policy.set_pass_cost(lambda T: 0.03 + 0.004 * T)  # a pass over T tokens in one batch
        rows = [_seq() for _ in range(8)]
        chosen = []
        for _ in range(60):
            k = policy.choose(rows)
            chosen.append(policy.last)
            fed = 0
            for i, s in enumerate(rows):
                if i == 0 and k:  # the one row with matches: its drafts (α 0.9, all accepted here)
                    s.stats.record_step(k, k)
                    fed += k
                elif k:
                    s.stats.record_step(0, 0)  # asked, proposed nothing
            width = 8 + fed if packed else 8 * (k + 1)
            policy.observe(k, [k] + [0] * 7, 0.03 + 0.004 * width)
        return chosen

    packed, padded = run(True), run(False)
    assert sum(k > 0 for k in packed[20:]) >= 30  # drafts for the matching row on most steps
    assert sum(k > 0 for k in padded[20:]) <= 12  # the explorations only (every 4th step)
