"""Layer-skip self-speculation (drafters/layerskip.py): the subset forward, the shared KV cache, losslessness
(greedy at batch > 1 with ragged acceptance, sampled by chi-square, seeded), calibration and its cache,
bad --skip-layers, and the CLI / server paths; SmolLM2 greedy equality on real weights (slow)."""

from __future__ import annotations

import copy
import json
import queue

import pytest
import torch

from draftwise.api import SpeculativeDecoder
from draftwise.decode import Decoder, FixedGamma
from draftwise.drafters.layerskip import (LayerSkipDrafter, calibrate, expected_speedup, format_layers, load_plan,
                                          parse_skip_layers, skip_candidates)
from draftwise.errors import InvalidParameterError
from draftwise.models import LoadedModel, load_model
from draftwise.models.base import ModelConfig
from draftwise.models.transformer import random_model
from draftwise.sampling import SamplingParams
from draftwise.sequence import Sequence
from tests.conftest import TINY_QWEN, make_hf_folder

SIX = ModelConfig(**{**TINY_QWEN.to_dict(), "num_layers": 6})
WEAK = (2, 3)  # layers whose residual updates are scaled down: skipping them changes the output a little
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [4], [10, 11, 12, 10, 11, 12, 10, 11, 30, 31]]
CAP = 160


def weak_model(cfg: ModelConfig = SIX, seed: int = 0, scale: float = 0.3):
    """A random model whose layers WEAK barely move the hidden state: skipping them gives drafts that are
    accepted often, not always (ragged acceptance)."""
    m = random_model(cfg, seed=seed)
    for i in WEAK:
        m.layers[i].attn.o.weight.mul_(scale)
        m.layers[i].mlp.down.weight.mul_(scale)
    return m


@pytest.fixture(scope="module")
def six():
    return weak_model()


def run(model, drafter, prompts, params, gamma=4, rows=1):
    dec = Decoder(model, drafter, FixedGamma(gamma), rows=rows, capacity=CAP)
    seqs = [Sequence(list(p), params) for p in prompts]
    dec.run(seqs)
    return seqs


# ---- the subset forward ----------------------------------------------------------------------------------
@pytest.mark.parametrize("skip", [(1,), (2, 3), (0, 5), (1, 2, 3, 4)])
def test_subset_forward_equals_model_without_those_layers(six, skip):
    """forward(layers=kept) gives the logits of a model built from the kept layers alone, prefill and
    decode steps (T = 1 and 3, batched rows of different lengths), writes K/V only for the kept layers,
    and those equal the smaller model's cache."""
    kept = tuple(i for i in range(6) if i not in skip)
    ref = copy.deepcopy(six)
    ref.layers = torch.nn.ModuleList([ref.layers[i] for i in kept])
    ref.config = ModelConfig(**{**SIX.to_dict(), "num_layers": len(kept)})
    cache, ref_cache = six.new_cache(2, 64), ref.new_cache(2, 64)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    for b, p in enumerate(PROMPTS[:2]):
        a = six.forward(torch.tensor([p]), cache.view(slice(b, b + 1)), layers=kept).logits
        r = ref.forward(torch.tensor([p]), ref_cache.view(slice(b, b + 1))).logits
        assert torch.equal(a, r)
    for T in (1, 3, 1):
        x = torch.randint(0, SIX.vocab_size, (2, T), generator=torch.Generator().manual_seed(T))
        assert torch.equal(six.forward(x, cache, layers=kept).logits, ref.forward(x, ref_cache).logits)
    assert cache.lengths.tolist() == ref_cache.lengths.tolist()
    for b in range(2):
        n = int(cache.lengths[b])
        assert torch.equal(cache.k[list(kept), b, :, :n], ref_cache.k[:, b, :, :n])
        assert torch.equal(cache.v[list(kept), b, :, :n], ref_cache.v[:, b, :, :n])
        assert cache.k[list(skip), b, :, :n].isnan().all()  # skipped layers: never written


def test_all_layers_is_the_plain_forward(six):
    c1, c2 = six.new_cache(1, 32), six.new_cache(1, 32)
    x = torch.tensor([PROMPTS[0]])
    assert torch.equal(six.forward(x, c1, layers=tuple(range(6))).logits, six.forward(x, c2).logits)


# ---- the shared cache -------------------------------------------------------------------------------------
def test_drafting_never_touches_the_targets_prefix(six):
    """A draft step writes only at or past each row's length and leaves the lengths as they were."""
    drafter = LayerSkipDrafter(six, WEAK)
    dec = Decoder(six, drafter, FixedGamma(5), rows=3, capacity=CAP)
    seqs = [Sequence(p, SamplingParams(max_tokens=40)) for p in PROMPTS[:3]]
    for s in seqs:
        dec.add(s)
    dec.step()
    lengths = dec.cache.lengths.clone()
    k, v = dec.cache.k.clone(), dec.cache.v.clone()
    drafts = drafter.propose(seqs, [5, 2, 0])
    assert [len(d.tokens) for d in drafts] == [5, 2, 0]
    assert torch.equal(dec.cache.lengths, lengths)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(dec.cache.k[:, b, :, :n], k[:, b, :, :n])
        assert torch.equal(dec.cache.v[:, b, :, :n], v[:, b, :, :n])
        assert not torch.equal(dec.cache.k[1, b, :, n], k[1, b, :, n])  # it did write past the length


def test_kept_layers_cache_is_the_full_models_after_steps(six):
    """After verification every layer's cache (kept ones included) holds the full model's K/V, equal to a
    fresh prefill of the same tokens."""
    dec = Decoder(six, LayerSkipDrafter(six, WEAK), FixedGamma(4), rows=2, capacity=CAP)
    seqs = [Sequence(p, SamplingParams(max_tokens=100)) for p in PROMPTS[:2]]
    for s in seqs:
        dec.add(s)
    for _ in range(6):
        dec.step()
    assert sum(s.stats.accepted for s in seqs) > 0
    for b, s in enumerate(seqs):
        n = len(s.tokens) - 1
        assert dec.cache.length(b) == n
        fresh = six.new_cache(1, CAP)
        six.forward(torch.tensor([s.tokens[:-1]]), fresh)
        torch.testing.assert_close(dec.cache.k[:, b, :, :n], fresh.k[:, 0, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dec.cache.v[:, b, :, :n], fresh.v[:, 0, :, :n], atol=1e-5, rtol=1e-5)


# ---- lossless ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("skip", [WEAK, (1, 4), (1, 2, 3, 4)])
def test_greedy_equals_plain_batched_ragged(six, gamma, skip):
    params = SamplingParams(max_tokens=40)
    ref = [s.output_ids for s in run(six, None, PROMPTS, params)]
    for rows in (1, 2, 4):
        out = run(six, LayerSkipDrafter(six, skip), PROMPTS, params, gamma=gamma, rows=rows)
        assert [s.output_ids for s in out] == ref, (rows, skip)
        assert all(s.stats.drafted > 0 for s in out)
        if skip == WEAK and rows == 4 and gamma > 1:
            rates = [s.stats.acceptance_rate for s in out]
            assert len(set(rates)) > 1 and 0 < min(rates) < 1  # ragged, partial acceptance


def test_seeded_equals_seeded_plain_for_every_gamma(six):
    for seed in (1, 2):
        params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=seed)
        ref = [s.output_ids for s in run(six, None, PROMPTS, params)]
        for gamma in (1, 4):
            out = run(six, LayerSkipDrafter(six, WEAK), PROMPTS, params, gamma=gamma, rows=4)
            assert [s.output_ids for s in out] == ref
            assert sum(s.stats.accepted for s in out) > 0


@pytest.mark.statistical
def test_sampled_output_distribution_matches_target():
    """Speculative sampling with the skipped model's q (model + shared cache + rollback): the joint
    distribution of the first three output tokens matches the target's exact one (chi-square, fixed seed)."""
    from tests.test_decode import exact_joint, joint_pvalue

    cfg = ModelConfig(**{**SIX.to_dict(), "vocab_size": 6})
    target = weak_model(cfg, seed=11, scale=0.5)
    prompt = [1, 2, 3]
    params = SamplingParams(temperature=1.0, max_tokens=4)
    exact = exact_joint(target, prompt, params)
    dec = Decoder(target, LayerSkipDrafter(target, WEAK), FixedGamma(3), rows=1, capacity=64)
    g = torch.Generator().manual_seed(2024)
    seqs = (Sequence(prompt, params, generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))))
            for _ in range(3000))
    assert joint_pvalue(dec, seqs, exact) > 1e-3


def test_sampled_drafts_carry_their_q(six):
    """Unseeded sampled rows draft from q and hand it to the verifier; greedy rows draft one-hot."""
    drafter = LayerSkipDrafter(six, WEAK)
    dec = Decoder(six, drafter, FixedGamma(3), rows=2, capacity=CAP)
    seqs = [Sequence(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=20)),
            Sequence(PROMPTS[1], SamplingParams(max_tokens=20))]
    for s in seqs:
        dec.add(s)
    d = drafter.propose(seqs, [3, 3])
    assert d[0].probs is not None and d[0].probs.shape == (3, SIX.vocab_size)
    assert torch.allclose(d[0].probs.sum(-1), torch.ones(3))
    assert all(float(d[0].probs[j, t]) > 0 for j, t in enumerate(d[0].tokens))
    assert d[1].probs is None


# ---- skip sets and calibration --------------------------------------------------------------------------------
def test_parse_skip_layers():
    assert parse_skip_layers("3,5,7-9", 12) == (3, 5, 7, 8, 9)
    assert parse_skip_layers(" 9 , 1-2,2", 12) == (1, 2, 9)
    assert parse_skip_layers([4, 1], 6) == (1, 4)
    assert format_layers((3, 5, 7, 8, 9)) == "3,5,7-9"


@pytest.mark.parametrize("spec,needle", [("12", "out of range"), ("3,40-41", "out of range"), ("0-11", "all 12"),
                                         ("", "expected layer indices"), ("a", "expected layer indices"),
                                         ("5-3", "empty range"), ([], "at least one"), ([True], "integer"),
                                         ("-1", "expected layer indices")])
def test_bad_skip_layers(spec, needle):
    with pytest.raises(InvalidParameterError, match=needle):
        parse_skip_layers(spec, 12)


def test_candidates_keep_first_and_last_layers():
    influence = [0.0, 0.3, 0.01, 0.02, 0.2, 0.05, 0.4, 0.0]
    cands = skip_candidates(influence, fractions=(0.25, 0.5))
    assert cands[0] == ("influence", (2, 3))
    assert ("influence", (2, 3, 4, 5)) in cands
    assert all(0 not in s and 7 not in s for _, s in cands)


def test_expected_speedup():
    cost = lambda T: 1.0 + 0.1 * (T - 1)  # noqa: E731  (verification nearly free)
    k, s = expected_speedup([0.0, 1.0, 2.0, 3.0], 0.1, cost)
    assert k == 3 and s == pytest.approx(4 / 1.6)
    k, s = expected_speedup([0.0, 0.1, 0.1], 0.9, cost)  # drafts rarely kept, costly: slower than plain
    assert s < 1


def test_calibration_finds_the_weak_layers(six):
    """The layers that barely move the hidden state rank lowest by influence, and the chosen set is the
    candidate with the best measured expected speedup."""
    plan = calibrate(six, [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [20, 21, 22, 23, 24, 25]],
                     lambda T: 1e-3 * (1 + 0.1 * (T - 1)), gen_tokens=20, depth=4)
    inner = sorted(range(1, 5), key=lambda i: plan.influence[i])
    assert set(inner[:2]) == set(WEAK)
    assert plan.speedup == max(c["speedup"] for c in plan.candidates)
    assert 0 not in plan.skip and 5 not in plan.skip and plan.skip
    assert plan.chains == 3 * 6  # rows x chains each: every 3rd of the 20 generated positions that leave 4
    chosen = next(c for c in plan.candidates if c["skip"] == plan.skip)
    assert chosen["accepted"][1] > 0.5 and len(chosen["accepted"]) == 5


def test_calibration_leaves_the_model_usable(six):
    """Calibration drafts in its own cache: decoding afterwards is unchanged."""
    params = SamplingParams(max_tokens=20)
    before = [s.output_ids for s in run(six, None, PROMPTS, params)]
    calibrate(six, [[1, 2, 3, 4]], lambda T: 1.0, gen_tokens=10, depth=3)
    assert [s.output_ids for s in run(six, None, PROMPTS, params)] == before


@pytest.fixture(scope="module")
def six_folder(tmp_path_factory):
    return make_hf_folder(tmp_path_factory.mktemp("tiny-six"), num_layers=6)


def test_plan_is_calibrated_once_and_cached(six_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    target = load_model(str(six_folder), "fp32", progress=False)
    dw = SpeculativeDecoder(target, None, progress=False)
    plan = dw.layerskip_plan()
    files = list((tmp_path / "layerskip").glob("*.json"))
    assert len(files) == 1 and plan.source == "calibrated" and plan.speedup is not None
    assert json.loads(files[0].read_text())["skip"] == plan.skip
    assert "layerskip: skipping" in capsys.readouterr().err
    assert dw.layerskip_plan() is plan  # once per process
    import draftwise.drafters.layerskip as ls

    monkeypatch.setattr(ls, "calibrate", lambda *a, **k: pytest.fail("calibrated twice"))
    again = SpeculativeDecoder(target, None, progress=False).layerskip_plan()  # a new process: read from disk
    assert again.skip == plan.skip
    assert "cached in" in capsys.readouterr().err
    assert load_plan(files[0], 7) is None  # another model's shape: not used
    given = SpeculativeDecoder(target, None, progress=False, skip_layers="1,3").layerskip_plan()
    assert given.skip == [1, 3] and given.source == "given" and 0 < given.draft_ratio


def test_generate_and_bad_input_through_the_api(six_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    target = load_model(str(six_folder), "fp32", progress=False)
    dw = SpeculativeDecoder(target, None, progress=False, skip_layers="2-3")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = dw.generate("def f(x):", params, method="ar", gamma=3)
    out = dw.generate("def f(x):", params, method="layerskip", gamma=3)
    auto = dw.generate("def f(x):", params, method="layerskip", gamma="auto")
    assert out.token_ids == ref.token_ids == auto.token_ids and out.stats.drafted > 0
    per_call = dw.generate("def f(x):", params, method="layerskip", gamma=2, drafter_options={"skip_layers": [4]})
    assert per_call.token_ids == ref.token_ids
    for bad in ("6", "0-5"):
        with pytest.raises(InvalidParameterError):
            SpeculativeDecoder(target, None, progress=False, skip_layers=bad).generate("x", params, method="layerskip")


def test_cli_layerskip_and_bad_skip_layers(capsys, six_folder, tmp_path, monkeypatch):
    from draftwise.cli import main

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    base = ["generate", "def f(x):", "--target", str(six_folder), "--max-tokens", "12", "--json"]
    assert main(base + ["--method", "ar"]) == 0
    ref = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(base + ["--method", "layerskip", "--skip-layers", "1,3-4"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["token_ids"] == ref and "[1,3-4]" in got.err
    for args, needle in ((["--skip-layers", "3,9"], "out of range"), (["--skip-layers", "0-5"], "all 6 layers"),
                         (["--skip-layers", "x"], "expected layer indices"),
                         (["--backend", "hf", "--dtype", "fp32"], "native backend")):
        try:
            code = main(base + ["--method", "layerskip", *args])
        except SystemExit as e:  # argparse-level errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and needle in err and "Traceback" not in err, (args, err)


def test_served_batches_equal_plain(six_folder, tmp_path, monkeypatch):
    """Through the server's engine: many requests of different lengths, ar and layerskip rows mixed in a
    4-row batch (ragged acceptance), each output equal to its prompt decoded alone."""
    import random

    from draftwise.serve.engine import Engine, EngineConfig

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    target = load_model(str(six_folder), "fp32", progress=False)
    weak = weak_model(ModelConfig(**{**target.config.to_dict()}), seed=4)
    dw = SpeculativeDecoder(LoadedModel("tiny-weak", weak, target.tokenizer, 0.0), None, progress=False,
                            skip_layers=list(WEAK))
    engine = Engine(dw, EngineConfig(method="layerskip", gamma=3, max_model_len=100, max_batch=4))
    rng = random.Random(2)
    engine.start()
    try:
        jobs = []
        for i in range(12):
            prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 10))]
            seq = engine.new_sequence(prompt, SamplingParams(max_tokens=rng.randrange(5, 30), ignore_eos=True),
                                      method=("layerskip", "ar")[i % 3 == 2])
            q: queue.Queue = queue.Queue()
            engine.submit(f"r{i}", [seq], q.put)
            jobs.append((seq, q))
        for seq, q in jobs:
            while q.get(timeout=60).finish_reason is None:
                pass
            alone = run(weak, None, [seq.prompt_ids], SamplingParams(max_tokens=seq.params.max_tokens,
                                                                      ignore_eos=True))[0]
            assert seq.output_ids == alone.output_ids
        rates = {s.stats.acceptance_rate for s, _ in jobs if s.stats.drafted}
        assert len(rates) > 1
    finally:
        engine.stop()


# ---- real weights --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm_greedy_equals_plain(smollm, tmp_path, monkeypatch):
    """SmolLM2-135M: layerskip's greedy output equals plain decoding, with a given set and with the set
    calibrated for it (into a fresh $DRAFTWISE_HOME), batched with ragged acceptance."""
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    dw = SpeculativeDecoder(smollm, None, progress=False)
    plan = dw.layerskip_plan()
    assert plan.source == "calibrated" and 0 < len(plan.skip) < smollm.config.num_layers
    prompts = [dw.encode(p) for p in ("def fibonacci(n):", "The capital of France is",
                                      "import numpy as np\n\ndef softmax(x):")]
    params = SamplingParams(max_tokens=40)
    model = smollm.model
    with torch.inference_mode():
        ref = [s.output_ids for s in run(model, None, prompts, params)]
        for skip in (plan.skip, list(range(10, 20))):
            out = run(model, LayerSkipDrafter(model, skip), prompts, params, gamma=4, rows=3)
            assert [s.output_ids for s in out] == ref, skip
            assert sum(s.stats.accepted for s in out) > 0
