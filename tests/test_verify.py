"""The rejection sampler: exact greedy cases, seeded determinism, fast == reference, and statistical
tests that the emitted tokens are distributed as the target's (for a draft distribution and one-hot)."""

import pytest
import torch
from scipy.stats import chisquare

from draftwise.sampling import sample
from draftwise.verify import verify_greedy, verify_reference, verify_sampled


def onehot_logits(ids, V=6):
    x = torch.full((len(ids), V), -5.0)
    for i, t in enumerate(ids):
        x[i, t] = 5.0
    return x


@pytest.mark.parametrize("target,draft,accepted,tokens,bonus", [
    ([1, 2, 3, 4], [1, 2, 3], 3, [1, 2, 3, 4], True),   # all accepted + bonus
    ([1, 5, 3, 4], [1, 2, 3], 1, [1, 5], False),         # reject at position 1, recover target's argmax
    ([0, 2, 3, 4], [1, 2, 3], 0, [0], False),            # reject immediately
    ([2], [], 0, [2], True),                             # no drafts = plain decoding step
])
def test_greedy_exact(target, draft, accepted, tokens, bonus):
    r = verify_greedy(onehot_logits(target), torch.tensor(draft, dtype=torch.long))
    assert (r.num_accepted, r.tokens, r.bonus) == (accepted, tokens, bonus)


def _random_case(seed, k=3, V=5, one_hot=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)
    q = None if one_hot else torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)
    x = torch.randint(0, V, (k,), generator=g) if one_hot else sample(q, g)
    return p, x, q


@pytest.mark.parametrize("one_hot", [False, True])
def test_seeded_determinism_and_reference_agree(one_hot):
    for seed in range(200):
        p, x, q = _random_case(seed, one_hot=one_hot)
        a = verify_sampled(p, x, q, torch.Generator().manual_seed(seed))
        b = verify_sampled(p, x, q, torch.Generator().manual_seed(seed))
        ref = verify_reference(p, x, q, torch.Generator().manual_seed(seed))
        assert (a.num_accepted, a.tokens) == (b.num_accepted, b.tokens) == (ref.num_accepted, ref.tokens)


def _emitted_pairs(p, q_fn, n, seed):
    """Run speculative steps of k=2 from a fixed context with drafts sampled from q (or fixed one-hot)
    and count the first two emitted tokens. Target: independent tokens with distributions p[0], p[1]."""
    g = torch.Generator().manual_seed(seed)
    V = p.shape[1]
    counts = torch.zeros(V, V)
    for _ in range(n):
        x, q = q_fn(g)
        r = verify_sampled(p, x, q, g)
        toks = r.tokens
        if len(toks) < 2:  # rejected at 0: the second token comes from the next step, drawn from p[1]
            toks = toks + [int(sample(p[1], g))]
        counts[toks[0], toks[1]] += 1
    return counts


@pytest.mark.statistical
@pytest.mark.parametrize("mode", ["draft_distribution", "one_hot"])
def test_output_distribution_matches_target(mode):
    V = 4
    # position-independent target so the exact joint of two tokens is p0 ⊗ p1
    p0 = torch.tensor([0.5, 0.2, 0.2, 0.1])
    p1 = torch.tensor([0.1, 0.3, 0.4, 0.2])
    p = torch.stack([p0, p1, p1])  # (k+1, V)
    q0 = torch.tensor([0.25, 0.25, 0.4, 0.1])

    def draft_q(g):
        q = torch.stack([q0, q0])
        return sample(q, g), q

    def one_hot(g):  # a deterministic drafter always proposing [2, 0]
        return torch.tensor([2, 0]), None

    n = 20000
    counts = _emitted_pairs(p, draft_q if mode == "draft_distribution" else one_hot, n, seed=1234)
    expected = torch.outer(p0, p1) * n
    stat, pval = chisquare(counts.flatten().numpy(), expected.flatten().numpy())
    assert pval > 1e-3, (counts, expected)
    # and the total variation distance shrinks with more samples
    tv_small = 0.5 * (_emitted_pairs(p, draft_q if mode == "draft_distribution" else one_hot, 500, 7) / 500
                      - torch.outer(p0, p1)).abs().sum()
    tv_large = 0.5 * (counts / n - torch.outer(p0, p1)).abs().sum()
    assert tv_large < tv_small and tv_large < 0.02


@pytest.mark.statistical
def test_biased_sampler_is_detected():
    """The statistical test can fail: accepting drafts without the p/q correction is caught."""
    V, n = 4, 20000
    p0 = torch.tensor([0.5, 0.2, 0.2, 0.1])
    q0 = torch.tensor([0.1, 0.1, 0.7, 0.1])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(n):
        counts[int(sample(q0, g))] += 1  # "always accept" sampler
    _, pval = chisquare(counts.numpy(), (p0 * n).numpy())
    assert pval < 1e-6


def test_all_rejected_residual_excludes_draft_token_for_one_hot():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.3, 0.3, 0.4]])
    for seed in range(50):
        r = verify_sampled(p, torch.tensor([0]), None, torch.Generator().manual_seed(seed))
        assert r.tokens == [1] and r.num_accepted == 0


def test_accept_prob_is_min_one_p_over_q():
    """Empirical acceptance rate of the first draft = sum_x min(p, q) (the classic identity)."""
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.2, 0.2, 0.6]])
    g = torch.Generator().manual_seed(5)
    n, acc = 20000, 0
    for _ in range(n):
        x = sample(q, g)
        acc += verify_sampled(p, x, q, g).num_accepted
    assert abs(acc / n - float(torch.minimum(p[0], q[0]).sum())) < 0.015
