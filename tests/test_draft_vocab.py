"""The draft model's head over part of its vocabulary (``transformer.VocabSubset`` / ``restrict_vocab``;
``DRAFTWISE_DRAFT_VOCAB``, ``api.draft_head_tokens``): the kept tokens' logits (the first ids', and those the
running sequences hold) are the full head's bit for bit, the others -inf, and drafting with it stays
lossless: greedy and seeded outputs equal plain decoding's, and sampled outputs follow the target's
distribution (the rejection sampler is given the restricted q, zero outside the subset)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from draftwise.api import draft_head_tokens
from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.draft_model import DraftModelDrafter
from draftwise.errors import InvalidParameterError
from draftwise.kernels import extension
from draftwise.models.transformer import VocabSubset, restrict_vocab
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """A tiny Qwen2 model (vocab 96) read from a GGUF with Q8_0 / Q5_0 / Q4_0 / Q4_1 matrices, loaded twice."""
    from draftwise.models import load_model
    from tests.test_kblock import _block_gguf

    if extension() is None:
        pytest.skip("the kernel is not built here")
    cfg, path = _block_gguf(tmp_path, monkeypatch, ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q5_0"))
    return load_model(str(path), "gguf", progress=False), load_model(str(path), "gguf", progress=False)


def test_the_kept_tokens_logits_are_the_full_heads(tiny_gguf):
    full, cut = tiny_gguf
    assert restrict_vocab(cut.model, 20, {90})
    head = cut.model.lm_head
    assert isinstance(head, VocabSubset) and head.ranges == [(0, 32), (80, 96)]  # whole tiles of 16 rows
    assert not restrict_vocab(cut.model, 20, set())  # already restricted
    ids = torch.tensor([[3, 17, 42, 8, 91, 5]])
    want = full.model.forward(ids, full.model.new_cache(1, 16)).logits
    got = cut.model.forward(ids, cut.model.new_cache(1, 16)).logits
    kept = torch.zeros(96, dtype=torch.bool)
    kept[:32] = kept[80:] = True
    assert torch.equal(got[..., kept], want[..., kept])
    assert torch.isneginf(got[..., ~kept]).all()
    assert not restrict_vocab(full.model, 60, set())  # would keep more than half: left as it is


def test_drafting_with_a_restricted_head_is_lossless(tiny_gguf):
    target, draft = tiny_gguf
    assert restrict_vocab(draft.model, 16, set())
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 40, 41], [10, 11, 12, 10, 11, 12]]
    for params in (SamplingParams(temperature=0, max_tokens=24),
                   SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=5)):
        plain = Decoder(target.model, None, FixedGamma(1), rows=1, capacity=64)  # no drafter: plain decoding
        spec = Decoder(target.model, DraftModelDrafter(draft.model, 1, 64), FixedGamma(3), rows=1, capacity=64)
        drafted = 0
        for p in prompts:
            a, b = Sequence(list(p), params), Sequence(list(p), params)
            plain.run([a])
            spec.run([b])
            assert b.output_ids == a.output_ids, (p, params)
            drafted += b.stats.drafted
        assert drafted > 0


def test_held_tokens_are_computed_until_released(tiny_gguf):
    """A sequence's tokens outside the kept ranges are computed (the whole head's logits, bit for bit) while
    some sequence holds their tile, and -inf again once the last holder released it."""
    full, cut = tiny_gguf
    assert restrict_vocab(cut.model, 16, set())  # tile 0 (ids 0-15) kept
    head = cut.model.lm_head
    ids = torch.tensor([[3, 17, 42, 8, 91, 5]])
    want = full.model.forward(ids, full.model.new_cache(1, 16)).logits

    def computed() -> set[int]:  # tiles whose logits are the full head's; every other logit must be -inf
        out = cut.model.forward(ids, cut.model.new_cache(1, 16)).logits
        tiles = {t for t in range(6) if torch.equal(out[..., 16 * t:16 * t + 16], want[..., 16 * t:16 * t + 16])}
        assert all(torch.isneginf(out[..., 16 * t:16 * t + 16]).all() for t in set(range(6)) - tiles)
        return tiles

    a, b = set(), set()
    head.hold([40, 3, 95], a)
    head.hold([41, 60, 44], b)
    assert a == {2, 5} and b == {2, 3}  # the kept tile 0 is not held
    assert computed() == {0, 2, 3, 5}
    head.release(a)
    assert not a and computed() == {0, 2, 3}  # tile 2: b still holds it
    head.hold([], b)
    head.release(b)
    assert head.held == {} and computed() == {0}


def test_the_draft_holds_each_running_sequences_tokens(tiny_gguf):
    target, draft = tiny_gguf
    assert restrict_vocab(draft.model, 16, set())
    head = draft.model.lm_head
    drafter = DraftModelDrafter(draft.model, 2, 64)
    held: list[dict] = []
    propose = drafter.propose
    drafter.propose = lambda seqs, ks: held.append(dict(head.held)) or propose(seqs, ks)
    seqs = [Sequence([1, 2, 50, 3], SamplingParams(temperature=0, max_tokens=12)),
            Sequence([4, 90, 91, 5, 6], SamplingParams(temperature=0, max_tokens=12))]
    Decoder(target.model, drafter, FixedGamma(3), rows=2, capacity=64).run(seqs)
    assert held and held[0].keys() >= {3, 5}  # the prompts' tiles, from the first step
    outputs = {t // 16 for s in seqs for t in s.output_ids} - {0}
    assert all(h.keys() <= {3, 5} | outputs for h in held)
    assert head.held == {} and drafter._held == {}  # both sequences released what they held


@pytest.mark.statistical
def test_sampled_output_follows_the_target_with_a_restricted_draft():
    """The draft proposes only tokens 0-2 of 6 (q zero elsewhere); the target still emits 3-5 at their own
    probability: the joint distribution of the first three tokens matches the target's exact one."""
    from draftwise.models.transformer import random_model
    from tests.conftest import TINY, perturbed
    from tests.test_decode import exact_joint, joint_pvalue

    cfg = TINY.__class__(**{**TINY.to_dict(), "vocab_size": 6})
    target = random_model(cfg, seed=11)
    draft = perturbed(target, 0.8, seed=12)
    head = draft.lm_head
    part = nn.Linear(head.in_features, 3, bias=False)
    part.weight = nn.Parameter(head.weight[:3].detach().clone(), requires_grad=False)
    draft.lm_head = VocabSubset([part], [(0, 3)], 6)
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.0, max_tokens=4)
    exact = exact_joint(target, prompt, params)
    dec = Decoder(target, DraftModelDrafter(draft, 1, 64), FixedGamma(3), rows=1, capacity=64)
    g = torch.Generator().manual_seed(2025)
    seqs = (Sequence(prompt, params, generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))))
            for _ in range(3000))
    assert joint_pvalue(dec, seqs, exact) > 1e-3


def test_how_many_tokens_the_draft_head_keeps(tiny_gguf, monkeypatch):
    from dataclasses import replace

    from draftwise.api import DRAFT_HEAD_SHARE, DRAFT_VOCAB, head_share

    small, _ = tiny_gguf
    qwen05 = replace(small.config, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                     num_heads=14, num_kv_heads=2, head_dim=64)
    qwen15 = replace(qwen05, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, head_dim=128)
    assert 0.27 < head_share(qwen05) < 0.28 and 0.15 < head_share(qwen15) < 0.16  # 136M of 494M; 233M of 1.54B

    def draft(cfg):
        return type("D", (), {"model": small.model, "config": cfg})()

    monkeypatch.delenv("DRAFTWISE_DRAFT_VOCAB", raising=False)
    assert draft_head_tokens(small, None) is None  # 96 tokens: nothing to cut
    assert draft_head_tokens(draft(qwen05), None) == DRAFT_VOCAB  # auto: the head is 28 % of a token's weights
    assert head_share(qwen15) < DRAFT_HEAD_SHARE and draft_head_tokens(draft(qwen15), None) is None  # 15 %: whole
    assert draft_head_tokens(draft(replace(qwen05, vocab_size=2 * DRAFT_VOCAB - 1)), None) is None  # cuts < half
    Big = draft(qwen05)
    assert draft_head_tokens(Big, "full") is None and draft_head_tokens(Big, 4096) == 4096
    assert draft_head_tokens(Big, "AUTO") == DRAFT_VOCAB
    assert draft_head_tokens(Big, 10 ** 6) is None  # all of them anyway
    monkeypatch.setenv("DRAFTWISE_DRAFT_VOCAB", "full")
    assert draft_head_tokens(Big, None) is None
    assert draft_head_tokens(Big, "auto") == DRAFT_VOCAB  # the argument over the environment
    monkeypatch.setenv("DRAFTWISE_DRAFT_VOCAB", "8192")
    assert draft_head_tokens(Big, None) == 8192
    for bad in ("many", "0", -3):
        with pytest.raises(InvalidParameterError):
            draft_head_tokens(Big, bad)
