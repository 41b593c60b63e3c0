"""Self-distillation corpus (``train-head --corpus self``): the seed prompts, the records the target writes
(its exact greedy answers, with the hidden states and labels a full forward gives), and heads trained on them."""

from __future__ import annotations

import itertools

import pytest
import torch

from draftwise.drafters.eagle import EagleDrafter
from draftwise.errors import InvalidParameterError
from draftwise.heads import load_heads
from draftwise.sampling import SamplingParams
from draftwise.selfgen import SOFT_K, feature_taps, generate_features, seed_prompts
from draftwise.train_head import corpus_files, gather_features, train_eagle
from tests.test_decode import run


class ByteTokenizer:
    def __init__(self, eos=()):
        self.eos_ids = frozenset(eos)

    def encode(self, text: str) -> list[int]:
        return [b % 96 for b in text.encode()]


def test_seed_prompts_are_deterministic_varied_and_offline():
    a = list(itertools.islice(seed_prompts(0), 300))
    assert a == list(itertools.islice(seed_prompts(0), 300))
    assert a != list(itertools.islice(seed_prompts(1), 300))
    texts = [t for t, _ in a]
    assert len(set(texts)) > 290  # hardly a repeat
    assert any(t.startswith("def ") or "\ndef " in t for t in texts)  # code completion
    assert any(t.startswith(("Write a Python function", "Explain what")) for t in texts)  # code instructions
    assert any(t.startswith(("Summarize", "Translate", "Rewrite this paragraph")) for t in texts)  # prose
    assert any(t.startswith("Solve for x") or "How many" in t or "how far" in t for t in texts)  # arithmetic
    chat = sum(c for _, c in a) / len(a)
    assert 0.15 < chat < 0.35, chat  # a quarter through the chat template
    assert not any("spec_bench" in t.lower() for t in texts)


PROMPTS = ["def add(a, b):\n", "Hello there, ", "x = [1, 2, 3]\nfor ", "The sky is ", "import os\n"]


def _records(hidden, labels, tokens, valid, record):
    n = tokens.shape[0] // record
    for k in range(n):
        s = slice(k * record, (k + 1) * record)
        L = int(valid[s].sum())
        assert bool(valid[s][:L].all()) and not bool(valid[s][L:].any()), "a record is a prefix of real positions"
        assert (labels[s][L:] == -1).all()
        yield tokens[s][:L], labels[s][:L], hidden[s][:L]


@pytest.mark.parametrize("rows", [1, 3])
def test_records_are_the_targets_greedy_answers(tiny_target, rows):
    """Each record: a prompt, then exactly plain greedy decoding's tokens; labels are the argmax of a full
    forward over the record at every position (prompt positions included), hidden states its final states."""
    tok = ByteTokenizer()
    record = 48
    f = generate_features(tiny_target, tok, seconds=60, max_positions=7 * record, record=record, rows=rows,
                          prompts=((p, False) for p in itertools.cycle(PROMPTS)))
    hidden, labels, tokens, valid = f["hidden"], f["labels"], f["tokens"], f["valid"]
    taps = feature_taps(tiny_target.config.num_layers)
    assert f["taps"].shape == (hidden.shape[0], len(taps), hidden.shape[1])
    assert f["soft_ids"].shape == f["soft_logp"].shape == (hidden.shape[0], SOFT_K)
    seen = set()
    recs = list(_records(hidden, labels, tokens, valid, record))
    for k, (toks, labs, hid) in enumerate(recs):
        s = slice(k * record, k * record + len(toks))
        prompt = next(p for p in PROMPTS if toks[:len(tok.encode(p))].tolist() == tok.encode(p))
        P = len(tok.encode(prompt))
        seen.add(prompt)
        L = len(toks)
        assert L == record or k >= len(recs) - rows  # no end of sequence: records run to their end, but the
        # rows still live when the budget is spent end there
        ref = run(tiny_target, None, [tok.encode(prompt)], SamplingParams(max_tokens=record - P))[0].output_ids
        assert toks[P:].tolist() == ref[:L - P]
        assert labs[P - 1:-1].tolist() == toks[P:].tolist()  # along the answer: label t is token t+1
        cache = tiny_target.new_cache(1, record + 1)
        out = tiny_target.forward(toks[None], cache.view(slice(0, 1)), logits_for="all", taps=taps)
        assert out.logits[0].argmax(-1).tolist() == labs.tolist()
        torch.testing.assert_close(hid.float(), out.hidden[0].float(), atol=1e-2, rtol=1e-2)  # bf16 records
        torch.testing.assert_close(f["taps"][s].float(), out.taps[0].float(), atol=2e-2, rtol=1e-2)
        top = torch.log_softmax(out.logits[0], -1).topk(SOFT_K, -1)
        assert (f["soft_ids"][s][:, 0].long() == labs).all()  # the greedy token heads the top-k
        torch.testing.assert_close(f["soft_logp"][s].float(), top.values, atol=1e-2, rtol=1e-2)
    assert len(seen) >= 4


def test_records_stop_at_end_of_sequence(tiny_target):
    tok = ByteTokenizer()
    prompt = tok.encode(PROMPTS[0])
    ref = run(tiny_target, None, [prompt], SamplingParams(max_tokens=20))[0].output_ids
    eos = ref[5]
    first = ref.index(eos)
    f = generate_features(tiny_target, ByteTokenizer([eos]), seconds=60, max_positions=40, record=48, rows=2,
                          prompts=itertools.repeat((PROMPTS[0], False)))
    toks, labs, _ = next(_records(f["hidden"], f["labels"], f["tokens"], f["valid"], 48))
    P = len(prompt)
    assert len(toks) == P + first and toks[P:].tolist() == ref[:first]  # the answer up to its end ...
    assert labs[-1] == eos  # ... whose last label is the end of sequence


def test_generate_features_needs_a_budget(tiny_target):
    with pytest.raises(InvalidParameterError, match="budget"):
        generate_features(tiny_target, ByteTokenizer(), seconds=0, max_positions=100, record=32,
                          prompts=itertools.repeat((PROMPTS[0], False)))


def test_corpus_sources(tmp_path):
    assert corpus_files(["self"]) == [] and corpus_files(None) == []
    assert len(corpus_files(["stdlib"])) > 100
    (tmp_path / "a.txt").write_text("hello " * 50)
    assert corpus_files(["self", str(tmp_path)]) == [tmp_path / "a.txt"]


def test_gather_features_mixes_whole_records(tiny_target, tmp_path):
    (tmp_path / "a.py").write_text("def add(a, b):\n    return a + b\n" * 200)
    f = gather_features(tiny_target, ByteTokenizer(), ["self", str(tmp_path)], seconds=6, max_positions=20 * 256)
    n = f["hidden"].shape[0]
    assert n % 256 == 0 and f["labels"].shape == f["tokens"].shape == f["valid"].shape == (n,)
    assert f["taps"].shape[0] == f["soft_ids"].shape[0] == f["soft_logp"].shape[0] == n
    lens = f["valid"].view(-1, 256).sum(1)  # (records,)
    text = bytes(ByteTokenizer().encode(tmp_path.joinpath("a.py").read_text()))
    from_text = torch.tensor([bytes(r[:32].tolist()) in text for r in f["tokens"].view(-1, 256)])
    assert from_text.any() and not from_text.all(), "both sources present"
    assert (lens[from_text] == 256).all()  # text read: whole chunks
    assert (lens[~from_text] >= 4).all()
    unshuffled = torch.sort(from_text.int()).values.bool()  # every self-written record, then the text ones
    assert not torch.equal(from_text, unshuffled), "records of the two sources are shuffled together"


def test_train_eagle_on_its_own_answers(tiny_target, tmp_path):
    tok = ByteTokenizer()
    head = train_eagle(tiny_target, tok, target_name="tiny", target_sha="sha-of-tiny", out=tmp_path / "eagle",
                       minutes=0.15, corpus=["self"], num_heads=3, vocab_size=64, log=lambda m: None, bar=False)
    tr = head.cfg.trained
    assert tr["corpus"] == "self" and tr["positions"] > 1000, tr
    assert tr["held_out_top1"][0] > 0.5, tr  # the random target's own answers are learnable
    loaded = load_heads(tmp_path / "eagle", "sha-of-tiny")
    params = SamplingParams(max_tokens=40)
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    ref = [s.output_ids for s in run(tiny_target, None, prompts, params)]
    seqs = run(tiny_target, EagleDrafter(loaded.for_inference(), tiny_target.embed), prompts, params, gamma=4)
    assert [s.output_ids for s in seqs] == ref
    assert sum(s.stats.accepted for s in seqs) > 0.3 * sum(s.stats.drafted for s in seqs)


def test_training_refuses_the_benchmark_beside_self(tiny_target, tmp_path):
    bench = tmp_path / "spec_bench"
    bench.mkdir()
    (bench / "q.txt").write_text("x")
    with pytest.raises(InvalidParameterError, match="benchmark"):
        train_eagle(tiny_target, ByteTokenizer(), target_name="tiny", target_sha="x", out=tmp_path / "e",
                    minutes=0.1, corpus=["self", str(bench)], log=lambda m: None, bar=False)
    assert not (tmp_path / "e" / "features.safetensors").exists()
