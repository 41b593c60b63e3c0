"""What a bench run records about where it ran (CPU, kernel path, commit, the command that repeats it), and
the README's results picture (python -m draftwise.bench.compare)."""

from __future__ import annotations

import json
import shlex

import pytest

from draftwise.bench import compare, report
from draftwise.bench.harness import _provenance
from draftwise.bench.prompts import SPEC_BENCH_SHA256
from draftwise.cli import build_parser


def run(cpu: str, tok: dict[str, float], **cfg) -> dict:
    config = {"target": "qwen2.5-coder-1.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct", "dtype": "auto",
              "backend": "native", "gamma": "auto", "prompts": "/some/where/question.jsonl",
              "prompts_sha256": SPEC_BENCH_SHA256, "categories": list(report.SPEC_BENCH_TASKS), "limit": 2,
              "max_tokens": 128, "chat": False, "temperature": 0.0, "seed": None, "methods": list(tok),
              "footprint": True, "threads": 2, "n_prompts": 12, "cpu": cpu, "started": "2026-11-25T00:00:00",
              **cfg}
    return {"config": config, "methods": {m: {"tokens_per_s": v} for m, v in tok.items()}}


def test_bench_command_repeats_the_run_and_parses():
    cfg = run("x", {"ar": 1, "auto": 1, "draft": 1, "llama-pld": 1}, heads="/home/u/h/q-medusa,/home/u/h/q-eagle",
              footprint=False, categories=["qa"], max_tokens=64)["config"]
    cmd = report.bench_command(cfg)
    assert cmd == ("draftwise bench --categories qa --limit 2 --max-tokens 64 --methods ar,auto,draft,llama-pld "
                   "--heads q-medusa,q-eagle --no-footprint --threads 2")
    args = build_parser().parse_args(shlex.split(cmd)[1:])
    assert args.methods == "ar,auto,draft,llama-pld" and args.footprint is False and args.limit == 2
    other = dict(cfg, prompts_sha256="0" * 64, target="smollm2-135m-instruct", chat=True)
    cmd = report.bench_command(other)
    assert "--prompts question.jsonl" in cmd and "--target smollm2-135m-instruct" in cmd and "--chat" in cmd
    assert "/some/where" not in cmd and "--categories" not in cmd
    assert report.prompts_source(cfg) == "Spec-Bench" and report.prompts_source(other) == "`question.jsonl`"


def test_provenance_names_the_cpu_and_kernel_path():
    p = _provenance()
    assert p["cpu"] and p["isa"] and set(p) == {"cpu", "cpu_id", "isa", "isa_multi_row", "commit"}


def test_speedup_picture_from_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = tmp_path / "zen5" / "results.json"
    a.parent.mkdir()
    a.write_text(json.dumps(run("AMD EPYC", {"ar": 20.0, "auto": 26.0, "llama-ar": 30.0, "llama-pld": 18.0,
                                             "hf-pld": 18.0})))
    b = tmp_path / "b.json"
    b.write_text(json.dumps(run("", {"ar": 10.0, "pld": 11.0}, prompts_sha256="x")))
    out = tmp_path / "pic" / "speedup.png"
    assert compare.main([str(a.parent), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert compare.run_label(json.loads(a.read_text()), "f") == "AMD EPYC, 2026-11-25"
    assert compare.run_label(json.loads(b.read_text()), "f") == "f"
    with pytest.raises(SystemExit):
        compare.main([str(a.parent), "--label", "one", "--label", "two", "--out", str(out)])
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "missing"), "--out", str(out)])
    with pytest.raises(ValueError):
        report.speedup_plot([], out)
