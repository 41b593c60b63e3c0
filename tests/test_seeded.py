"""Position-keyed sampling: a seed means the same text whatever γ, batch, method and load.

- ``sample_at`` is an exact sample of p (chi-square over many positions), its pruned search equals the full
  argmax, and its draws depend on (seed, position) alone;
- seeded decoding with any drafter, any fixed γ (0..8), and in batches of 1..8 beside other sequences,
  gives the text plain decoding gives with that seed (hypothesis over seeds, γ, batch sizes);
- the seeded sampled output still has the target's distribution (chi-square over seeds);
- seeds: any integer in [-2**63, 2**64 - 1] works (reduced modulo 2**64), others are a clear error.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from scipy.stats import chisquare

from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.base import Draft, StatelessDrafter
from draftwise.drafters.draft_model import DraftModelDrafter
from draftwise.drafters.nasd import NASDDrafter
from draftwise.drafters.pld import PromptLookupDrafter
from draftwise.errors import InvalidParameterError
from draftwise.gamma import AdaptiveGamma
from draftwise.models.transformer import random_model
from draftwise.sampling import SamplingParams, position_uniforms, sample_at
from draftwise.sequence import Sequence
from draftwise.verify import verify_keyed

CAP = 160
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [4], [10, 11, 12, 10, 11, 12, 10, 11, 30, 31]]


# ---- the keyed draw -----------------------------------------------------------------------------------
def test_sample_at_is_an_exact_sample():
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01, 0.0])
    n = 40000
    counts = collections.Counter(sample_at(p, 1234, i) for i in range(n))
    assert counts[6] == 0  # zero probability is never drawn
    observed = [counts[j] for j in range(6)]
    assert chisquare(observed, (p[:6] * n).tolist()).pvalue > 1e-3


def test_sample_at_pruned_search_equals_full_argmax():
    g = torch.Generator().manual_seed(0)
    for scale in (0.3, 1.0, 4.0, 12.0):
        p = torch.softmax(torch.randn(5000, generator=g) * scale, 0)
        for pos in range(100):
            u = position_uniforms(99, pos, 5000)
            full = int(np.argmax(p.double().numpy() / -np.log(u)))
            assert sample_at(p, 99, pos) == full


def test_uniforms_depend_on_seed_and_position_alone():
    a = position_uniforms(5, 17, 1000)
    assert np.array_equal(a, position_uniforms(5, 17, 1000))
    assert np.array_equal(a[:300], position_uniforms(5, 17, 300))  # a prefix is the shorter draw
    assert not np.array_equal(a, position_uniforms(5, 18, 1000))
    assert not np.array_equal(a, position_uniforms(6, 17, 1000))
    assert 0.0 < a.min() and a.max() < 1.0


def test_verify_keyed_accepts_while_draft_equals_target_draw():
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(4, 50, generator=g), -1)
    target = [sample_at(probs[i], 7, 10 + i) for i in range(4)]
    r = verify_keyed(probs, torch.tensor(target[:3]), 7, 10)
    assert (r.num_accepted, r.tokens, r.bonus) == (3, target, True)
    wrong = (target[1] + 1) % 50
    r = verify_keyed(probs, torch.tensor([target[0], wrong, target[2]]), 7, 10)
    assert (r.num_accepted, r.tokens, r.bonus) == (1, target[:2], False)


# ---- seeds ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,expected", [(0, 0), (2**64 - 1, 2**64 - 1), (-1, 2**64 - 1), (-(2**63), 2**63)])
def test_seed_range_is_int64_or_uint64(seed, expected):
    assert SamplingParams(temperature=1.0, seed=seed).seed == expected


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.5, "3", True])
def test_seed_out_of_range_is_a_clear_error(seed):
    with pytest.raises(InvalidParameterError, match="seed"):
        SamplingParams(temperature=1.0, seed=seed)


# ---- decoding -------------------------------------------------------------------------------------------
def _decode(model, drafter, prompts, params_list, policy, rows):
    dec = Decoder(model, drafter, policy, rows=rows, capacity=CAP)
    seqs = [Sequence(list(p), ps) for p, ps in zip(prompts, params_list)]
    dec.run(seqs)
    return [s.output_ids for s in seqs]


class WrongDrafter(StatelessDrafter):
    """Always proposes token 0 (mostly rejected): exercises recovered tokens at every position."""

    name = "wrong"

    def propose(self, seqs, ks):
        return [Draft([0] * k) for k in ks]


def _drafters(tiny_draft, rows):
    return {"draft": DraftModelDrafter(tiny_draft, rows, CAP), "pld": PromptLookupDrafter(),
            "nasd": NASDDrafter(), "wrong": WrongDrafter()}


@pytest.fixture(scope="module")
def plain(tiny_target):
    """Plain decoding with a seed, alone: the reference text of every test below."""
    cache = {}

    def get(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params)
        if key not in cache:
            cache[key] = _decode(tiny_target, None, [prompt], [params], FixedGamma(1), 1)[0]
        return cache[key]
    return get


@pytest.mark.parametrize("method", ["draft", "pld", "nasd", "wrong"])
def test_seeded_every_method_equals_seeded_plain(tiny_target, tiny_draft, plain, method):
    for temp, top_p, top_k in [(0.8, 1.0, 0), (1.0, 0.9, 0), (1.3, 1.0, 20)]:
        params = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, max_tokens=30, seed=2024)
        for gamma in (1, 3, 6):
            out = _decode(tiny_target, _drafters(tiny_draft, 1)[method], [PROMPTS[0]], [params], FixedGamma(gamma), 1)
            assert out[0] == plain(PROMPTS[0], params), (method, temp, gamma)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**64 - 1), gamma=st.integers(0, 8), batch=st.integers(1, 8),
       method=st.sampled_from(["draft", "pld", "nasd", "wrong"]))
def test_same_seed_same_text_for_any_gamma_and_batch(tiny_target, tiny_draft, plain, seed, gamma, batch, method):
    """The sequence under test (seeded, row 0) beside batch-1 other sequences (seeded and unseeded,
    other parameters) with γ fixed or adaptive: its text is plain decoding's alone."""
    params = SamplingParams(temperature=0.9, max_tokens=24, seed=seed)
    others = [SamplingParams(temperature=0.7, max_tokens=10 + 3 * i, seed=None if i % 2 else (seed + i + 1) % 2**64)
              for i in range(batch - 1)]
    prompts = [PROMPTS[3]] + [PROMPTS[i % 3] for i in range(batch - 1)]
    drafter = _drafters(tiny_draft, batch)[method]
    policy = FixedGamma(gamma) if gamma > 0 else AdaptiveGamma(4)
    out = _decode(tiny_target, drafter if gamma > 0 or method != "wrong" else None, prompts, [params] + others,
                  policy, batch)
    assert out[0] == plain(PROMPTS[3], params)


@pytest.mark.statistical
@pytest.mark.parametrize("method", ["draft", "pld", "nasd"])
def test_seeded_sampled_output_has_target_distribution(method):
    """Over many seeds, the seeded speculative output's first three tokens follow the target's exact joint
    distribution (chi-square), as the unseeded path's do (test_decode)."""
    from tests.conftest import TINY, perturbed
    from tests.test_decode import exact_joint, joint_pvalue

    cfg = TINY.__class__(**{**TINY.to_dict(), "vocab_size": 6})
    target = random_model(cfg, seed=11)
    draft = perturbed(target, 0.8, seed=12)
    prompt = [1, 2, 3]
    exact = exact_joint(target, prompt, SamplingParams(temperature=1.0, max_tokens=4))
    drafter = {"draft": DraftModelDrafter(draft, 1, 64), "pld": PromptLookupDrafter(), "nasd": NASDDrafter()}[method]
    dec = Decoder(target, drafter, FixedGamma(3), rows=1, capacity=64)
    seqs = (Sequence(prompt, SamplingParams(temperature=1.0, max_tokens=4, seed=seed * 7919 + 1))
            for seed in range(3000))
    assert joint_pvalue(dec, seqs, exact) > 1e-3
