"""``draftwise bench``: methods and peers on a prompt set; writes results.json, report.md and plots
(the run itself: bench/harness.py)."""

from __future__ import annotations

import argparse

from ..bench import report
from ..bench.harness import DEFAULT_METHODS, BenchConfig, all_methods, parse_gamma, parse_methods, run_bench
from ..outputs import out_folder
from . import common

HELP = "benchmark methods and HF peers on a prompt set; write results.json, report.md and plots"


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_model_args(p, 0, ": every method prefills each prompt, as the peers do", disk=False)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {', '.join(all_methods())}, or all (default "
                        f"{','.join(DEFAULT_METHODS)}); "
                        "ar is always run as the reference; all = the engine's methods and the HF peers, the "
                        "llama.cpp peers (pip install -e '.[peers]') only by name")
    p.add_argument("--gamma", default="auto", help="draft tokens per step: an integer, or auto (default)")
    p.add_argument("--prompts", default=None, help="Spec-Bench-shaped JSONL (question_id, category, turns); "
                                                   "default: Spec-Bench's 480 prompts, shipped with draftwise")
    p.add_argument("--categories", default=None, help="comma-separated categories (e.g. mt_bench,math_reasoning)")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); outputs are checked against ar when greedy or seeded")
    p.add_argument("--seed", type=int, default=None, help=common.SEED_HELP)
    p.add_argument("--warmup-tokens", type=int, default=8, help="tokens of the untimed warm-up run per method")
    p.add_argument("--bandwidth-gib", type=float, default=0.5,
                   help="GiB streamed to measure memory bandwidth for the roofline (0 = skip)")
    p.add_argument("--no-footprint", dest="footprint", action="store_false",
                   help="skip the per-method peak RSS / load time measurement (a fresh process per method)")
    p.add_argument("--num-beams", type=int, default=4, help="beams of method beam (default 4)")
    common.add_tree_args(p)
    p.add_argument("--length-penalty", type=float, default=1.0, help="length penalty of method beam (default 1.0)")
    p.add_argument("--out", default="bench-out", help="output folder (default bench-out)")


def config_from_args(args) -> BenchConfig:
    return BenchConfig(target=args.target, draft=args.draft, dtype=args.dtype, draft_dtype=args.draft_dtype,
                       backend=args.backend,
                       gamma=parse_gamma(args.gamma), methods=parse_methods(args.methods), prompts=args.prompts,
                       categories=[c.strip() for c in args.categories.split(",") if c.strip()]
                       if args.categories else None,
                       limit=args.limit, max_tokens=args.max_tokens, chat=args.chat, temperature=args.temperature,
                       seed=args.seed, warmup_tokens=args.warmup_tokens, bandwidth_gib=args.bandwidth_gib,
                       footprint=args.footprint, num_beams=args.num_beams, length_penalty=args.length_penalty,
                       tree_width=args.tree_width, heads=args.heads, lookahead=args.lookahead, skip_layers=args.skip_layers,
                       prefix_cache_mb=args.prefix_cache_mb,
                       out=args.out)


def run(args) -> int:
    from rich.console import Console

    from ..sampling import SamplingParams

    common.threads(args)
    cfg = config_from_args(args)
    SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens)  # validate before loading anything
    out = out_folder(cfg.out, "--out")
    results = run_bench(cfg, progress=True)
    files = report.write_outputs(results, out)
    console = Console(stderr=True, highlight=False)
    summary(results, console)
    console.print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


def summary(results: dict, console) -> None:
    """A short table on the terminal."""
    from rich.table import Table

    ms = results["methods"]
    refs = [r for r in report.PEER_REFERENCES.values() if r in ms]  # × hf-ar, × llama-ar: when they ran
    own = any(report.own_reference(m) for m in ms)  # a speculative peer: its output vs its own plain decoding
    t = Table("method", "tok/s", "× ar", *[f"× {r}" for r in refs], "α", "τ", "mismatches vs ar",
              *(["matches own ar"] if own else []), title="draftwise bench (overall)")
    for m, s in ms.items():
        t.add_row(m, report._f(s["tokens_per_s"]), report._f(s["speedup_vs_ar"]),
                  *[report._f(s[f"speedup_vs_{report.key(r)}"]) for r in refs],
                  report._f(s["acceptance_rate"]), report._f(s["mean_accepted_length"]),
                  report._f(s["mismatches"], "d"),
                  *([report.own_match(s)] if own else []))
    console.print(t)
    fp = results.get("footprint")
    if fp:
        ft = Table("method", "peak RSS", "load s", "generate s", "whole process s",
                   title="memory and start-up (a fresh process per method, first prompt)")
        for m, r in fp.items():
            if "error" in r:
                ft.add_row(m, r["error"], "", "", "")
            else:
                ft.add_row(m, f"{r['peak_rss_mb']:.0f} MiB", f"{r['load_s']:.2f}", f"{r['generate_s']:.2f}",
                           f"{r['wall_s']:.2f}")
        console.print(ft)
    rf = results.get("roofline")
    if rf:
        console.print(f"roofline: {rf['bandwidth_gb_s']:.1f} GB/s ÷ {rf['weight_bytes_per_token'] / 1e9:.3f} GB/token "
                      f"= {report._f(rf['max_tokens_per_s'])} tok/s; "
                      f"ar at {report._f(rf['ar_percent_of_bound'], '.0f')}%")
