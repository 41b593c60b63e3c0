"""The llama.cpp peers of ``draftwise bench`` (llama-ar, llama-pld). Without llama-cpp-python: a fake ``llama_cpp``
module whose ``Llama.generate`` runs llama-cpp-python's speculative loop on a deterministic toy "model", to
test the plumbing (token ids in, greedy settings, EOS, statistics, "matches own ar", the error when it is
missing, the install flags). Marked slow, when llama_cpp imports: llama-ar and llama-pld on SmolLM2's GGUF."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from draftwise.bench import report
from draftwise.bench.harness import BenchConfig, parse_methods, run_bench
from draftwise.bench.llama_peers import LLAMA_PEERS, LlamaPeers, context_size, require_llama_cpp, safe_cmake_args
from draftwise.cli import main
from draftwise.errors import InvalidParameterError

from .test_bench import prompts_file, rec, write_jsonl  # noqa: F401  (prompts_file: a fixture)

REPO = Path(__file__).resolve().parents[1]


def toy_next(seq: list[int]) -> int:
    """The toy model's greedy next token: a function of the last two tokens, never 0..9 (room for EOS ids)."""
    return 10 + (seq[-1] * 7 + (seq[-2] if len(seq) > 1 else 0) * 3) % 80


class FakePLD:
    """Stands in for LlamaPromptLookupDecoding: proposes the toy model's next tokens, the third one wrong, so
    every verify pass of 1 + k ≥ 3 tokens accepts exactly 2 drafts."""

    def __init__(self, max_ngram_size: int = 2, num_pred_tokens: int = 10):
        self.max_ngram_size, self.num_pred_tokens = max_ngram_size, num_pred_tokens

    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        seq, out = [int(t) for t in input_ids], []
        for i in range(self.num_pred_tokens):
            t = toy_next(seq) + (1 if i == 2 else 0)
            out.append(t)
            seq.append(t)
        return np.array(out, dtype=np.intc)


class FakeLlama:
    """The parts of llama_cpp.Llama the peers use; ``generate`` follows llama-cpp-python 0.3's loop (eval the
    pending tokens, sample from the first unsampled position, drop the rest of the drafts at a mismatch)."""

    instances: list[FakeLlama] = []
    next_token = staticmethod(toy_next)

    def __init__(self, model_path: str, **kw):
        self.model_path, self.kw = model_path, kw
        # llama-cpp-python 0.3.36 sizes its logits buffer from the logits_all *argument* (n_batch rows without
        # it) while a drafter turns logits_all on: prompts over 512 tokens then fail in eval
        self.rows = kw["n_ctx"] if kw.get("logits_all") else 512
        self.draft_model = kw.get("draft_model")
        self.input_ids: list[int] = []
        self.n_tokens = 0
        self.resets = 0
        self.calls: list[dict] = []  # generate's arguments per call
        self.closed = False
        FakeLlama.instances.append(self)

    def reset(self) -> None:
        self.n_tokens = 0
        self.resets += 1

    def eval(self, tokens) -> None:
        if self.draft_model is not None and self.n_tokens + len(tokens) > self.rows:
            raise ValueError("could not broadcast input array into shape (0,)")
        del self.input_ids[self.n_tokens:]
        self.input_ids += [int(t) for t in tokens]
        self.n_tokens += len(tokens)

    def generate(self, tokens, reset: bool = True, **kw):
        self.calls.append({"tokens": list(tokens), "reset": reset, **kw})
        assert self.n_tokens == 0, "the peer resets before every run (no prompt cache)"
        tokens = list(tokens)
        sample_idx = self.n_tokens + len(tokens) - 1
        while True:
            self.eval(tokens)
            while sample_idx < self.n_tokens:
                tok = self.next_token(self.input_ids[:sample_idx + 1])
                sample_idx += 1
                yield tok
                tokens = [tok]
                if sample_idx < self.n_tokens and tok != self.input_ids[sample_idx]:
                    self.n_tokens = sample_idx
                    break
            if self.draft_model is not None:
                tokens += [int(t) for t in self.draft_model(np.array(self.input_ids[:self.n_tokens] + tokens))]

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_llama(monkeypatch):
    """A fake ``llama_cpp`` (and ``llama_cpp.llama_speculative``) in sys.modules."""
    mod = types.ModuleType("llama_cpp")
    spec = types.ModuleType("llama_cpp.llama_speculative")
    spec.LlamaPromptLookupDecoding = FakePLD
    mod.Llama, mod.llama_speculative, mod.__version__ = FakeLlama, spec, "0.0-fake"
    mod.llama_print_system_info = lambda: b"CPU : AVX2 = 1 | FMA = 1 |"
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    FakeLlama.instances = []
    return mod


@pytest.fixture
def gguf(tmp_path) -> Path:
    p = tmp_path / "toy.gguf"
    p.write_bytes(b"GGUF")
    return p


def peers(gguf: Path, methods=LLAMA_PEERS, gamma: int | str = 4, eos=frozenset({3}), n_ctx: int = 4096) -> LlamaPeers:
    lp = LlamaPeers(gguf, list(methods), gamma, eos, threads=2)
    lp.load(n_ctx)
    return lp


def toy_greedy(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(toy_next(seq))
    return seq[len(prompt):]


# ---- the peer on a fake llama_cpp ----------------------------------------------------------------------
def test_ids_in_greedy_settings_and_contexts(fake_llama, gguf):
    lp = peers(gguf, gamma=5)
    ar, pld = lp.models["llama-ar"], lp.models["llama-pld"]
    for llm in (ar, pld):  # same file, context, threads; quiet
        assert llm.model_path == str(gguf)
        assert llm.kw["n_ctx"] == 4096 and llm.kw["n_threads"] == 2 and llm.kw["n_threads_batch"] == 2
        assert llm.kw["verbose"] is False
    assert "draft_model" not in ar.kw  # llama-ar: no logits_all, no drafter
    assert isinstance(pld.draft_model, FakePLD) and pld.kw["logits_all"] is True  # see FakeLlama.__init__
    assert (pld.draft_model.num_pred_tokens, pld.draft_model.max_ngram_size) == (5, 3)  # γ; n-grams ≤ 3 like pld
    prompt = [11, 12, 13, 11, 12]
    for m in LLAMA_PEERS:
        lp.generate(m, prompt, 8)
        lp.generate(m, prompt, 8)
        llm = lp.models[m]
        assert [c["tokens"] for c in llm.calls] == [prompt, prompt]  # the ids themselves, no re-tokenization
        assert llm.resets == 2  # a fresh KV cache each run: the prefill is always timed
        c = llm.calls[0]
        assert c["temp"] == 0.0 and c["top_k"] == 1 and c["repeat_penalty"] == 1.0  # pure greedy
        assert c["frequency_penalty"] == 0.0 and c["presence_penalty"] == 0.0 and c["min_p"] == 0.0
    s = lp.settings()
    assert s["llama-pld"]["num_pred_tokens"] == 5 and s["llama-ar"]["n_ctx"] == 4096
    assert s["llama_cpp"] == {"version": "0.0-fake", "system_info": "CPU : AVX2 = 1 | FMA = 1 |"}
    assert peers(gguf, gamma="auto").pld_tokens() == 10  # an adaptive γ: 10, like hf-pld


def test_statistics_and_lossless_fake(fake_llama, gguf):
    lp = peers(gguf, gamma=4)
    prompt = [11, 12, 13]
    ar = lp.generate("llama-ar", prompt, 12)
    assert ar.token_ids == toy_greedy(prompt, 12) and ar.finish_reason == "length"
    assert ar.target_passes == 12 and ar.drafted == 0 and ar.accepted == 0  # one pass per token; prefill first
    assert ar.wall_s >= ar.prefill_s + ar.verify_s and ar.past_eos == 0
    long = [10 + i % 50 for i in range(700)]  # longer than llama.cpp's n_batch (512)
    assert lp.generate("llama-pld", long, 4).token_ids == lp.generate("llama-ar", long, 4).token_ids
    pld = lp.generate("llama-pld", prompt, 12)
    assert pld.token_ids == ar.token_ids
    # prefill emits 1 token, each pass of 1 + 4 tokens 3 (2 drafts accepted): 1 + 3 + 3 + 3 + 2 (budget) = 12
    assert pld.target_passes == 5
    assert pld.drafted == 4 * 4 and pld.accepted == 12 - 5


def test_eos_stops_and_is_kept(fake_llama, gguf, monkeypatch):
    lp = peers(gguf, eos=frozenset({3, 4}))
    monkeypatch.setattr(FakeLlama, "next_token", staticmethod(lambda seq: 4 if len(seq) == 6 else toy_next(seq)))
    for m in LLAMA_PEERS:
        r = lp.generate(m, [11, 12, 13], 16)
        assert len(r.token_ids) == 4 and r.token_ids[-1] == 4 and r.finish_reason == "stop", m
        assert r.past_eos == 0


def test_context_and_errors(fake_llama, gguf, hf_folder):
    assert context_size(100, 8192) == 4096  # at least 4096
    assert context_size(5000, 32768) == 5120  # prompt + budget, rounded up to 256
    assert context_size(100, 2048) == 2048  # never above the model's context ...
    assert context_size(3000, 2048) == 3000  # ... unless the need is
    lp = peers(gguf, n_ctx=64)
    with pytest.raises(InvalidParameterError, match="context 64"):
        lp.generate("llama-ar", list(range(10, 60)), 32)
    first = lp.models["llama-ar"]
    lp.load(32)  # smaller: kept
    assert lp.models["llama-ar"] is first
    lp.load(128)  # larger: reloaded, the old contexts closed
    assert lp.n_ctx == 128 and first.closed and lp.models["llama-ar"] is not first
    with pytest.raises(InvalidParameterError, match="GGUF target"):
        LlamaPeers(hf_folder, ["llama-ar"], 4, frozenset(), 2)
    with pytest.raises(InvalidParameterError, match="unknown peer 'hf-ar'"):
        LlamaPeers(gguf, ["hf-ar"], 4, frozenset(), 2)


def test_parse_methods_with_llama():
    assert parse_methods("llama-pld") == ["ar", "llama-pld"]
    assert parse_methods("all") == parse_methods("ar,draft,draft-tree,pld,pld-tree,nasd,nasd-tree,suffix,auto,layerskip,lookahead,"
                                                 "hf-ar,hf-assisted,hf-pld")  # no llama; tree variants after their base
    assert parse_methods("all,llama-ar")[-1] == "llama-ar"
    with pytest.raises(InvalidParameterError, match="llama-draft"):
        parse_methods("llama-draft")  # llama-cpp-python has no separate-draft-model mode


# ---- missing llama-cpp-python ---------------------------------------------------------------------------
def test_missing_llama_cpp_is_one_clear_line(monkeypatch, prompts_file, tmp_path, capsys):  # noqa: F811
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp → ImportError
    with pytest.raises(InvalidParameterError, match=r'pip install .*-e "\.\[peers\]"'):
        require_llama_cpp(["llama-pld"])
    # the CLI says so before loading any model (the default target is not even fetched)
    rc = main(["bench", "--methods", "ar,llama-ar,llama-pld", "--prompts", str(prompts_file),
               "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "llama-ar, llama-pld need llama-cpp-python, which is not installed" in err
    assert "./install.sh --peers" in err and "-DGGML_AMX_TILE=OFF" in err and '-e ".[peers]"' in err


CPU_AVX2 = "processor\t: 0\nflags\t\t: fpu sse avx f16c fma avx2 bmi2 sha_ni\n"
CPU_SPR = ("flags\t\t: fpu avx avx2 fma f16c bmi2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni "
           "avx512vbmi avx512_bf16 amx_tile amx_int8 amx_bf16\n")


@pytest.mark.parametrize("cpuinfo, want, not_want", [
    (CPU_AVX2, "-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON", "AVX512"),
    (CPU_SPR, "-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON", "AMX_TILE=ON"),
    ("flags\t: fpu sse avx\n", "-DGGML_AVX=ON -DGGML_AVX2=OFF", "FMA"),
], ids=["avx2", "avx512-amx", "avx"])
def test_install_flags_python_and_install_sh_agree(cpuinfo, want, not_want, tmp_path):
    args = safe_cmake_args(cpuinfo)
    assert args.startswith("-DGGML_NATIVE=OFF") and want in args and not_want not in args
    assert args.endswith("-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF")  # always
    f = tmp_path / "cpuinfo"
    f.write_text(cpuinfo)
    script = f'source <(sed -n "/^llama_cmake_args()/,/^}}/p" {REPO / "install.sh"}); llama_cmake_args {f}'
    got = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    assert got == args


# ---- report: "matches own ar", peers apart from the engine's check -------------------------------------
def test_matches_own_ar_and_not_counted_as_draftwise():
    ref, other = [1, 2, 3, 4], [1, 2, 7, 4]
    pp = [{"question_id": q, "category": "a", "runs": {
        "ar": rec(ref, 2.0), "pld": rec(ref, 1.0, 4, 2, 2), "llama-ar": rec(other, 1.0),
        "llama-pld": rec(other if q == 1 else ref, 0.5, 4, 3, 2)}} for q in (1, 2)]
    methods = ["ar", "pld", "llama-ar", "llama-pld"]
    mm = report.find_mismatches(pp, methods)
    assert {(m["question_id"], m["method"], m["reference"]) for m in mm} == {
        (1, "llama-ar", "ar"), (2, "llama-ar", "ar"), (1, "llama-pld", "ar"), (2, "llama-pld", "llama-ar")}
    agg = report.aggregate(pp, methods, mm)
    lp = agg["llama-pld"]
    assert lp["own_reference"] == "llama-ar" and lp["matches_own_ar"] == 1 and lp["own_ar_prompts"] == 2
    assert lp["mismatches_vs_llama_ar"] == 1 and report.own_match(lp) == "1/2"
    assert "own_reference" not in agg["llama-ar"] and report.own_match(agg["llama-ar"]) == "–"
    assert lp["speedup_vs_llama_ar"] == pytest.approx(2.0) and agg["ar"]["speedup_vs_llama_ar"] == pytest.approx(0.5)
    assert agg["pld"]["mismatches"] == 0
    unchecked = report.aggregate(pp, methods, [], checked=False)["llama-pld"]  # sampling on: not a match count
    assert unchecked["matches_own_ar"] is None and report.own_match(unchecked) == "–"
    cfg = {"target": "t", "draft": "d", "dtype": "gguf", "gamma": 4, "max_tokens": 4, "temperature": 0.0,
           "chat": False, "n_prompts": 2, "prompts": "p", "threads": 2, "outputs_checked": True,
           "versions": {"torch": "x", "transformers": "y", "llama_cpp": "0.3.36"}}
    md = report.markdown({"methods": agg, "config": cfg, "mismatches": mm, "roofline": None})
    assert "Every draftwise method equals `ar` token for token." in md  # llama's differences are not draftwise's
    assert "| `llama-pld` | `llama-ar` | 1/2 | 1 |" in md
    assert "| 2 | a | `llama-pld` | `llama-ar` | 2 |" in md and "llama-cpp-python 0.3.36" in md
    assert "× llama-ar" in md and "matches own ar" in md


def test_bench_end_to_end_with_fake_llama(fake_llama, hf_folder, prompts_file, tmp_path, monkeypatch):  # noqa: F811
    """run_bench with the llama peers beside the engine (tiny HF model; the GGUF check is bypassed for it)."""
    monkeypatch.setattr("draftwise.bench.llama_peers.gguf_path", Path)
    methods = ["ar", "pld", "llama-ar", "llama-pld"]
    cfg = BenchConfig(target=str(hf_folder), draft=None, dtype="fp32", methods=methods, prompts=str(prompts_file),
                      limit=1, max_tokens=10, gamma="3", warmup_tokens=2, bandwidth_gib=0.0)
    res = run_bench(cfg, progress=False)
    out = tmp_path / "out"
    report.write_outputs(res, out)
    res = json.loads((out / "results.json").read_text())
    assert list(res["methods"]) == methods and res["methods"]["pld"]["mismatches"] == 0
    for p in res["per_prompt"]:
        for m in ("llama-ar", "llama-pld"):
            r = p["runs"][m]
            assert r["new_tokens"] == 10 and r["tokens_per_s"] > 0 and r["wall_s"] > 0 and r["text"]
        assert p["runs"]["llama-pld"]["token_ids"] == p["runs"]["llama-ar"]["token_ids"]
        assert p["runs"]["llama-ar"]["mean_accepted_length"] == 1.0
    lp = res["methods"]["llama-pld"]
    assert lp["matches_own_ar"] == lp["own_ar_prompts"] == 3  # the fake is lossless
    assert lp["mean_accepted_length"] > 1.0 and lp["acceptance_rate"] == pytest.approx(2 / 3)
    assert res["config"]["peers"]["llama-pld"]["num_pred_tokens"] == 3
    assert res["config"]["versions"]["llama_cpp"] == "0.0-fake"
    # every llama context was sized before the timed runs: the tiny model's 256 tokens
    assert {llm.kw["n_ctx"] for llm in FakeLlama.instances} == {256}
    md = (out / "report.md").read_text()
    assert "Every draftwise method equals `ar` token for token." in md and "| `llama-pld` | `llama-ar` | 3/3 |" in md


# ---- the real thing -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (./install.sh --peers)")
def test_llama_peers_on_smollm(smollm):
    """llama-ar and llama-pld on SmolLM2-135M's GGUF (from the registry), 16 tokens, 2 threads."""
    from draftwise.models.registry import resolve

    # > 512 tokens (llama.cpp's n_batch): the prefill is two chunks, a case llama-pld needs logits_all=True for
    ids = smollm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60 + "The quick brown fox")
    assert len(ids) > 512
    lp = LlamaPeers(resolve("smollm2-135m-instruct", progress=False), list(LLAMA_PEERS), 4,
                    smollm.tokenizer.eos_ids, threads=2)
    lp.load(context_size(len(ids) + 16, smollm.config.max_context))
    try:
        ar, pld = (lp.generate(m, ids, 16) for m in LLAMA_PEERS)
        for r in (ar, pld):
            assert 1 <= len(r.token_ids) <= 16 and r.wall_s > 0 and r.prefill_s > 0
            assert len(r.token_ids) == 16 or r.finish_reason == "stop"
            assert all(0 <= t < smollm.config.vocab_size for t in r.token_ids)
        assert ar.target_passes == len(ar.token_ids) and ar.drafted == 0
        assert pld.target_passes <= len(pld.token_ids)
        assert lp.settings()["llama_cpp"]["version"]
    finally:
        lp.close()
