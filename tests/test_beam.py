"""Beam search (draftwise/beam.py): the same tokens as transformers' ``generate(num_beams=N)`` on the same
weights and numerics — a tiny random Llama through the hf backend (fast), SmolLM2-135M (slow) — its cache
rows forked and reordered correctly on both backends, the CLI and the bench wiring, and its clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from draftwise import SamplingParams, SpeculativeDecoder
from draftwise.beam import beam_search
from draftwise.bench.harness import BenchConfig, run_bench
from draftwise.cli import main
from draftwise.errors import InvalidParameterError
from draftwise.models import load_model
from draftwise.models.base import KVCache

PROMPTS = ["def quicksort(arr):", "hello world, the quick"]


@pytest.fixture(autouse=True)
def one_thread(request):
    """Tiny models: one thread. A second one only adds synchronization to these small matmuls, which
    costs 10-100x when other processes share the cores."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def hf_beam(hf, ids: list[int], num_beams: int, length_penalty: float, max_new_tokens: int, eos,
            early_stopping=False) -> list[int]:
    """transformers' own beam search (num_beams 1: its greedy search) on the same model object."""
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      num_beams=num_beams, do_sample=False, length_penalty=length_penalty,
                      early_stopping=early_stopping, max_new_tokens=max_new_tokens, eos_token_id=sorted(eos),
                      pad_token_id=sorted(eos)[0])
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def tiny_hf(hf_folder) -> SpeculativeDecoder:
    return SpeculativeDecoder(load_model(str(hf_folder), "fp32", backend="hf", progress=False), None, progress=False)


@pytest.fixture(scope="module")
def tiny_native(hf_folder) -> SpeculativeDecoder:
    return SpeculativeDecoder(load_model(str(hf_folder), "fp32", progress=False), None, progress=False)


# ---- the cache: beams are rows ---------------------------------------------------------------------------
def test_kv_cache_reorder_rows_forks_and_keeps():
    c = KVCache(num_layers=2, rows=4, num_kv_heads=1, capacity=8, head_dim=2, dtype=torch.float32)
    for r in range(4):
        c.k[:, r], c.v[:, r] = float(r), -float(r)
    c.set_lengths([5, 5, 5, 5])
    c.k[:, :, :, :3] = 9.0  # a shared prefix: the same in every row
    c.reorder_rows([2, 0, 2, 3], start=3)  # row 0 <- 2 and row 1 <- 0 (a row that is itself overwritten)
    assert [float(c.k[0, r, 0, 4, 0]) for r in range(4)] == [2.0, 0.0, 2.0, 3.0]
    assert [float(c.v[1, r, 0, 3, 1]) for r in range(4)] == [-2.0, -0.0, -2.0, -3.0]
    assert float(c.k[:, :, :, :3].min()) == 9.0 and c.lengths.tolist() == [5, 5, 5, 5]
    c.set_lengths([0, 0, 0, 0])
    c.lengths[0] = 6  # the prompt prefilled into row 0 only, then forked into every row
    c.reorder_rows([0, 0, 0, 0])
    assert c.lengths.tolist() == [6, 6, 6, 6] and float(c.k[1, 3, 0, 4, 0]) == 2.0


def test_hf_cache_rows(tiny_hf):
    m = tiny_hf.target.model
    one = m.new_cache(1, 32)
    assert one.rows == 1 and one.view(slice(0, 1)) is one
    with pytest.raises(InvalidParameterError, match="one sequence at a time"):
        one.view(slice(0, 2))
    beams = m.new_cache(3, 32)
    m.forward(torch.tensor([[5, 6, 7]]), beams, logits_for="last")  # row 0 only
    beams.reorder_rows([0, 0, 0])
    assert beams.lengths.tolist() == [3, 3, 3] and beams.hf.get_seq_length() == 3
    out = m.forward(torch.tensor([[8], [9], [8]]), beams, logits_for="last").logits  # (3, 1, V)
    assert beams.lengths.tolist() == [4, 4, 4] and torch.equal(out[0], out[2])
    with pytest.raises(InvalidParameterError, match="one length"):
        ragged = m.new_cache(2, 32)
        ragged.lengths[1] = 1
        m.forward(torch.tensor([[1], [2]]), ragged)


# ---- equal to transformers' beam search ------------------------------------------------------------------
@pytest.mark.parametrize("num_beams, length_penalty", [(1, 1.0), (2, 1.0), (4, 1.0), (2, 0.0), (3, -1.0),
                                                       (4, 0.5), (4, 2.0)])
def test_beam_equals_transformers_tiny(tiny_hf, num_beams, length_penalty):
    """Token for token, with the model's EOS ids and with EOS ids that occur mid-way (the hypotheses then
    finish at different lengths, so the length penalty decides between them)."""
    model, hf = tiny_hf.target.model, tiny_hf.target.model.hf
    reasons = []
    for prompt in PROMPTS:
        ids = tiny_hf.tokenizer.encode(prompt)
        greedy = tiny_hf.generate(ids, SamplingParams(max_tokens=12), method="ar").token_ids
        for eos in (tiny_hf.tokenizer.eos_ids, {greedy[2]}, {greedy[4], greedy[9]}):
            with torch.inference_mode():
                r = beam_search(model, ids, SamplingParams(max_tokens=16), num_beams=num_beams,
                                length_penalty=length_penalty, eos_ids=frozenset(eos))
            assert r.token_ids == hf_beam(hf, ids, num_beams, length_penalty, 16, eos), (prompt, eos)
            reasons.append(r.finish_reason)
            assert r.stats.new_tokens == len(r.token_ids) and r.stats.target_passes <= 16
    assert "length" in reasons and ("stop" in reasons or length_penalty > 1.0)  # > 1: long ones are favoured


@pytest.mark.parametrize("early_stopping", [True, "never"])
def test_beam_early_stopping_equals_transformers_tiny(tiny_hf, early_stopping):
    model, hf = tiny_hf.target.model, tiny_hf.target.model.hf
    for prompt in PROMPTS:
        ids = tiny_hf.tokenizer.encode(prompt)
        greedy = tiny_hf.generate(ids, SamplingParams(max_tokens=12), method="ar").token_ids
        for n, lp in ((2, 1.0), (4, 2.0), (3, -1.0)):
            eos = {greedy[4], greedy[9]}
            with torch.inference_mode():
                r = beam_search(model, ids, SamplingParams(max_tokens=16), num_beams=n, length_penalty=lp,
                                early_stopping=early_stopping, eos_ids=frozenset(eos))
            assert r.token_ids == hf_beam(hf, ids, n, lp, 16, eos, early_stopping), (prompt, n, lp)


def test_beam_one_equals_greedy_and_library_front(tiny_hf):
    ids = tiny_hf.tokenizer.encode(PROMPTS[0])
    ar = tiny_hf.generate(ids, SamplingParams(max_tokens=20), method="ar")
    b1 = tiny_hf.generate(PROMPTS[0], SamplingParams(max_tokens=20), method="beam", num_beams=1)
    assert b1.token_ids == ar.token_ids and b1.method == "beam" and set(b1.kinds) == {"plain"}
    assert b1.text == tiny_hf.tokenizer.decode(b1.token_ids)
    assert b1.to_json()["stats"]["new_tokens"] == 20


# ---- native backend ----------------------------------------------------------------------------------------
def test_native_beam(tiny_native, tiny_hf):
    """Beam 1 is greedy decoding; N beams fork and reorder native cache rows, and give transformers' tokens
    on these weights (fp32 both: the two backends' greedy tokens agree on this model)."""
    for prompt in PROMPTS:
        ids = tiny_native.tokenizer.encode(prompt)
        ar = tiny_native.generate(ids, SamplingParams(max_tokens=24), method="ar")
        b1 = tiny_native.generate(ids, SamplingParams(max_tokens=24), method="beam", num_beams=1)
        assert b1.token_ids == ar.token_ids
        for n in (3, 4):
            nat = tiny_native.generate(ids, SamplingParams(max_tokens=24), method="beam", num_beams=n)
            assert nat.token_ids == hf_beam(tiny_hf.target.model.hf, ids, n, 1.0, 24, tiny_native.tokenizer.eos_ids)


@pytest.mark.parametrize("kwargs, params, needle", [
    ({"num_beams": 0}, {}, "num_beams must be an integer >= 1"),
    ({"num_beams": 2.5}, {}, "num_beams must be an integer >= 1"),
    ({"length_penalty": float("nan")}, {}, "length_penalty must be a finite number"),
    ({}, {"temperature": 0.7}, "beam search is greedy"),
    ({}, {"stop": ("\n",)}, "stop strings"),
])
def test_beam_bad_parameters(tiny_native, kwargs, params, needle):
    with pytest.raises(InvalidParameterError, match=needle):
        tiny_native.generate("hello", SamplingParams(max_tokens=4, **params), method="beam", **kwargs)


def test_beam_prompt_too_long(tiny_native):
    with pytest.raises(InvalidParameterError, match="does not fit the context"):
        tiny_native.generate([1] * 250, SamplingParams(max_tokens=10), method="beam")


# ---- CLI and bench -----------------------------------------------------------------------------------------
def test_cli_generate_beam(capsys, hf_folder, tiny_native):
    code = main(["generate", "hello world, the quick", "--target", str(hf_folder), "--dtype", "fp32", "--method",
                 "beam", "--num-beams", "4", "--max-tokens", "10", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    obj = json.loads(out)
    want = tiny_native.generate("hello world, the quick", SamplingParams(max_tokens=10), method="beam", num_beams=4)
    assert obj["method"] == "beam" and obj["token_ids"] == want.token_ids
    code = main(["generate", "hello world", "--target", str(hf_folder), "--dtype", "fp32", "--method", "beam",
                 "--max-tokens", "6", "--no-color"])
    assert code == 0 and "[beam] " in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "0.8"], "beam search is greedy"),
    (["--num-beams", "0"], "num_beams must be an integer >= 1"),
    (["--length-penalty", "inf"], "length_penalty must be a finite number"),
])
def test_cli_beam_errors(capsys, args, needle):
    code = main(["generate", "hello", "--target", "no-such-model-is-loaded", "--method", "beam", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("draftwise: error: ") and needle in err


def test_bench_beam_beside_ar(hf_folder, tmp_path):
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in
                                 enumerate([("qa", "the quick brown fox"), ("coding", "def quicksort(arr):")])))
    cfg = BenchConfig(target=str(hf_folder), draft=None, dtype="fp32", methods=["beam"], prompts=str(prompts),
                      max_tokens=8, warmup_tokens=2, bandwidth_gib=0, footprint=False, num_beams=3,
                      out=str(tmp_path / "out"))
    res = run_bench(cfg, progress=False)
    assert res["config"]["methods"] == ["ar", "beam"] and res["config"]["num_beams"] == 3
    beam = res["methods"]["beam"]
    assert beam["tokens_per_s"] > 0 and beam["mismatches"] is None and beam["speedup_vs_ar"] > 0
    assert res["mismatches"] == []  # beam is another search: never counted against ar
    from draftwise.bench import report

    md = report.markdown(res)
    assert "| `beam` |" in md and "not compared" in md
    with pytest.raises(InvalidParameterError, match="beam search is greedy"):
        run_bench(BenchConfig(target="not-loaded", methods=["beam"], temperature=0.5, prompts=str(prompts)),
                  progress=False)


# ---- real weights ------------------------------------------------------------------------------------------
REAL_PROMPTS = ["def fibonacci(n):", "The three primary colors are", "Question: What is 12 * 7?\nAnswer:"]


@pytest.mark.slow
def test_beam_equals_transformers_smollm():
    """SmolLM2-135M-Instruct (fp32, hf backend): draftwise's beam search equals transformers' on the same
    model object, 3 prompts x 32 new tokens, 4 beams (one of them ends with EOS)."""
    dw = SpeculativeDecoder(load_model("smollm2-135m-instruct", "fp32", backend="hf", progress=False), None,
                            progress=False)
    for prompt in REAL_PROMPTS:
        ids = dw.tokenizer.encode(prompt)
        r = dw.generate(ids, SamplingParams(max_tokens=32), method="beam", num_beams=4)
        assert r.token_ids == hf_beam(dw.target.model.hf, ids, 4, 1.0, 32, dw.tokenizer.eos_ids), prompt


@pytest.mark.slow
def test_native_beam_smollm(smollm):
    dw = SpeculativeDecoder(smollm, None, progress=False)
    ids = dw.tokenizer.encode(REAL_PROMPTS[0])
    ar = dw.generate(ids, SamplingParams(max_tokens=24), method="ar")
    assert dw.generate(ids, SamplingParams(max_tokens=24), method="beam", num_beams=1).token_ids == ar.token_ids
    b4 = dw.generate(ids, SamplingParams(max_tokens=24), method="beam", num_beams=4)
    assert 0 < len(b4.token_ids) <= 24 and b4.stats.target_passes <= 24
