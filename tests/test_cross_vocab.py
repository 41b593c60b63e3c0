"""Drafts from a model with another tokenizer (drafters/cross_vocab.py): greedy through text, sampling
through the shared vocabulary — lossless either way, batched, and a clear error where no bridge exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftwise import SamplingParams
from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.cross_vocab import CrossVocabDrafter, VocabBridge
from draftwise.errors import IncompatibleModelsError, InvalidParameterError
from draftwise.models.tokenizer import Tokenizer
from draftwise.models.transformer import random_model
from draftwise.sequence import Sequence
from tests.conftest import TINY, _byte_level_tokenizer, perturbed
from tests.test_cli import run_cli
from tests.test_decode import exact_joint, joint_pvalue

TEXTS = ["def quicksort(arr): return", "hello world, the quick", "the lazy dog jumps over", "é 中文 and more"]


SPECIALS = 3  # <|endoftext|>, <|im_start|>, <|im_end|>: ids 0-2 in every tokenizer here


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, Tokenizer]:
    """The target's byte-level BPE tokenizer (300 tokens) and two drafts' tokenizers: "subset", trained on
    the same text to 280 tokens (its vocabulary is a subset of the target's with the same ids, as BPE
    assigns merges in order; segmentations differ), and "permuted", the target's own vocabulary under
    other ids (same segmentation: drafts agree often)."""
    out = {}
    for name, v in (("target", 300), ("subset", 280)):
        folder = tmp_path_factory.mktemp(f"tok-{name}")
        _byte_level_tokenizer(folder, v)
        out[name] = Tokenizer.from_folder(folder)
    folder = tmp_path_factory.mktemp("tok-permuted")
    _byte_level_tokenizer(folder, 300)
    spec = json.loads((folder / "tokenizer.json").read_text())
    n = len(spec["model"]["vocab"])
    spec["model"]["vocab"] = {w: permuted(i, n) for w, i in spec["model"]["vocab"].items()}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    out["permuted"] = Tokenizer.from_folder(folder)
    return out


def permuted(i: int, n: int) -> int:
    """The permuted tokenizer's id of the target's token i (special tokens keep theirs)."""
    return i if i < SPECIALS else SPECIALS + (n - 1 - i)


@pytest.fixture(scope="module")
def models(toks):
    """The target, and a draft per tokenizer: the target's weights noised, their vocabulary rows cut to
    the subset's ("subset") or permuted ("permuted"), so a draft agrees with the target often, not always."""
    target = random_model(TINY.__class__(**{**TINY.to_dict(), "vocab_size": toks["target"].vocab_size}), seed=21)
    noisy = perturbed(target, 0.3, seed=22).state_dict()
    V = toks["target"].vocab_size
    order = torch.tensor(sorted(range(V), key=lambda i: permuted(i, V)))  # row j of the permuted draft = target row
    rows = {"subset": torch.arange(toks["subset"].vocab_size), "permuted": order}
    drafts = {}
    for name, keep in rows.items():
        draft = random_model(TINY.__class__(**{**TINY.to_dict(), "vocab_size": len(keep)}), seed=23)
        draft.load_state_dict({k: v[keep] if k in ("embed.weight", "lm_head.weight") else v for k, v in noisy.items()})
        drafts[name] = draft
    return target, drafts


def bridge(toks, name: str = "subset") -> VocabBridge:
    t_tok, d_tok = toks["target"], toks[name]
    return VocabBridge(t_tok, d_tok, t_tok.vocab_size, d_tok.vocab_size)


def decode(target, drafter, prompts, params, gamma=4, rows=1):
    dec = Decoder(target, drafter, FixedGamma(gamma) if drafter else None, rows=rows, capacity=128)
    seqs = [Sequence(p, params) for p in prompts]
    dec.run(seqs)
    return seqs


def test_bridge_maps_shared_tokens(toks):
    b = bridge(toks)
    t_tok, d_tok = toks["target"], toks["subset"]
    assert b.shared == d_tok.vocab_size  # every draft token is a target token here
    for t, d in zip(b.target_ids.tolist()[::17], b.draft_ids.tolist()[::17]):
        assert t_tok.decode([t], skip_special=False) == d_tok.decode([d], skip_special=False)
        assert int(b.to_draft[t]) == d
    assert int((b.to_draft < 0).sum()) == t_tok.vocab_size - d_tok.vocab_size
    p = bridge(toks, "permuted")
    V = t_tok.vocab_size
    assert p.shared == V and all(int(p.to_draft[i]) == permuted(i, V) for i in range(V))


def test_boundary_is_retokenized(toks):
    """The draft's text joins the target's last tokens: "quick" + "sort(arr)" comes out as the target's
    own tokens of "def quicksort(arr)", not "quick" followed by a standalone tokenization of "sort(arr)"."""
    t_tok = toks["target"]
    ids = t_tok.encode("def quick")
    assert ids + bridge(toks).target_tokens(ids, "sort(arr)") == t_tok.encode("def quicksort(arr)")


@pytest.mark.parametrize("name,gamma", [("permuted", 1), ("permuted", 3), ("subset", 3), ("subset", 6)])
def test_greedy_equals_plain_batched(toks, models, name, gamma):
    target, drafts = models
    prompts = [toks["target"].encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=24)
    plain = [s.output_ids for s in decode(target, None, prompts, params)]
    drafter = CrossVocabDrafter(drafts[name], bridge(toks, name), rows=3, capacity=128)
    seqs = decode(target, drafter, prompts, params, gamma=gamma, rows=3)
    assert [s.output_ids for s in seqs] == plain
    assert sum(s.stats.drafted for s in seqs) > 0  # (random models' text: acceptance on real weights below)


@pytest.mark.parametrize("name", ["permuted", "subset"])
def test_seeded_equals_plain_seeded(toks, models, name):
    target, drafts = models
    prompts = [toks["target"].encode(t) for t in TEXTS]
    params = SamplingParams(temperature=0.9, max_tokens=20, seed=7)
    plain = [s.output_ids for s in decode(target, None, prompts, params)]
    drafter = CrossVocabDrafter(drafts[name], bridge(toks, name), rows=2, capacity=128)
    seqs = decode(target, drafter, prompts, params, gamma=3, rows=2)
    assert [s.output_ids for s in seqs] == plain
    assert sum(s.stats.drafted for s in seqs) > 0


def test_sampled_drafts_are_shared_tokens_drawn_from_q(toks, models):
    """A sampled row's draft tokens are target ids of shared tokens, each with its q (V_t,) summing to one,
    zero outside the shared vocabulary, and the drawn token has q > 0."""
    target, drafts = models
    b = bridge(toks)
    drafter = CrossVocabDrafter(drafts["subset"], b, rows=1, capacity=128)
    for seed in range(20):  # a first token ending inside a character drafts nothing: take one that does not
        dec = Decoder(target, drafter, FixedGamma(4), rows=1, capacity=128)
        seq = Sequence(toks["target"].encode(TEXTS[0]), SamplingParams(temperature=1.0, max_tokens=30),
                       generator=torch.Generator().manual_seed(seed))
        dec.add(seq)
        d = drafter.propose([seq], [4])[0]
        if d.tokens:
            break
        dec.abort(seq)
    assert len(d.tokens) == 4 and d.probs.shape == (4, toks["target"].vocab_size)
    assert torch.allclose(d.probs.sum(-1), torch.ones(4))
    assert float(d.probs[:, b.to_draft < 0].sum()) == 0.0
    assert all(float(d.probs[i, t]) > 0 for i, t in enumerate(d.tokens))


@pytest.mark.statistical
@pytest.mark.parametrize("name", ["permuted", "subset"])
def test_sampled_output_distribution_matches_target(toks, models, name):
    """Chi-square of the first three output tokens against the target's exact joint (the second and third
    come from verified drafts): the shared-vocabulary route keeps the target's distribution, with a draft
    over the same tokens and with one that lacks 20 of them."""
    target, drafts = models
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4)
    prompt = toks["target"].encode("the quick brown")
    exact = exact_joint(target, prompt, params)  # (V,) * 3
    drafter = CrossVocabDrafter(drafts[name], bridge(toks, name), rows=1, capacity=64)
    dec = Decoder(target, drafter, FixedGamma(3), rows=1, capacity=64)
    g = torch.Generator().manual_seed(3)
    seqs = [Sequence(prompt, params, generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))))
            for _ in range(3000)]
    assert joint_pvalue(dec, seqs, exact) > 1e-3
    assert sum(s.stats.accepted for s in seqs) > 0


def test_long_prompt_for_the_draft_drafts_nothing(toks, models):
    """A context the draft's cache cannot hold: the row drafts nothing and the output is still exact."""
    target, drafts = models
    prompts = [toks["target"].encode(t) for t in TEXTS[:2]]
    params = SamplingParams(max_tokens=12)
    plain = [s.output_ids for s in decode(target, None, prompts, params)]
    drafter = CrossVocabDrafter(drafts["permuted"], bridge(toks, "permuted"), rows=2, capacity=128)
    drafter.capacity = 8  # smaller than the first prompt in the draft's tokens
    seqs = decode(target, drafter, prompts, params, gamma=3, rows=2)
    assert [s.output_ids for s in seqs] == plain


def test_tree_refused(toks, models):
    with pytest.raises(InvalidParameterError, match="tree"):
        CrossVocabDrafter(models[1]["subset"], bridge(toks), rows=1, capacity=64, branches=3)


def _word_level_folder(folder: Path) -> Path:
    """A model folder whose tokenizer is word-level with [UNK]: it loses text, nothing to bridge to."""
    from tokenizers import Tokenizer as Rust, models as tm, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import make_hf_folder

    make_hf_folder(folder, vocab_size=280, seed=5)
    words = ["[UNK]", "<|im_end|>", "hello", "world", "def", "quicksort"]
    tok = Rust(tm.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    for f in folder.glob("*token*"):
        f.unlink()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>").save_pretrained(str(folder))
    return folder


def test_unbridgeable_vocabulary_is_a_clear_error(capsys, tmp_path, hf_folder):
    bad = _word_level_folder(tmp_path / "wordlevel")
    with pytest.raises(IncompatibleModelsError, match="cannot be bridged"):
        VocabBridge(Tokenizer.from_folder(hf_folder), Tokenizer.from_folder(bad), 300, 280)
    code, _, err = run_cli(capsys, "generate", "hi", "--target", str(hf_folder), "--draft", str(bad), "--method", "draft")
    assert code == 2 and "cannot be bridged" in err and "Traceback" not in err


def test_cli_and_api_with_another_tokenizer(capsys, hf_folder, hf_folder_other_vocab):
    ids = {}
    for method in ["ar", "draft"]:
        code, out, err = run_cli(capsys, "generate", "hello world", "--target", str(hf_folder), "--draft",
                                 str(hf_folder_other_vocab), "--method", method, "--max-tokens", "16", "--json",
                                 "--gamma", "3")
        assert code == 0, err
        ids[method] = json.loads(out)["token_ids"]
        assert json.loads(out)["stats"]["drafted"] > 0 or method == "ar"
    assert ids["draft"] == ids["ar"]
    code, _, err = run_cli(capsys, "generate", "hello", "--target", str(hf_folder), "--draft",
                           str(hf_folder_other_vocab), "--method", "draft-tree")
    assert code == 2 and "tree" in err


@pytest.mark.slow
def test_text_route_accepts_on_real_text(smollm):
    """SmolLM2 drafting for itself through the bridge (text out, re-tokenized back in; sampled rows in the
    shared vocabulary): real text re-tokenizes to what the target emitted, so nearly every draft is kept —
    the context, rollback and boundary handling lose nothing. Output equals plain decoding."""
    tok, model = smollm.tokenizer, smollm.model
    b = VocabBridge(tok, tok, model.config.vocab_size, model.config.vocab_size)
    prompts = [tok.apply_chat([{"role": "user", "content": c}]) for c in
               ("Write a Python function that reverses a string.", "List three French words for food, then translate.")]
    for params in (SamplingParams(max_tokens=48), SamplingParams(max_tokens=48, temperature=0.7, seed=11)):
        plain = [s.output_ids for s in decode(model, None, prompts, params)]
        dec = Decoder(model, CrossVocabDrafter(model, b, rows=2, capacity=256), FixedGamma(4), rows=2, capacity=256)
        seqs = [Sequence(p, params) for p in prompts]
        dec.run(seqs)
        assert [s.output_ids for s in seqs] == plain
        drafted, accepted = sum(s.stats.drafted for s in seqs), sum(s.stats.accepted for s in seqs)
        assert accepted > 0.7 * drafted and drafted > 20, (params, accepted, drafted)


@pytest.mark.qwen
def test_smollm_drafts_for_qwen():
    """The real pair: SmolLM2-135M (49152 tokens) drafting for Qwen2.5-Coder-1.5B (151936): greedy output
    equals plain decoding, also on text with characters the draft's vocabulary splits differently."""
    from draftwise import SpeculativeDecoder

    dw = SpeculativeDecoder(draft="smollm2-135m-instruct", progress=False)
    assert dw.bridge is not None and dw.bridge.shared > 30000
    for prompt, chat in [("def quicksort(arr):", False), ("Translate to Chinese and French: good morning, friend.", True)]:
        params = SamplingParams(max_tokens=48)
        ar = dw.generate(prompt, params, method="ar", chat=chat)
        r = dw.generate(prompt, params, method="draft", gamma=4, chat=chat)
        assert r.token_ids == ar.token_ids, prompt
        assert r.stats.accepted > 0
    seeded = SamplingParams(max_tokens=32, temperature=0.8, seed=3)
    assert dw.generate("def fib(n):", seeded, method="draft", gamma=3).token_ids == \
        dw.generate("def fib(n):", seeded, method="ar").token_ids
