"""Encoder-decoder models (T5, BART, Marian) through the hf backend, on tiny random models built here
(no checkpoint can be downloaded): greedy output of every method equals the model's own ``generate`` token
for token; prompt lookup drafts from the source; sampled output has the target's distribution; rollback;
bad input; the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from draftwise.api import SpeculativeDecoder
from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.base import Draft, StatelessDrafter
from draftwise.drafters.draft_model import DraftModelDrafter
from draftwise.drafters.pld import PromptLookupDrafter
from draftwise.errors import IncompatibleModelsError, InvalidParameterError, PromptTooLongError
from draftwise.models import load_model
from draftwise.models.base import ModelConfig
from draftwise.models.seq2seq import HFSeq2SeqLM
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence

FAMILIES = ("t5", "bart", "marian")
SPECIAL = ["<pad>", "</s>", "<unk>", "<s>"]  # ids 0..3 in every family here: pad, eos, unk, bos
TEXT = ["the quick brown fox jumps over the lazy dog", "a cat sat on the mat and the dog sat on the log",
        "translate english to german : the house is wonderful", "summarize : the fox and the dog are friends"]
SOURCES = ["the quick brown fox", "a cat sat on the mat", "summarize : the fox and the dog are friends"]
MAX_SOURCE = 64  # BART / Marian learned or sinusoidal positions


def save_tokenizer(folder, bos: bool) -> int:
    """A word-level tokenizer trained on TEXT, saved as an HF tokenizer folder; returns its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT, trainers.WordLevelTrainer(special_tokens=SPECIAL, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(  # BART: <s> text </s>; T5, Marian: text </s>
        single="<s> $A </s>" if bos else "$A </s>", special_tokens=[("<s>", 3), ("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   bos_token="<s>")
    fast.save_pretrained(str(folder))
    return len(fast)


def build(family: str, vocab: int, seed: int, layers: int = 2, d: int = 32):
    """A tiny random model of the family, initialized so its greedy text varies with the source (untied
    output embeddings, wider init) instead of repeating one token."""
    from transformers import (BartConfig, BartForConditionalGeneration, MarianConfig, MarianMTModel, T5Config,
                              T5ForConditionalGeneration)

    torch.manual_seed(seed)
    if family == "t5":
        m = T5ForConditionalGeneration(T5Config(
            vocab_size=vocab, d_model=d, d_kv=8, d_ff=2 * d, num_layers=layers, num_decoder_layers=layers,
            num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0, initializer_factor=5.0)).eval()
        with torch.no_grad():  # a weaker pull of the source, so that one source contains its own continuation
            for block in m.decoder.block:
                block.layer[1].EncDecAttention.o.weight.mul_(0.2)
        return m
    kw = dict(vocab_size=vocab, d_model=d, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=2 * d, decoder_ffn_dim=2 * d,
              max_position_embeddings=MAX_SOURCE, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
              init_std=0.1, pad_token_id=0, eos_token_id=1, forced_eos_token_id=None, tie_word_embeddings=False)
    if family == "bart":  # decoder prompt: </s> <s> (the start token, then the forced first token)
        m = BartForConditionalGeneration(BartConfig(**kw, bos_token_id=3, decoder_start_token_id=1)).eval()
        m.generation_config.forced_bos_token_id = 3
        return m
    m = MarianMTModel(MarianConfig(**kw, decoder_start_token_id=0)).eval()
    m.generation_config.bad_words_ids = [[0]]  # as Marian checkpoints: pad is never generated
    return m


SEEDS = {"t5": 1, "bart": 0, "marian": 1}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models this small run fastest on one thread (OpenMP's synchronisation costs more than their work)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (target folder, draft folder): saved as transformers saves them, one tokenizer each pair."""
    out = {}
    for family in FAMILIES:
        pair = []
        for name, kw in (("target", {}), ("draft", {"layers": 1, "d": 16})):
            folder = tmp_path_factory.mktemp(f"{family}-{name}")
            vocab = save_tokenizer(folder, bos=family == "bart")
            build(family, vocab, SEEDS[family] + (10 if kw else 0), **kw).save_pretrained(str(folder))
            pair.append(folder)
        out[family] = tuple(pair)
    return out


@pytest.fixture(scope="module")
def decoders(folders):
    """family -> SpeculativeDecoder (target + its smaller draft, both loaded from disk by the hf backend)."""
    return {f: SpeculativeDecoder(load_model(str(t), "fp32", backend="hf", progress=False),
                                  load_model(str(d), "fp32", backend="hf", progress=False), backend="hf")
            for f, (t, d) in folders.items()}


def reference(dw: SpeculativeDecoder, source: list[int], n: int) -> list[int]:
    """The model's own greedy ``generate``: its tokens after the decoder prompt."""
    model = dw.target.model
    with torch.inference_mode():
        out = model.hf.generate(torch.tensor([source]), max_new_tokens=n, do_sample=False, num_beams=1)
    prompt = model.decoder_prompt
    assert out[0, :len(prompt)].tolist() == prompt
    return out[0, len(prompt):].tolist()


def with_continuation(dw: SpeculativeDecoder, n: int = 10) -> list[int]:
    """A source that contains the model's own continuation: a text, then the greedy output of that very
    source (iterated to a fixed point), then </s>; the first of SOURCES where that point is reached with
    an output of 3 different tokens at least."""
    for text in SOURCES:
        base, source = dw.encode(text)[:-1], dw.encode(text)
        for _ in range(6):
            out = reference(dw, source, n)
            longer = base + [t for t in out if t != 1] + [1]
            if longer == source and len(set(out)) >= 3:
                return source
            source = longer
    raise AssertionError("no source contains its own continuation")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_generate(decoders, family):
    dw = decoders[family]
    N = 16
    sources = [dw.encode(s) for s in SOURCES] + [with_continuation(dw)]
    for source in sources:
        want = reference(dw, source, N)
        max_tokens = N - (len(dw.target.model.decoder_prompt) - 1)  # generate counts a forced token as new
        for method in ("ar", "pld", "nasd", "draft"):
            r = dw.generate(source, SamplingParams(max_tokens=max_tokens), method=method, gamma=3)
            assert r.token_ids == want, (family, method, source)
            if method != "ar":
                assert r.stats.drafted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_lookup_drafts_from_the_source(decoders, family):
    dw = decoders[family]
    source = with_continuation(dw)
    r = dw.generate(source, SamplingParams(max_tokens=12), method="pld", gamma=4)
    assert r.token_ids == reference(dw, source, 12 + len(dw.target.model.decoder_prompt) - 1)
    assert r.stats.accepted > 0
    # the first step drafts from the source alone: the same tokens without it give no draft
    tokens = list(dw.target.model.decoder_prompt) + r.token_ids[:1]
    drafts = []
    for seq in (Sequence(tokens, SamplingParams(), encoder_ids=source), Sequence(tokens, SamplingParams())):
        pld = PromptLookupDrafter()
        pld.start(seq)
        drafts.append(pld.propose([seq], [3])[0].tokens)
    assert drafts[0] and not drafts[1]
    seq = Sequence(tokens, SamplingParams(), encoder_ids=source)
    assert seq.lookup_context == source + seq.tokens
    plain = Sequence(tokens, SamplingParams())
    assert plain.lookup_context is plain.tokens  # decoder-only: unchanged


class Corrupting(StatelessDrafter):
    """Proposes the reference continuation with its second draft token changed: one rejection per step."""

    name = "corrupting"

    def __init__(self, reference: list[int], vocab: int):
        self.ref, self.vocab = reference, vocab

    def propose(self, seqs, ks):
        s, k = seqs[0], ks[0]
        d = self.ref[len(s.tokens):len(s.tokens) + k]
        if len(d) > 1:
            d[1] = (d[1] + 5) % self.vocab
        return [Draft(d)]


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_after_rejection_equals_fresh_run(decoders, family):
    dw = decoders[family]
    model = dw.target.model
    source = dw.encode(SOURCES[1])
    prompt = list(model.decoder_prompt)
    ref = prompt + reference(dw, source, 20)
    dec = Decoder(model, Corrupting(ref, model.config.vocab_size), FixedGamma(4), capacity=64)
    seq = Sequence(prompt, SamplingParams(max_tokens=30), encoder_ids=source)
    dec.add(seq)
    for _ in range(3):
        dec.step()
    assert seq.stats.drafted > seq.stats.accepted > 0 and seq.tokens == ref[:len(seq.tokens)]
    assert dec.cache.length() == len(seq.tokens) - 1
    after = model.forward(torch.tensor([seq.tokens[-1:]]), dec.cache).logits[0, -1]
    fresh = model.new_cache(1, 64)
    model.encode(fresh, source)
    want = model.forward(torch.tensor([seq.tokens]), fresh).logits[0, -1]
    torch.testing.assert_close(after, want, atol=1e-4, rtol=1e-4)


# ---- sampling: the target's distribution ---------------------------------------------------------------

def small_vocab_pair(family: str = "bart", vocab: int = 6):
    """A target and a draft over 6 tokens (no tokenizer needed), less peaked than the greedy models."""
    from transformers import BartConfig, BartForConditionalGeneration

    def make(seed, layers, d):
        torch.manual_seed(seed)
        m = BartForConditionalGeneration(BartConfig(
            vocab_size=vocab, d_model=d, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=2 * d, decoder_ffn_dim=2 * d, max_position_embeddings=32,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.05, pad_token_id=0,
            eos_token_id=1, bos_token_id=3, decoder_start_token_id=1, forced_eos_token_id=None,
            tie_word_embeddings=False)).eval()
        cfg = ModelConfig("hf", vocab, d, 2 * d, layers, 2, 2, d // 2, 0.0, 0.0, 32)
        return HFSeq2SeqLM(m, cfg, max_source=32)

    return make(21, 2, 16), make(22, 1, 8)


def exact_joint(model: HFSeq2SeqLM, source: list[int], params: SamplingParams) -> torch.Tensor:
    """Exact joint distribution (V, V) of the first two output tokens (enumeration, with rollback)."""
    from draftwise.sampling import logits_to_probs

    cache = model.new_cache(1, 16)
    model.encode(cache, source)
    prompt = model.decoder_prompt
    p0 = logits_to_probs(model.forward(torch.tensor([prompt]), cache, logits_for="last").logits[0, -1], params)
    joint = torch.zeros(p0.shape[0], p0.shape[0])
    for t in range(p0.shape[0]):
        cache.set_lengths(len(prompt))
        joint[t] = p0[t] * logits_to_probs(model.forward(torch.tensor([[t]]), cache).logits[0, -1], params)
    return joint


@pytest.mark.statistical
@pytest.mark.parametrize("method,seeded", [("draft", False), ("pld", False), ("draft", True)])
def test_sampled_output_follows_the_target(method, seeded):
    """The first two output tokens (the second from a verified draft) have the target's exact joint
    distribution (chi-square), for speculative sampling and for seeded (position-keyed) sampling."""
    from tests.test_decode import joint_pvalue

    target, draft = small_vocab_pair()
    source = [4, 5, 2, 4, 5, 2, 4, 5, 1]  # repeats: prompt lookup finds drafts in it
    params = SamplingParams(temperature=1.0, max_tokens=3)
    exact = exact_joint(target, source, params)
    drafter = DraftModelDrafter(draft, 1, 16) if method == "draft" else PromptLookupDrafter(min_ngram=1)
    dec = Decoder(target, drafter, FixedGamma(2), capacity=16)
    g = torch.Generator().manual_seed(7)
    seeds = torch.randint(1 << 30, (1500,), generator=g).tolist()
    seqs = (Sequence(list(target.decoder_prompt), SamplingParams(temperature=1.0, max_tokens=3, seed=s),
                     encoder_ids=source) if seeded else
            Sequence(list(target.decoder_prompt), params, encoder_ids=source,
                     generator=torch.Generator().manual_seed(s)) for s in seeds)
    assert joint_pvalue(dec, seqs, exact) > 1e-3


# ---- errors ----------------------------------------------------------------------------------------------

def test_bad_input(decoders, folders, hf_folder):
    dw = decoders["bart"]
    model = dw.target.model
    dec = Decoder(model, None, FixedGamma(2), capacity=64)
    prompt = list(model.decoder_prompt)
    with pytest.raises(InvalidParameterError, match="empty source"):
        dec.add(Sequence(prompt, SamplingParams(max_tokens=4), encoder_ids=[]))
    with pytest.raises(PromptTooLongError):
        dec.add(Sequence(prompt, SamplingParams(max_tokens=4), encoder_ids=[4] * (MAX_SOURCE + 1)))
    with pytest.raises(InvalidParameterError, match="source"):
        dec.add(Sequence(prompt, SamplingParams(max_tokens=4)))
    with pytest.raises(PromptTooLongError):
        dw.generate(" ".join(["fox"] * MAX_SOURCE), SamplingParams(max_tokens=4), method="ar")
    with pytest.raises(InvalidParameterError, match="chat"):
        dw.generate("the fox", SamplingParams(max_tokens=4), method="ar", chat=True)
    for method in ("beam", "lookahead", "auto"):
        with pytest.raises(InvalidParameterError, match="encoder-decoder|decoder-only"):
            dw.generate("the fox", SamplingParams(max_tokens=4), method=method)
    from draftwise.serve.engine import Engine, EngineConfig

    with pytest.raises(InvalidParameterError, match="decoder-only"):
        Engine(dw, EngineConfig(method="ar"))
    with pytest.raises(InvalidParameterError, match="--backend hf"):
        load_model(str(folders["t5"][0]), "fp32", backend="native", progress=False)
    decoder_only = load_model(str(hf_folder), "fp32", backend="hf", progress=False)
    with pytest.raises(InvalidParameterError, match="encoder-decoder"):
        Decoder(decoder_only.model, None, capacity=64).add(Sequence([5, 6], SamplingParams(), encoder_ids=[5]))
    with pytest.raises(IncompatibleModelsError, match="both"):
        SpeculativeDecoder(dw.target, decoder_only, backend="hf")
    other = load_model(str(folders["bart"][1]), "fp32", backend="hf", progress=False)
    other.model.config.vocab_size += 1  # same family, another vocabulary
    with pytest.raises(IncompatibleModelsError, match="tokenizer"):
        SpeculativeDecoder(dw.target, other, backend="hf")


# ---- the command line ------------------------------------------------------------------------------------

def test_cli_generate(folders, decoders, capsys):
    from draftwise.cli import main

    target, draft = folders["marian"]
    dw = decoders["marian"]
    want = reference(dw, dw.encode(SOURCES[2]), 8)
    for method in ("ar", "pld", "draft"):
        rc = main(["generate", "--backend", "hf", "--target", str(target), "--draft", str(draft), "--dtype", "fp32",
                   "--method", method, "--temperature", "0", "--max-tokens", "8", "--gamma", "3", "--threads", "1",
                   "--json", SOURCES[2]])
        out = json.loads(capsys.readouterr().out)
        assert rc == 0 and out["token_ids"] == want and out["text"] == dw.tokenizer.decode(want)
    assert main(["generate", "--backend", "hf", "--target", str(target), "--method", "ar", "--no-color",
                 "--threads", "1", "--max-tokens", "4", SOURCES[0]]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["generate", "--target", str(target), "--method", "ar", SOURCES[0]]) == 2
    assert "--backend hf" in capsys.readouterr().err


def test_python_tokenizer_without_a_rust_backend(folders):
    """Marian checkpoints ship a Python SentencePiece tokenizer (no ``backend_tokenizer``): encode, decode
    and the vocabulary go through it."""
    from transformers import AutoTokenizer

    from draftwise.models.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(folders["marian"][0]))

    class PythonOnly:  # the transformers tokenizer, minus its Rust backend
        def __getattr__(self, name):
            if name == "backend_tokenizer":
                raise AttributeError(name)
            return getattr(hf, name)

        def __len__(self):
            return len(hf)

    tok = Tokenizer.from_hf(PythonOnly())
    ids = tok.encode(SOURCES[1])
    assert ids == hf(SOURCES[1]).input_ids and tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.vocab_signature() == hf.get_vocab() and tok.vocab_size == len(hf) and tok.eos_ids == {1}
