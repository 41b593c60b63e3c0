"""Draft heads (Medusa, EAGLE-style): tree building, training on the target's own predictions, files tied to their
target, and lossless decoding through the one loop (greedy equality, sampled distribution)."""

from __future__ import annotations

import pytest
import torch

from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.eagle import EagleDrafter
from draftwise.drafters.medusa import MedusaDrafter
from draftwise.errors import IncompatibleModelsError, InvalidParameterError, ModelNotFoundError
from draftwise.heads import EagleHead, HeadConfig, MedusaHeads, best_first_tree, eagle_arch, load_heads, pick_heads, save_heads
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence
from draftwise.train_head import corpus_files, head_targets, train_eagle, train_medusa
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


def _sampled_pvalue(make_drafter, seed: int) -> float:
    """Chi-square p-value of the first three sampled tokens under a head drafter (3-wide trees, γ 2) against
    the exact joint distribution of a 6-token random target."""
    from draftwise.models.transformer import random_model
    from tests.conftest import TINY

    cfg = TINY.__class__(**{**TINY.to_dict(), "vocab_size": 6})
    target = random_model(cfg, seed=11)
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.0, max_tokens=4)
    exact = exact_joint(target, prompt, params)
    dec = Decoder(target, make_drafter(target), FixedGamma(2), rows=1, capacity=64)
    g = torch.Generator().manual_seed(seed)
    seqs = (Sequence(prompt, params, generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))))
            for _ in range(3000))
    return joint_pvalue(dec, seqs, exact)


def _untrained_medusa(target) -> MedusaDrafter:
    heads = MedusaHeads(HeadConfig("medusa", 2, target.config.hidden_size, list(range(6)), "tiny", "abc"))
    with torch.no_grad():
        heads.out.weight.copy_(target.lm_head.weight)
    return MedusaDrafter(heads.for_inference(), branches=3)


@pytest.mark.statistical
def test_medusa_sampled_distribution_matches_target():
    assert _sampled_pvalue(_untrained_medusa, 5) > 1e-3


def _add_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n" * 200)
    return [str(corpus)]


def test_train_save_load_and_target_check(tiny_target, tmp_path):
    corpus = _add_corpus(tmp_path)
    heads = train_medusa(tiny_target, ByteTokenizer(), target_name="tiny", target_sha="sha-of-tiny",
                         out=tmp_path / "heads", minutes=0.15, corpus=corpus, num_heads=2, vocab_size=64,
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
                         out=tmp_path / "heads", minutes=0.05, corpus=corpus, num_heads=2, vocab_size=64,
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


# ---- EAGLE-style head -----------------------------------------------------------------------------------

def _eagle(target, vocab=96, seed=0, scale=0.2) -> EagleHead:
    c = target.config
    head = EagleHead(HeadConfig("eagle", 3, c.hidden_size, list(range(vocab)), "tiny", "abc",
                                arch=eagle_arch(c.hidden_size, c.head_dim, c.rope_theta, c.rms_eps)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.out.weight.copy_(target.lm_head.weight[:vocab])
        for name, p in head.named_parameters():
            if p.dim() == 2 and name != "out.weight":
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return head


@pytest.mark.parametrize("gamma,branches", [(1, 1), (4, 1), (3, 2), (5, 4)])
def test_eagle_greedy_equals_plain(tiny_target, gamma, branches):
    params = SamplingParams(max_tokens=40)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    head = _eagle(tiny_target).for_inference()
    for rows in (1, 4):
        d = EagleDrafter(head, tiny_target.embed, branches=branches)
        seqs = run(tiny_target, d, PROMPTS, params, gamma=gamma, rows=rows)
        assert [s.output_ids for s in seqs] == ref
        assert sum(s.stats.drafted for s in seqs) > 0


def test_eagle_training_passes_see_what_drafting_sees(tiny_target):
    """Training-time test: pass 1 at position j equals the head's causal forward over the true context
    (the drafter's catch-up), and pass 2 at j equals a depth-2 row drafting sees: the true positions up to
    j-1 from the cache, then its own row fed pass 1's prediction made at j-1."""
    head = _eagle(tiny_target, scale=0.3).eval()
    C, D = 12, tiny_target.config.hidden_size
    g = torch.Generator().manual_seed(3)
    feat, emb = torch.randn(1, C, D, generator=g), torch.randn(1, C, D, generator=g)
    with torch.no_grad():
        p1, p2 = head.train_passes(feat, emb, 2)
        gg = head.inputs(feat, emb)
        q, k, v = head.qkv_rope(gg, torch.arange(C)[None])
        causal = torch.ones(C, C, dtype=torch.bool).tril()
        torch.testing.assert_close(head.finish(gg, q, k, v, causal), p1, atol=1e-4, rtol=1e-4)
        for j in range(1, C):
            g2 = head.inputs(p1[:, j - 1:j], emb[:, j:j + 1])  # (1, 1, D)
            q2, k2, v2 = head.qkv_rope(g2, torch.tensor([[j]]))
            keys, values = torch.cat([k[:, :, :j], k2], 2), torch.cat([v[:, :, :j], v2], 2)
            row = head.finish(g2, q2, keys, values, torch.ones(1, j + 1, dtype=torch.bool))
            torch.testing.assert_close(row[0, 0], p2[0, j], atol=1e-4, rtol=1e-4)  # a wrong mask: O(1) off


@pytest.mark.statistical
def test_eagle_sampled_distribution_matches_target():
    assert _sampled_pvalue(lambda t: EagleDrafter(_eagle(t, vocab=6, scale=0.1).for_inference(), t.embed,
                                                  branches=3), 6) > 1e-3


def test_train_eagle_then_decode(tiny_target, tmp_path):
    corpus = _add_corpus(tmp_path)
    head = train_eagle(tiny_target, ByteTokenizer(), target_name="tiny", target_sha="sha-of-tiny",
                       out=tmp_path / "eagle", minutes=0.12, corpus=corpus, num_heads=3, vocab_size=64,
                       log=lambda m: None, bar=False)
    acc = head.cfg.trained["held_out_top1"]
    assert len(acc) == 3 and acc[0] > 0.5 and acc[2] > 0.3, head.cfg.trained  # every depth learnt
    loaded = load_heads(tmp_path / "eagle", "sha-of-tiny")
    assert isinstance(loaded, EagleHead) and loaded.cfg.arch == head.cfg.arch
    params = SamplingParams(max_tokens=40)
    prompts = [[ord(c) % 96 for c in "def add(a, b):\n    return a + b\ndef "]]
    ref = [s.output_ids for s in run(tiny_target, None, prompts, params)]
    seqs = run(tiny_target, EagleDrafter(loaded.for_inference(), tiny_target.embed), prompts, params, gamma=4)
    assert [s.output_ids for s in seqs] == ref
    assert seqs[0].stats.accepted > 0.3 * seqs[0].stats.drafted  # a trained head is accepted
    with pytest.raises(InvalidParameterError, match="another kind"):  # medusa into an eagle folder
        train_medusa(tiny_target, ByteTokenizer(), target_name="tiny", target_sha="sha-of-tiny",
                     out=tmp_path / "eagle", minutes=0.02, corpus=corpus, num_heads=3, vocab_size=64,
                     log=lambda m: None, bar=False)


def test_pick_heads_by_kind(tiny_target, tmp_path):
    save_heads(_eagle(tiny_target), tmp_path / "e")
    save_heads(MedusaHeads(HeadConfig("medusa", 2, TINY_QWEN.hidden_size, list(range(96)), "tiny", "abc")),
               tmp_path / "m")
    both = f"{tmp_path / 'm'},{tmp_path / 'e'}"
    assert pick_heads(both, "eagle") == tmp_path / "e" and pick_heads(both, "medusa") == tmp_path / "m"
    with pytest.raises(InvalidParameterError, match="needs eagle heads"):
        pick_heads(str(tmp_path / "m"), "eagle")
    with pytest.raises(ModelNotFoundError):
        pick_heads(str(tmp_path / "nothing"), "eagle")
    with pytest.raises(InvalidParameterError):
        EagleDrafter(_eagle(tiny_target), tiny_target.embed, branches=0)


def test_default_heads_folder_end_to_end(hf_folder, tmp_path, monkeypatch, capsys):
    """`train-head` without --out writes the target's default heads folder; `--method eagle` without --heads
    uses it (and before any training says how to train them)."""
    from draftwise import SpeculativeDecoder
    from draftwise.cli import main
    from draftwise.heads import default_heads_dir, target_identity

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    dw = SpeculativeDecoder(str(hf_folder), draft=None, progress=False)
    params = SamplingParams(max_tokens=24, temperature=0)
    with pytest.raises(ModelNotFoundError, match="train-head --kind eagle"):
        dw.generate("def add(a, b):", params, method="eagle")
    assert main(["train-head", "--kind", "eagle", "--target", str(hf_folder), "--minutes", "0.1",
                 "--num-heads", "2", "--vocab-size", "64"]) == 0
    folder = default_heads_dir(hf_folder, target_identity(hf_folder), "eagle")
    assert folder.parent == tmp_path / "home" / "heads" and (folder / "config.json").is_file()
    assert str(folder) in capsys.readouterr().err
    ref = dw.generate("def add(a, b):", params, method="ar")
    out = dw.generate("def add(a, b):", params, method="eagle")
    assert out.token_ids == ref.token_ids and out.stats.drafted > 0
    with pytest.raises(ModelNotFoundError, match="train-head --kind medusa"):  # only eagle heads exist
        dw.generate("def add(a, b):", params, method="medusa")
