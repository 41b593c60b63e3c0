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
from draftwise.selfgen import feature_taps
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

def _eagle(target, vocab=96, seed=0, scale=0.2, fused=False) -> EagleHead:
    c = target.config
    taps = feature_taps(c.num_layers) if fused else ()
    head = EagleHead(HeadConfig("eagle", 3, c.hidden_size, list(range(vocab)), "tiny", "abc",
                                arch=eagle_arch(c.hidden_size, c.head_dim, c.rope_theta, c.rms_eps, taps=taps)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.out.weight.copy_(target.lm_head.weight[:vocab])
        for name, p in head.named_parameters():
            if p.dim() == 2 and name != "out.weight":
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return head


@pytest.mark.parametrize("gamma,branches,fused", [(1, 1, False), (4, 1, False), (3, 2, False), (5, 4, False),
                                                   (4, 1, True), (3, 2, True)])
def test_eagle_greedy_equals_plain(tiny_target, gamma, branches, fused):
    params = SamplingParams(max_tokens=40)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    head = _eagle(tiny_target, fused=fused).for_inference()
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


def test_fused_eagle_drafts_from_the_target_layers_it_was_trained_on(tiny_target):
    """A head reading the target's inner layers (EAGLE-3 feature fusion): the decode loop hands the drafter
    the tapped layers' outputs, and its first draft is what training's pass 1 predicts from the same
    features; the taps matter (zeroing them changes the prediction)."""
    head = _eagle(tiny_target, fused=True, scale=0.5).eval()
    assert head.taps and EagleDrafter(head, tiny_target.embed).needs.feature_taps == head.taps
    prompt = [ord(c) % 96 for c in "def add(a, b):\n    return a"]
    cache = tiny_target.new_cache(1, 64)
    out = tiny_target.forward(torch.tensor([prompt]), cache.view(slice(0, 1)), logits_for="all", taps=head.taps)
    nxt = int(out.logits[0, -1].argmax())
    # head position j reads (f_j, x_{j+1}): j = 0 .. P-1 over the prompt and the target's next token
    feat, taps = out.hidden, out.taps  # (1, P, D), (1, P, taps, D)
    emb = tiny_target.embed(torch.tensor([prompt[1:] + [nxt]])).float()
    with torch.no_grad():
        want = int(head.vocab[head.logits(head.train_passes(feat, emb, 1, taps)[0][0, -1]).argmax()])
    drafter = EagleDrafter(head, tiny_target.embed, branches=1)
    dec = Decoder(tiny_target, drafter, rows=1, capacity=64)
    seq = Sequence(prompt, SamplingParams(max_tokens=8))
    dec.add(seq)
    assert seq.tokens[-1] == nxt
    draft = drafter.propose([seq], [1])[0]
    assert draft.tokens == [want]
    with torch.no_grad():
        zeroed = head.train_passes(feat, emb, 1, torch.zeros_like(taps))[0][0, -1]
        assert not torch.allclose(zeroed, head.train_passes(feat, emb, 1, taps)[0][0, -1])


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


def test_lr_schedule_warms_up_then_decays_by_a_cosine():
    from draftwise.train_head import WARMUP, lr_factor

    assert lr_factor(0, 0.0) == pytest.approx(1 / WARMUP)
    assert lr_factor(WARMUP, 0.0) == pytest.approx(1.0)
    assert lr_factor(10 * WARMUP, 0.5) == pytest.approx(0.55)
    assert lr_factor(10 * WARMUP, 1.0) == pytest.approx(0.1) == lr_factor(10 * WARMUP, 3.0)
    fr = [lr_factor(10 * WARMUP, x / 10) for x in range(11)]
    assert fr == sorted(fr, reverse=True)


def test_soft_targets_keep_the_draft_vocabulary_and_renormalise():
    """The target's top-k over the whole vocabulary -> draft-vocabulary ids and probabilities renormalised
    over the ones the draft vocabulary has; a position whose top-k has none carries no soft target."""
    from draftwise.train_head import soft_targets, token_loss

    to_draft = torch.full((10,), -1, dtype=torch.long)
    to_draft[torch.tensor([2, 5, 7])] = torch.tensor([0, 1, 2])
    ids = torch.tensor([[5, 3, 2], [9, 8, 4]], dtype=torch.int32)  # tokens 3, 9, 8, 4 are not drafted
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]])).half()
    d, p = soft_targets({"soft_ids": ids, "soft_logp": logp}, to_draft)
    assert d[0].tolist() == [1, 0, 0] and p[0].tolist() == pytest.approx([0.5 / 0.6, 0.0, 0.1 / 0.6], rel=1e-3)
    assert p[1].tolist() == [0.0, 0.0, 0.0]
    logits = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([1, -1])
    hard = torch.nn.functional.cross_entropy(logits, y, ignore_index=-1)
    assert token_loss(logits, y, d, p, 0.0) == pytest.approx(float(hard))
    soft = -(p[0] * torch.log_softmax(logits[0], -1)[d[0]]).sum()
    assert token_loss(logits, y, d, p, 1.0) == pytest.approx(float(soft), rel=1e-5)
    one_hot = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the greedy token alone: the hard loss
    assert token_loss(logits, y, d, one_hot, 0.7) == pytest.approx(float(hard), rel=1e-5)


@pytest.mark.parametrize("costly", [False, True])
def test_auto_chooses_between_a_fused_eagle_head_and_prompt_lookup(tiny_target, costly):
    """``auto`` with an EAGLE head (reading the target's inner layers) and a Medusa head beside prompt lookup:
    the loop asks for the taps auto's eagle child reads, each child gets the states it expects (started at
    the prefill even when priced as costly, i.e. only asked to draft when chosen), and the output is plain
    decoding's."""
    from draftwise.drafters.auto import AutoDrafter
    from draftwise.drafters.pld import PromptLookupDrafter

    params = SamplingParams(max_tokens=40)
    ref = [s.output_ids for s in run(tiny_target, None, PROMPTS, params)]
    c = tiny_target.config
    medusa = MedusaHeads(HeadConfig("medusa", 2, c.hidden_size, list(range(96)), "tiny", "abc"))
    with torch.no_grad():
        medusa.out.weight.copy_(tiny_target.lm_head.weight[:96])
    head = _eagle(tiny_target, fused=True, scale=0.05).for_inference()
    auto = AutoDrafter({"pld": PromptLookupDrafter(), "eagle": EagleDrafter(head, tiny_target.embed),
                        "medusa": MedusaDrafter(medusa.for_inference(), branches=1)}, lambda T: 1.0 + 0.01 * T,
                       draft_cost={"eagle": 1e-3, "medusa": 1e-3} if costly else None)
    assert auto.needs.prompt_hidden and auto.needs.feature_taps == head.taps and auto.needs.state_from_target
    for rows in (1, 3):
        seqs = run(tiny_target, auto, PROMPTS, params, gamma=3, rows=rows)
        assert [s.output_ids for s in seqs] == ref
    assert auto.chosen["eagle"] > 0 and auto.chosen["medusa"] + auto.chosen["pld"] > 0, auto.chosen
    if costly:
        assert auto.costly == ["eagle", "medusa"]
        from draftwise.heads import draft_seconds
        assert 0 < draft_seconds(auto.children["eagle"]) < 1 and 0 < draft_seconds(auto.children["medusa"]) < 1


def test_heads_draft_through_int8_weights():
    """A head's matrices for drafting are int8 groups of 32 (bf16 where the width does not split into
    groups): close to the float product — drafts need no bit-exactness, the target verifies them."""
    from draftwise.heads import drafting_linear
    from draftwise.kernels import QLinear, extension

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 96, generator=g), torch.randn(3, 96, generator=g)
    lin = drafting_linear(w)
    assert isinstance(lin, QLinear) and lin.bits == 8 and drafting_linear(w[:, :40]).bits == 16
    if extension() is not None:
        y = lin(x)
        assert (y - x @ w.t()).norm() < 0.02 * (x @ w.t()).norm()


@pytest.mark.parametrize("flat,width", [(True, 3), (False, 1)])
def test_head_methods_draft_trees_only_where_verifying_them_is_cheap(hf_folder, tmp_path, flat, width):
    """Without --tree-width, medusa / eagle draft EAGLE-2 trees on a CPU where a pass over a two-level tree
    costs about one token's (AMX), chains where every token fed costs (AVX2); --tree-width overrides."""
    from draftwise import SpeculativeDecoder
    from draftwise.api import AUTO_COST_SIZES, TREE_WIDTH, tree_options
    from tests.test_bench import tiny_heads

    dw = SpeculativeDecoder(str(hf_folder), None, dtype="fp32", progress=False)
    costs = {T: 0.01 * (1.0 if flat else T) for T in sorted({*AUTO_COST_SIZES, 1 + 2 * TREE_WIDTH, *range(1, 30)})}
    dw._target_costs.update(costs)  # as measured on such a machine
    heads = tiny_heads(hf_folder, tmp_path / "heads")
    for method in ("medusa", "eagle"):
        assert dw.make_drafter(method, 1, 64, **tree_options(method, None, heads)).branches == width
        assert dw.make_drafter(method, 1, 64, **tree_options(method, 2, heads)).branches == 2
