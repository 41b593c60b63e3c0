"""The benchmark harness: prompt parsing and filtering, aggregation, output checks, the written report
(JSON shape, markdown, plots), the roofline's byte count, CLI errors; end to end on the tiny HF folder
(every engine method and HF peer) and, marked slow, on SmolLM2 through the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import draftwise
from draftwise.api import METHODS
from draftwise.bench import report
from draftwise.bench.harness import BenchConfig, parse_gamma, parse_methods, run_bench
from draftwise.bench.peers import PEERS
from draftwise.bench.prompts import SPEC_BENCH_SHA256, default_prompts_path, load_prompts, read_jsonl, select
from draftwise.bench.roofline import measure_bandwidth, roofline, weight_bytes_per_token
from draftwise.cli import main
from draftwise.errors import InvalidParameterError
from draftwise.models.transformer import random_model

from .conftest import TINY

TASK_NAMES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
SHAPE_KEYS = {"tokens_per_s", "speedup_vs_ar", "acceptance_rate", "mean_accepted_length", "mismatches"}
PNGS = ("speedup_by_category.png", "tau_alpha.png", "tokens_per_s.png")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    rows = [{"question_id": 1, "category": "writing", "turns": ["hello world, the quick", "second turn"]},
            {"question_id": 2, "category": "coding", "turns": ["def quicksort(arr): return"]},
            {"question_id": 3, "category": "qa", "turns": ["the quick brown fox"]},
            {"question_id": 4, "category": "qa", "turns": ["hello hello hello world"]},
            {"question_id": 5, "category": "translation", "turns": ["the lazy dog jumps over the fox"]}]
    return write_jsonl(tmp_path / "q.jsonl", rows)


# ---- prompts -------------------------------------------------------------------------------------------
def test_prompts_first_turn_tasks_and_limit(prompts_file):
    ps = read_jsonl(prompts_file)
    assert ps[0].text == "hello world, the quick"  # first turn only
    assert [p.category for p in ps] == ["mt_bench", "mt_bench", "qa", "qa", "translation"]
    assert ps[1].subcategory == "coding"
    assert [p.question_id for p in select(ps, ["mt_bench", "translation"])] == [1, 2, 5]
    assert [p.question_id for p in select(ps, ["coding"])] == [2]  # a sub-category selects too
    assert [p.question_id for p in select(ps, limit=1)] == [1, 3, 5]  # per category (task)
    assert [p.question_id for p in select(ps, ["qa"], limit=5)] == [3, 4]


def test_prompt_errors(prompts_file, tmp_path):
    ps = read_jsonl(prompts_file)
    with pytest.raises(InvalidParameterError, match="unknown category 'nope'"):
        select(ps, ["qa", "nope"])
    with pytest.raises(InvalidParameterError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["x"]}\n')
    with pytest.raises(InvalidParameterError, match="bad.jsonl:1"):
        read_jsonl(bad)
    with pytest.raises(InvalidParameterError, match="--limit"):
        select(ps, limit=0)


def test_default_prompts_are_spec_bench():
    """Spec-Bench ships inside the package, unchanged (pinned sha256), with its licence beside it."""
    path = default_prompts_path()
    assert path.is_file() and path.is_relative_to(Path(draftwise.__file__).parent)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SPEC_BENCH_SHA256
    assert "Apache License" in (path.parent / "LICENSE").read_text()
    assert "hemingkx/Spec-Bench" in (path.parent / "NOTICE.md").read_text()
    used, ps = load_prompts(None)
    assert used == path and len(ps) == 480
    assert {c: sum(p.category == c for p in ps) for c in TASK_NAMES} == {c: 80 for c in TASK_NAMES}
    _, ps = load_prompts(None, ["mt_bench", "math_reasoning"], limit=2)
    assert [p.category for p in ps] == ["mt_bench"] * 2 + ["math_reasoning"] * 2


def test_parse_methods_and_gamma():
    assert parse_methods("pld,hf-ar") == ["ar", "pld", "hf-ar"]  # ar: the reference, always run
    assert parse_methods("all") == [*(m for m in METHODS if m not in ("medusa", "eagle")), *PEERS]
    assert parse_methods("draft,ar,draft") == ["draft", "ar"]
    with pytest.raises(InvalidParameterError, match="unknown method 'bogus'"):
        parse_methods("ar,bogus")
    assert parse_gamma("4") == 4 and parse_gamma("auto") == "auto"
    with pytest.raises(InvalidParameterError):
        parse_gamma("0")


# ---- aggregation and checks on hand-made records ------------------------------------------------------
def rec(tokens: list[int], wall: float, drafted: int = 0, accepted: int = 0, passes: int | None = None) -> dict:
    n = len(tokens)
    return {"token_ids": tokens, "new_tokens": n, "wall_s": wall, "tokens_per_s": n / wall, "drafted": drafted,
            "accepted": accepted, "target_passes": n if passes is None else passes, "prefill_s": 0.1 * wall,
            "draft_s": 0.2 * wall, "verify_s": 0.6 * wall}


def synthetic() -> list[dict]:
    ref = [1, 2, 3, 4]
    return [
        {"question_id": 1, "category": "a", "runs": {"ar": rec(ref, 2.0), "pld": rec(ref, 1.0, 4, 2, 2),
                                                      "hf-ar": rec(ref, 4.0), "hf-pld": rec(ref, 2.0, 2, 1, 3)}},
        {"question_id": 2, "category": "b", "runs": {"ar": rec(ref, 1.0), "pld": rec(ref, 2.0, 4, 0, 4),
                                                      "hf-ar": rec(ref, 1.0), "hf-pld": rec(ref, 1.0, 0, 0)}},
    ]


def test_aggregate_means_medians_alpha_tau():
    pp = synthetic()
    agg = report.aggregate(pp, ["ar", "pld", "hf-ar", "hf-pld"], [])
    ar, pld = agg["ar"], agg["pld"]
    assert ar["tokens_per_s"] == pytest.approx((2 + 4) / 2)
    assert pld["tokens_per_s"] == pytest.approx((4 + 2) / 2)
    assert pld["speedup_vs_ar"] == pytest.approx(1.0)  # ratio of mean tokens/s
    assert pld["median_speedup_vs_ar"] == pytest.approx((2.0 + 0.5) / 2)  # median of per-prompt ratios
    assert agg["hf-ar"]["speedup_vs_ar"] == pytest.approx((1 + 4) / 2 / 3)
    assert pld["speedup_vs_hf_ar"] == pytest.approx(3 / 2.5)
    assert ar["acceptance_rate"] is None and ar["mean_accepted_length"] == 1.0  # nothing drafted
    assert pld["acceptance_rate"] == pytest.approx(2 / 8)  # pooled accepted / drafted
    assert pld["mean_accepted_length"] == pytest.approx(8 / 6)  # pooled tokens / target passes
    assert pld["time_split"]["verify"] == pytest.approx(0.6)
    assert pld["by_category"]["a"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert pld["by_category"]["b"]["acceptance_rate"] == 0.0
    assert set(pld["by_category"]) == {"a", "b"}


def test_mismatch_detection_counts_a_wrong_result():
    pp = synthetic()
    methods = ["ar", "pld", "hf-ar", "hf-pld"]
    assert report.find_mismatches(pp, methods) == []
    pp[1]["runs"]["pld"]["token_ids"] = [1, 2, 9, 4]  # deliberately wrong
    pp[0]["runs"]["hf-pld"]["token_ids"] = [1, 2, 3]  # stopped early: a prefix is a mismatch too
    mm = report.find_mismatches(pp, methods)
    assert {(m["question_id"], m["method"], m["reference"], m["first_diff"]) for m in mm} == \
        {(2, "pld", "ar", 2), (1, "hf-pld", "ar", 3), (1, "hf-pld", "hf-ar", 3)}
    agg = report.aggregate(pp, methods, mm)
    assert agg["pld"]["mismatches"] == 1 and agg["pld"]["mismatch_ids"] == [2]
    assert agg["pld"]["by_category"]["a"]["mismatches"] == 0 and agg["pld"]["by_category"]["b"]["mismatches"] == 1
    assert agg["hf-pld"]["mismatches"] == 1 and agg["hf-pld"]["mismatches_vs_hf_ar"] == 1
    assert agg["ar"]["mismatches"] == 0


# ---- roofline -----------------------------------------------------------------------------------------
class FakeInt8Linear(nn.Module):
    """What a weight-only quantized layer looks like: int8 weights and bf16 scales in buffers."""

    def __init__(self, n: int, k: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(n, k, dtype=torch.int8))
        self.register_buffer("scales", torch.zeros(n, dtype=torch.bfloat16))


def test_weight_bytes_count_linears_and_head_not_embedding():
    m = random_model(TINY).to(torch.bfloat16)
    total = sum(p.numel() for p in m.parameters())
    got = weight_bytes_per_token(m)
    assert got["elements"] == total - m.embed.weight.numel()
    assert got["bytes"] == 2 * got["elements"]
    m.lm_head.weight = m.embed.weight  # tied: the head reads it, counted once
    assert weight_bytes_per_token(m)["elements"] == total - m.embed.weight.numel()
    down = m.layers[0].mlp.down
    m.layers[0].mlp.down = FakeInt8Linear(down.out_features, down.in_features)  # a quantized layer's own bytes
    q = weight_bytes_per_token(m)
    assert q["bytes"] == got["bytes"] - 2 * down.weight.numel() + down.weight.numel() + 2 * down.out_features
    assert q["bytes_by_dtype"]["int8"] == down.weight.numel()
    rf = roofline(m, 10.0, ar_tokens_per_s=1.0)
    assert rf["max_tokens_per_s"] == pytest.approx(10e9 / q["bytes"])
    assert rf["ar_percent_of_bound"] == pytest.approx(100 / rf["max_tokens_per_s"])


def test_measure_bandwidth_is_the_fastest_stream():
    """Both read streams are timed (torch's sum; the kernel's one-row matmul where it is built) and the bound is
    the faster one, named."""
    from draftwise.kernels import extension

    bw = measure_bandwidth(gib=0.0625, repeats=2)
    assert bw["bytes"] == 64 << 20 and bw["gb_per_s"] > 0
    assert len(bw["readings"]) == (2 if extension() is not None else 1)
    assert bw["gb_per_s"] == max(bw["readings"].values()) and bw["method"] in bw["readings"]


# ---- end to end ---------------------------------------------------------------------------------------
def check_outputs(out: Path, methods: list[str]) -> dict:
    res = json.loads((out / "results.json").read_text())
    assert list(res["methods"]) == methods
    for s in res["methods"].values():
        assert SHAPE_KEYS <= set(s) and isinstance(s["mismatches"], int)
        assert isinstance(s["tokens_per_s"], float) and isinstance(s["mean_accepted_length"], float)
        for sc in s["by_category"].values():
            assert SHAPE_KEYS <= set(sc)
    assert res["methods"]["ar"]["acceptance_rate"] is None and res["methods"]["ar"]["speedup_vs_ar"] == 1.0
    assert res["config"]["methods"] == methods
    md = (out / "report.md").read_text()
    assert "## Overall" in md and "| `ar` |" in md
    for f in PNGS:
        assert (out / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return res


def tiny_heads(folder, out, noise: float = 0.0):
    """Medusa and EAGLE heads (the EAGLE one reading the target's inner layers too) for the HF folder's
    model, tied to its weight files: "medusa,eagle". Untrained (the identity), or with ``noise`` added to
    their matrices (drafts accepted at times)."""
    import json

    from draftwise.heads import EagleHead, HeadConfig, MedusaHeads, eagle_arch, save_heads, target_identity
    from draftwise.selfgen import feature_taps

    c = json.loads((folder / "config.json").read_text())
    D, V, sha = c["hidden_size"], c["vocab_size"], target_identity(folder)
    hd = c.get("head_dim") or D // c["num_attention_heads"]
    g = torch.Generator().manual_seed(0)
    for name, head in (("medusa", MedusaHeads(HeadConfig("medusa", 2, D, list(range(V)), str(folder), sha))),
                       ("eagle", EagleHead(HeadConfig("eagle", 2, D, list(range(V)), str(folder), sha, arch=eagle_arch(
                           D, hd, c.get("rope_theta", 10000.0), 1e-6, taps=feature_taps(c["num_hidden_layers"])))))):
        with torch.no_grad():
            for p in head.parameters():
                if p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=g) * noise)
        save_heads(head, out / name)
    return f"{out / 'medusa'},{out / 'eagle'}"


def test_bench_tiny_every_method_and_peer(hf_folder, prompts_file, tmp_path):
    methods = [*(m for m in METHODS if m != "layerskip"), *PEERS]  # 2 layers: none to skip (test_layerskip)
    cfg = BenchConfig(target=str(hf_folder), draft=str(hf_folder), dtype="fp32", methods=methods,
                      prompts=str(prompts_file), limit=1, max_tokens=12, gamma="3", warmup_tokens=2,
                      bandwidth_gib=0.0625, heads=tiny_heads(hf_folder, tmp_path / "heads"))
    res = run_bench(cfg, progress=False)
    fp = res["footprint"]  # every own method, head methods included, measured in its fresh process
    assert all("error" not in fp[m] and fp[m]["new_tokens"] > 0 for m in methods if m in METHODS), fp
    report.write_outputs(res, tmp_path / "out")
    res = check_outputs(tmp_path / "out", methods)
    assert [p["category"] for p in res["per_prompt"]] == ["mt_bench", "qa", "translation"]
    assert set(res["methods"]["ar"]["by_category"]) == {"mt_bench", "qa", "translation"}
    for m in methods[:-len(PEERS)]:  # the engine is lossless: every greedy output equals ar's
        assert res["methods"][m]["mismatches"] == 0, res["mismatches"]
    runs = res["per_prompt"][0]["runs"]
    assert runs["draft"]["acceptance_rate"] == 1.0  # the target drafting for itself
    assert runs["hf-assisted"]["drafted"] > 0 and runs["hf-ar"]["drafted"] == 0
    assert res["methods"]["hf-ar"]["mean_accepted_length"] == pytest.approx(1.0)
    assert res["config"]["peers"]["hf-assisted"]["num_assistant_tokens"] == 3
    rf = res["roofline"]
    assert rf["weight_bytes_per_token"] > 0 and rf["ar_percent_of_bound"] > 0

    # a deliberately wrong output is caught and reported
    res["per_prompt"][1]["runs"]["pld"]["token_ids"][0] += 1
    mm = report.find_mismatches(res["per_prompt"], methods)
    res["methods"] = report.aggregate(res["per_prompt"], methods, mm)
    res["mismatches"] = mm
    report.write_outputs(res, tmp_path / "bad")
    assert json.loads((tmp_path / "bad" / "results.json").read_text())["methods"]["pld"]["mismatches"] == 1
    assert "| 3 | qa | `pld` | 0 |" in (tmp_path / "bad" / "report.md").read_text()


def test_bench_seeded_sampling_is_checked_against_ar(hf_folder, prompts_file, tmp_path):
    """With a temperature and a seed, draftwise's methods still equal `ar` token for token (and are
    checked); the peers sample with their own generators and are not compared."""
    methods = [*(m for m in METHODS if m != "layerskip"), "hf-ar"]  # 2 layers: none to skip
    cfg = BenchConfig(target=str(hf_folder), draft=str(hf_folder), dtype="fp32", methods=methods,
                      prompts=str(prompts_file), limit=1, max_tokens=12, gamma="3", warmup_tokens=2,
                      bandwidth_gib=0.0, temperature=0.9, seed=5, heads=tiny_heads(hf_folder, tmp_path / "heads"))
    res = run_bench(cfg, progress=False)
    assert res["config"]["outputs_checked"] and not res["config"]["peers_checked"]
    for m in methods[:-1]:
        assert res["methods"][m]["mismatches"] == 0, res["mismatches"]
    assert res["mismatches"] == []
    report.write_outputs(res, tmp_path / "out")
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Seeded sampled outputs vs `ar`\n\nEvery draftwise method equals `ar`" in text
    assert "Not compared: peers sample with their own generators." in text
    res["per_prompt"][0]["runs"]["nasd"]["token_ids"][3] += 1  # a wrong sampled output is caught
    assert report.find_mismatches(res["per_prompt"], METHODS)[0]["method"] == "nasd"


@pytest.mark.parametrize("argv, message", [
    (["--methods", "ar,bogus"], "unknown method 'bogus'"),
    (["--prompts", "/nonexistent/q.jsonl"], "not found"),
    (["--categories", "nope"], "unknown category 'nope'"),
    (["--gamma", "0"], "gamma must be >= 1"),
])
def test_cli_errors_are_one_line(argv, message, prompts_file, tmp_path, capsys):
    base = ["bench", "--prompts", str(prompts_file), "--out", str(tmp_path / "o")]
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


@pytest.mark.slow
def test_cli_end_to_end_smollm(tmp_path):
    """The real CLI on SmolLM2-135M: engine methods and an HF peer, all outputs written."""
    prompts = ["--categories", "mt_bench"]  # the shipped Spec-Bench
    out = tmp_path / "bench-out"
    rc = main(["bench", "--target", "smollm2-135m-instruct", "--draft", "smollm2-135m-instruct", *prompts,
               "--limit", "1", "--max-tokens", "16",
               "--methods", "ar,pld,hf-ar", "--threads", "2", "--out", str(out)])
    assert rc == 0
    res = check_outputs(out, ["ar", "pld", "hf-ar"])
    assert all(r["new_tokens"] == 16 or r["finish_reason"] == "stop"
               for p in res["per_prompt"] for r in p["runs"].values())
    assert res["roofline"]["max_tokens_per_s"] > 0


# ---- format agreement (draftwise agreement) --------------------------------------------------------------
def test_agreement_variants_and_comparison():
    from draftwise.bench.agreement import Variant, common_prefix, compare

    assert Variant.parse("gguf") == Variant("gguf", "int8")
    assert Variant.parse("int4:fp32") == Variant("int4", "fp32")
    assert Variant.parse("bf16") == Variant("bf16", "fp32")
    for bad in ("q3", "int4:int2"):
        with pytest.raises(InvalidParameterError):
            Variant.parse(bad)
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0
    r = compare([[1, 2, 3, 4], [5, 6]], [[1, 2, 3, 4], [5, 7]])
    assert r == {"identical": 0.5, "prefix_share": 0.75, "prompts": 2}


def test_agreement_command_on_a_tiny_model(hf_folder, prompts_file, tmp_path, capsys):
    """End to end: an int8-weight variant against the fp32 reference; the fp32 variant agrees with itself."""
    from draftwise.cli import main

    rc = main(["agreement", "--target", str(hf_folder), "--prompts", str(prompts_file), "--limit", "1",
               "--max-tokens", "6", "--variants", "int8:int8,int8:fp32,fp32", "--out", str(tmp_path / "a")])
    assert rc == 0
    res = json.loads((tmp_path / "a" / "agreement.json").read_text())
    assert set(res["variants"]) == {"fp32:fp32", "int8:int8", "int8:fp32"}
    assert res["variants"]["fp32:fp32"]["identical"] == 1.0
    assert all(0.0 <= v["prefix_share"] <= 1.0 and v["tokens_per_s"] > 0 for v in res["variants"].values())
    assert all(0.0 <= v["forced_top1"] <= 1.0 for v in res["variants"].values())
    # teacher forcing: a variant whose continuation is the reference's has every position right
    for v in res["variants"].values():
        assert v["identical"] < 1.0 or v["forced_top1"] == 1.0
    assert "identical continuations" in capsys.readouterr().out
    assert main(["agreement", "--target", str(hf_folder), "--variants", "q3"]) == 2


def test_the_commit_is_dirty_for_edits_to_code_not_to_documentation(tmp_path):
    """A report names the checkout's commit; "+dirty" only where what runs was edited (docs/ and *.md are not)."""
    import shutil
    import subprocess

    from draftwise.bench.harness import checkout_commit

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    assert checkout_commit(tmp_path) is None  # not a checkout (an installed wheel)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    (tmp_path / "docs").mkdir()
    for f in ("run.py", "README.md", "docs/results.json"):
        (tmp_path / f).write_text("1\n")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert checkout_commit(tmp_path) == head
    (tmp_path / "README.md").write_text("2\n")
    (tmp_path / "docs/results.json").write_text("2\n")
    (tmp_path / "new.py").write_text("untracked\n")
    assert checkout_commit(tmp_path) == head
    (tmp_path / "run.py").write_text("2\n")
    assert checkout_commit(tmp_path) == head + "+dirty"
