"""Draft heads (Medusa): tree building, training on the target's own predictions, files tied to their
target, and lossless decoding through the one loop (greedy equality, sampled distribution)."""

from __future__ import annotations

import pytest
import torch

from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.medusa import MedusaDrafter
from draftwise.errors import IncompatibleModelsError, InvalidParameterError, ModelNotFoundError
from draftwise.heads import HeadConfig, MedusaHeads, best_first_tree, load_heads
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence
from draftwise.train_head import corpus_files, head_targets, train_medusa
from tests.conftest import TINY_QWEN
from tests.test_decode import PROMPTS, exact_joint, joint_pvalue, run


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return [b % 96 for b in text.encode()]


def test_best_first_tree_grows_where_confident():
    probs = torch.tensor([[0.9, 0.05, 0.05], [0.5, 0.3, 0.2], [0.99, 0.01, 0.0]])
    ids = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    tokens, parents = best_first_tree(probs, ids, max_nodes=5, max_depth=3)
    # 10 (.9), 20 under it (.45), 30 under that (.4455), 21 under 10 (.27), 30 under 21 (.267)
    assert tokens == [10, 20, 30, 21, 30] and parents == [-1, 0, 1, 0, 3]
    assert best_first_tree(probs, ids, max_nodes=5, max_depth=1) == ([10, 11, 12], [-1, -1, -1])
    assert best_first_tree(probs, ids, max_nodes=0, max_depth=3) == ([], [])


def test_head_targets_stay_inside_chunks():
    labels = torch.tensor([1, 2, 3, 4, 5, 6])
    chunks = torch.tensor([0, 0, 0, 1, 1, 1])
    t = head_targets(labels, chunks, 2)
    assert t.tolist() == [[2, 3, -1, 5, 6, -1], [3, -1, -1, 6, -1, -1]]


def _heads(tiny_target, seed=0):
    cfg = HeadConfig("medusa", 3, TINY_QWEN.hidden_size, list(range(96)), "tiny", "abc")
    heads = MedusaHeads(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.out.weight.copy_(tiny_target.lm_head.weight)
        for b in heads.blocks:
            b.weight.copy_(torch.randn(b.weight.shape, generator=g) * 0.3)
    return heads.for_inference()


@pytest.mark.parametrize("gamma,branches", [(1, 1), (3, 2), (5, 4)])
def test_medusa_greedy_equals_plain(tiny_target, gamma, branches):
    params = SamplingParams(max_tokens=40)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    d = MedusaDrafter(_heads(tiny_target), branches=branches)
    assert [s.output_ids for s in run(tiny_target, d, PROMPTS, params, gamma=gamma)] == ref
    d = MedusaDrafter(_heads(tiny_target), branches=branches)
    assert [s.output_ids for s in run(tiny_target, d, PROMPTS, params, gamma=gamma, rows=4)] == ref


@pytest.mark.statistical
def test_medusa_sampled_distribution_matches_target():
    from draftwise.models.transformer import random_model
    from tests.conftest import TINY

    cfg = TINY.__class__(**{**TINY.to_dict(), "vocab_size": 6})
    target = random_model(cfg, seed=11)
    hc = HeadConfig("medusa", 2, cfg.hidden_size, list(range(6)), "tiny", "abc")
    heads = MedusaHeads(hc)
    with torch.no_grad():
        heads.out.weight.copy_(target.lm_head.weight)
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.0, max_tokens=4)
    exact = exact_joint(target, prompt, params)
    dec = Decoder(target, MedusaDrafter(heads.for_inference(), branches=3), FixedGamma(2), rows=1, capacity=64)
    g = torch.Generator().manual_seed(5)
    seqs = (Sequence(prompt, params, generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))))
            for _ in range(3000))
    assert joint_pvalue(dec, seqs, exact) > 1e-3


def test_train_save_load_and_target_check(tiny_target, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n" * 200)
    files = corpus_files([str(corpus)])
    heads = train_medusa(tiny_target, ByteTokenizer(), target_name="tiny", target_sha="sha-of-tiny",
                         out=tmp_path / "heads", minutes=0.15, files=files, num_heads=2, vocab_size=64,
                         batch=64, lr=3e-3, log=lambda m: None, bar=False)
    acc = heads.cfg.trained["held_out_top1"]
    assert heads.cfg.trained["steps"] > 10 and acc[0] > 0.3, heads.cfg.trained  # learnt the target's next-next token
    loaded = load_heads(tmp_path / "heads", "sha-of-tiny")
    h = torch.randn(3, TINY_QWEN.hidden_size)
    assert torch.equal(loaded(h), heads(h))
    with pytest.raises(IncompatibleModelsError, match="another target"):
        load_heads(tmp_path / "heads", "sha-of-something-else")
    with pytest.raises(ModelNotFoundError):
        load_heads(tmp_path / "nothing-here")
    # resumable: a second run reuses the features and continues from the saved heads
    again = train_medusa(tiny_target, ByteTokenizer(), target_name="tiny", target_sha="sha-of-tiny",
                         out=tmp_path / "heads", minutes=0.05, files=files, num_heads=2, vocab_size=64,
                         batch=64, log=lambda m: None, bar=False)
    assert again.cfg.trained["steps"] > heads.cfg.trained["steps"]


def test_corpus_refuses_the_benchmark(tmp_path):
    bench = tmp_path / "spec_bench"
    bench.mkdir()
    (bench / "q.txt").write_text("x")
    with pytest.raises(InvalidParameterError, match="benchmark"):
        corpus_files([str(bench)])
    with pytest.raises(InvalidParameterError, match="does not exist"):
        corpus_files([str(tmp_path / "missing")])


def test_medusa_needs_valid_branches(tiny_target):
    with pytest.raises(InvalidParameterError):
        MedusaDrafter(_heads(tiny_target), branches=0)
