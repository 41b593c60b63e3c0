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


# ---- token trees ------------------------------------------------------------------------------------
from draftwise.verify import verify_tree_greedy, verify_tree_keyed, verify_tree_sampled  # noqa: E402

# a two-token target whose second token depends on the first: joint p0[a] * P1[a, b]
P0 = torch.tensor([0.4, 0.3, 0.2, 0.1])
P1 = torch.tensor([[0.1, 0.2, 0.3, 0.4],
                   [0.7, 0.1, 0.1, 0.1],
                   [0.25, 0.25, 0.25, 0.25],
                   [0.05, 0.05, 0.1, 0.8]])
Q0 = torch.tensor([0.1, 0.2, 0.6, 0.1])
Q1 = torch.tensor([[0.3, 0.3, 0.2, 0.2],
                   [0.1, 0.1, 0.7, 0.1],
                   [0.4, 0.4, 0.1, 0.1],
                   [0.25, 0.25, 0.25, 0.25]])


def _tree_target(tokens, parents):
    """Target rows of a tree: row 0 after the root is P0, a node at depth 1 holding a is followed by P1[a],
    deeper nodes by P1 of their token too (only the first two emitted tokens are counted)."""
    return torch.stack([P0] + [P1[t] for t in tokens])


def _sample_without_replacement(q, m, g):
    out, q = [], q.clone()
    for _ in range(m):
        x = int(sample(q / q.sum(), g))
        out.append(x)
        q[x] = 0.0
    return out


def _tree_fixed(g):  # deterministic: 3 children of the root, some with children (one repeated token)
    tokens, parents = [2, 0, 1, 1, 3, 2, 1], [-1, -1, -1, 0, 0, 1, 3]
    return tokens, parents, None


def _tree_sampled(g):  # 2 children of the root without replacement from Q0, 2 grandchildren each from Q1
    first = _sample_without_replacement(Q0, 2, g)
    tokens, parents, probs = list(first), [-1, -1], [Q0, Q0]
    for j, a in enumerate(first):
        for b in _sample_without_replacement(Q1[a], 2, g):
            tokens.append(b)
            parents.append(j)
            probs.append(Q1[a])
    return tokens, parents, torch.stack(probs)


def _tree_wide(g):  # one level, all 4 tokens sampled without replacement (acceptance is then certain)
    first = _sample_without_replacement(Q0, 4, g)
    return first, [-1] * 4, torch.stack([Q0] * 4)


def _tree_pairs(make, n, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(4, 4)
    for _ in range(n):
        tokens, parents, probs = make(g)
        r = verify_tree_sampled(_tree_target(tokens, parents), tokens, parents, probs, g)
        toks = r.tokens
        if len(toks) < 2:
            toks = toks + [int(sample(P1[toks[0]], g))]
        counts[toks[0], toks[1]] += 1
    return counts


@pytest.mark.statistical
@pytest.mark.parametrize("make", [_tree_fixed, _tree_sampled, _tree_wide])
def test_tree_output_distribution_matches_target(make):
    """Multi-branch rejection sampling over trees of several shapes (one-hot and sampled q) emits tokens
    distributed exactly as the target's joint of the first two tokens."""
    n = 20000
    counts = _tree_pairs(make, n, seed=99)
    expected = (P0[:, None] * P1) * n
    _, pval = chisquare(counts.flatten().numpy(), expected.flatten().numpy())
    assert pval > 1e-3, (counts, expected)


@pytest.mark.statistical
def test_tree_sampler_without_q_update_is_detected():
    """The test can fail: trying sampled siblings without removing the rejected one from q is biased."""
    import draftwise.verify as V

    n = 20000
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(4, 4)
    for _ in range(n):
        tokens, parents, probs = _tree_wide(g)
        # wrong: treat the siblings as independent draws (q not renormalised after a rejection)
        p, path = P0.clone(), None
        for c in range(4):
            x = tokens[c]
            if float(torch.rand(1, generator=g)) * float(Q0[x]) < float(p[x]):
                path = x
                break
            p = (p - Q0).clamp_min(0)
            p = p / p.sum() if p.sum() > 0 else P0
        a = path if path is not None else int(sample(p, g))
        counts[a, int(sample(P1[a], g))] += 1
    _, pval = chisquare(counts.flatten().numpy(), ((P0[:, None] * P1) * n).flatten().numpy())
    assert pval < 1e-6
    assert V.verify_tree_sampled  # the real one is tested above


def test_tree_greedy_walks_the_argmax_path():
    tokens, parents = [2, 0, 1, 3, 1], [-1, -1, 0, 0, 1]
    # rows: after root argmax 0 -> node 1; after node 1 argmax 1 -> node 4; after node 4 argmax 3 (leaf)
    logits = torch.full((6, 4), -1.0)
    for row, best in [(0, 0), (1, 2), (2, 1), (3, 0), (4, 0), (5, 3)]:
        logits[row, best] = 1.0
    r = verify_tree_greedy(logits, tokens, parents)
    assert (r.path, r.tokens, r.bonus) == ([1, 4], [0, 1, 3], True)
    logits[2, 1], logits[2, 2] = -1.0, 1.0  # after node 1 the target wants 2: no such child
    r = verify_tree_greedy(logits, tokens, parents)
    assert (r.path, r.tokens, r.bonus) == ([1], [0, 2], False)


def test_tree_keyed_emits_the_targets_keyed_draws():
    """Seeded trees: the output is the target's own keyed draw at each depth, whatever the tree holds."""
    from draftwise.sampling import sample_at

    g = torch.Generator().manual_seed(3)
    for seed in range(50):
        tokens, parents, _ = _tree_sampled(g)
        probs = _tree_target(tokens, parents)
        r = verify_tree_keyed(probs, tokens, parents, seed, position=7)
        a = sample_at(P0, seed, 7)
        assert r.tokens[0] == a
        if r.num_accepted:
            assert r.tokens[1] == sample_at(P1[a], seed, 8)


def test_chain_as_tree_equals_chain_verification():
    """A chain passed as a tree takes the same decisions as the chain verifier (greedy)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        logits = torch.randn(5, 6, generator=g)
        draft = torch.randint(0, 6, (4,), generator=g)
        draft[:2] = logits[:2].argmax(-1)
        a = verify_greedy(logits, draft)
        b = verify_tree_greedy(logits, draft.tolist(), [-1, 0, 1, 2])
        assert (a.num_accepted, a.tokens, a.bonus) == (b.num_accepted, b.tokens, b.bonus)
