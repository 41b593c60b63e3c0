"""Aggregation, output checks and the written report: ``results.json``, ``report.md``, PNG plots.

Spec-Bench's protocol: per prompt tokens/s = new tokens / wall; a method's speedup = mean tokens/s of the
method / mean tokens/s of the reference (``ar``, and ``hf-ar`` / ``llama-ar`` when they ran); the median of
per-prompt speedups is reported beside it. α = accepted / drafted pooled over prompts (null when nothing was
drafted); τ = new tokens / target passes pooled (1.00 for plain decoding).

Output checks: every method against ``ar``. The peers (HF transformers, llama.cpp) compute with other
numerics, so their differences from ``ar`` are reported apart and never counted as the engine's; a
speculative peer is also checked against its own plain decoding (``hf-pld`` vs ``hf-ar``, ``llama-pld`` vs
``llama-ar``: "matches own ar"), which is what losslessness means for that library.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .prompts import SPEC_BENCH_SHA256

REFERENCE, HF_REFERENCE, LLAMA_REFERENCE = "ar", "hf-ar", "llama-ar"
NOT_COMPARED = ("beam",)  # another search than ar's (beam search): measured beside it, output not compared
PEER_REFERENCES = {"hf-": HF_REFERENCE, "llama-": LLAMA_REFERENCE}  # a peer family's prefix → its plain decoding
TIME_PARTS = ("prefill_s", "draft_s", "verify_s")


def key(ref: str) -> str:
    """"hf-ar" → "hf_ar" (as in speedup_vs_hf_ar, mismatches_vs_hf_ar)."""
    return ref.replace("-", "_")


def is_peer(method: str) -> bool:
    """HF or llama.cpp, not the engine: its differences from ``ar`` are not the engine's mismatches."""
    return method.startswith(tuple(PEER_REFERENCES))


def own_reference(method: str) -> str | None:
    """The plain decoding of a speculative peer's own library (``llama-pld`` → ``llama-ar``); None otherwise."""
    ref = next((r for p, r in PEER_REFERENCES.items() if method.startswith(p)), None)
    return ref if ref != method else None


def own_match(s: dict) -> str:
    """"k/n": prompts where a speculative peer's output equals its own plain decoding's; "–" for the others
    (and when that plain decoding did not run, or outputs were not checked: sampling on)."""
    return f"{s['matches_own_ar']}/{s['own_ar_prompts']}" if s.get("matches_own_ar") is not None else "–"


# ---- checks --------------------------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def find_mismatches(per_prompt: list[dict], methods: list[str]) -> list[dict]:
    """Every (prompt, method) whose token ids differ from ``ar``'s; speculative peers also vs their own plain
    decoding (``hf-ar``, ``llama-ar``)."""
    out = []
    for p in per_prompt:
        runs = p["runs"]
        for m in methods:
            if m in NOT_COMPARED:
                continue
            own = own_reference(m)
            for ref in [REFERENCE] + ([own] if own else []):
                if m == ref or m not in runs or ref not in runs:
                    continue
                i = first_difference(runs[m]["token_ids"], runs[ref]["token_ids"])
                if i is not None:
                    out.append({"question_id": p["question_id"], "category": p["category"], "method": m,
                                "reference": ref, "first_diff": i, "tokens": len(runs[m]["token_ids"]),
                                "reference_tokens": len(runs[ref]["token_ids"])})
    return out


# ---- aggregation ---------------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(per_prompt: list[dict], method: str, mismatches: list[dict], checked: bool = True) -> dict:
    """One method over some prompts (all of them, or one category's). ``checked``: outputs were compared
    (greedy); if not, "matches own ar" is unknown (None), not a count of the empty mismatch list."""
    rows = [p["runs"] for p in per_prompt if method in p["runs"]]
    runs = [r[method] for r in rows]
    tps = [r["tokens_per_s"] for r in runs]
    drafted = sum(r["drafted"] for r in runs)
    passes = sum(r["target_passes"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    out = {"n_prompts": len(runs), "tokens_per_s": _mean(tps),
           "new_tokens": _mean([r["new_tokens"] for r in runs]),
           "acceptance_rate": sum(r["accepted"] for r in runs) / drafted if drafted else None,
           "mean_accepted_length": sum(r["new_tokens"] for r in runs) / passes if passes else None,
           "drafted": drafted, "wall_s": wall}
    for ref in (REFERENCE, *PEER_REFERENCES.values()):
        k = key(ref)
        ref_tps = [r[ref]["tokens_per_s"] for r in rows if ref in r]
        per = [r[method]["tokens_per_s"] / r[ref]["tokens_per_s"] for r in rows
               if ref in r and r[ref]["tokens_per_s"] > 0]
        out[f"speedup_vs_{k}"] = _ratio(out["tokens_per_s"], _mean(ref_tps)) if len(ref_tps) == len(rows) else None
        out[f"median_speedup_vs_{k}"] = statistics.median(per) if per and len(per) == len(rows) else None
    ids = {p["question_id"] for p in per_prompt}
    mine = [m for m in mismatches if m["method"] == method and m["question_id"] in ids]
    out["mismatches"] = sum(m["reference"] == REFERENCE for m in mine) if method not in NOT_COMPARED else None
    out["mismatch_ids"] = [m["question_id"] for m in mine if m["reference"] == REFERENCE]
    own = own_reference(method)
    if own:  # e.g. mismatches_vs_llama_ar, and "matches own ar" = prompts with both runs − those
        out["own_reference"] = own
        out[f"mismatches_vs_{key(own)}"] = sum(m["reference"] == own for m in mine)
        out["own_ar_prompts"] = sum(own in r for r in rows)
        out["matches_own_ar"] = out["own_ar_prompts"] - out[f"mismatches_vs_{key(own)}"] \
            if checked and out["own_ar_prompts"] else None
    out["time_split"] = {k.removesuffix("_s"): sum(r[k] for r in runs) / wall if wall else None for k in TIME_PARTS}
    if wall:
        out["time_split"]["other"] = max(0.0, 1.0 - sum(out["time_split"].values()))
    return out


def categories_of(per_prompt: list[dict]) -> list[str]:
    return list(dict.fromkeys(p["category"] for p in per_prompt))


def aggregate(per_prompt: list[dict], methods: list[str], mismatches: list[dict], checked: bool = True) -> dict:
    """{method: {overall keys..., "by_category": {category: {same keys}}}}"""
    out = {}
    for m in methods:
        out[m] = summarize(per_prompt, m, mismatches, checked)
        out[m]["by_category"] = {c: summarize([p for p in per_prompt if p["category"] == c], m, mismatches, checked)
                                 for c in categories_of(per_prompt)}
    return out


# ---- writing -------------------------------------------------------------------------------------------
def _f(x, fmt: str = ".2f", none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def _bytes(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def prompts_source(cfg: dict) -> str:
    """Spec-Bench (the shipped file, recognised by its sha256), else the prompts file's name: a report names
    no path of the machine it ran on."""
    if cfg.get("prompts_sha256") == SPEC_BENCH_SHA256:
        return "Spec-Bench"
    return f"`{Path(cfg['prompts']).name}`"


SPEC_BENCH_TASKS = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]


def bench_command(cfg: dict) -> str:
    """The ``draftwise bench`` command line that reproduces a run, from its recorded config: the options
    that differ from their defaults; a prompts file and heads folders by their names only."""
    import shlex

    from ..api import DEFAULT_DRAFT, DEFAULT_TARGET

    a = ["draftwise", "bench"]

    def opt(flag: str, value, default=None) -> None:
        if value not in (None, default):
            a.extend([flag, str(value)])

    methods = list(cfg.get("methods", ()))
    spec_bench = cfg.get("prompts_sha256") == SPEC_BENCH_SHA256
    opt("--target", cfg.get("target"), DEFAULT_TARGET)
    if any(m.split("-")[0] == "draft" or m == "hf-assisted" for m in methods):
        opt("--draft", cfg.get("draft"), DEFAULT_DRAFT)
    opt("--dtype", cfg.get("dtype"), "auto")
    opt("--backend", cfg.get("backend"), "native")
    if not spec_bench and cfg.get("prompts"):
        opt("--prompts", Path(cfg["prompts"]).name)
    if spec_bench and cfg.get("categories") and cfg["categories"] != SPEC_BENCH_TASKS:
        opt("--categories", ",".join(cfg["categories"]))
    opt("--limit", cfg.get("limit"))
    opt("--max-tokens", cfg.get("max_tokens"), 128)
    if cfg.get("chat"):
        a.append("--chat")
    opt("--temperature", cfg.get("temperature"), 0.0)
    opt("--seed", cfg.get("seed"))
    opt("--gamma", cfg.get("gamma"), "auto")
    a.extend(["--methods", ",".join([REFERENCE, *(m for m in methods if m != REFERENCE)])])
    if cfg.get("heads"):
        opt("--heads", ",".join(Path(h).name for h in str(cfg["heads"]).split(",")))
    opt("--tree-width", cfg.get("tree_width"))
    opt("--lookahead", cfg.get("lookahead"))
    if "beam" in methods:
        opt("--num-beams", cfg.get("num_beams"), 4)
        opt("--length-penalty", cfg.get("length_penalty"), 1.0)
    if cfg.get("footprint") is False:
        a.append("--no-footprint")
    opt("--threads", cfg.get("threads"))
    return shlex.join(a)


def markdown(results: dict) -> str:
    """results.json as a Markdown report: the run's header, then one section per table."""
    cfg, ms = results["config"], results["methods"]
    names = list(ms)
    cats = list(next(iter(ms.values()))["by_category"]) if ms else []
    spec_peers = [m for m in names if own_reference(m)]
    parts = [_md_header(cfg, cats), _md_overall(ms, spec_peers), *_md_by_category(ms, cats)]
    if results.get("roofline"):
        parts.append(_md_roofline(results["roofline"]))
    parts.append(_md_outputs_vs_ar(cfg, results["mismatches"]))
    if any(is_peer(n) for n in names):
        parts.append(_md_peers(cfg, ms, spec_peers, results["mismatches"]))
    if results.get("footprint"):
        parts.append(_md_footprint(results["footprint"]))
    if results.get("skipped"):
        parts.append("## Skipped prompts\n\n" + "\n".join(f"- {s['question_id']} ({s['category']}): {s['reason']}"
                                                          for s in results["skipped"]))
    return "\n\n".join(parts) + "\n"


def _md_header(cfg: dict, cats: list[str]) -> str:
    """Title, the run's settings and machine, the command that repeats it."""
    llama_v = cfg["versions"].get("llama_cpp")
    return (f"# draftwise bench\n\n"
            f"target `{cfg['target']}`, draft `{cfg['draft']}`, {cfg['dtype']}, γ={cfg['gamma']}, "
            f"max_tokens={cfg['max_tokens']}, "
            f"{'greedy' if not cfg['temperature'] else 'T=' + str(cfg['temperature'])}, "
            f"chat={cfg['chat']}, {cfg['n_prompts']} prompts ({', '.join(cats)}) from {prompts_source(cfg)}, "
            f"{cfg['threads']} threads, torch {cfg['versions']['torch']}, transformers "
            f"{cfg['versions']['transformers']}" + (f", llama-cpp-python {llama_v}" if llama_v else "")
            + ". Warm-up excluded; methods interleaved per prompt."
            + (f"\n\nCPU: {cfg['cpu']} (kernel path `{cfg.get('isa')}`"
               + (f", `{cfg['isa_multi_row']}` for 3+-row calls of the groups-of-32 code" if cfg.get("isa_multi_row") not in (None, cfg.get("isa"))
                  else "") + f"); {str(cfg.get('started', ''))[:10]}"
               + (f"; commit `{cfg['commit']}`" if cfg.get("commit") else "") + "." if cfg.get("cpu") else "")
            + f"\n\n```bash\n{bench_command(cfg)}\n```"
            + ("\n\n**Interrupted**: only the prompts that finished are reported." if cfg.get("interrupted") else ""))


def _md_overall(ms: dict, spec_peers: list[str]) -> str:
    """One row per method: speed, × ar (and × each peer's plain decoding that ran), α, τ, time split."""
    names = list(ms)
    refs = [r for r in PEER_REFERENCES.values() if r in ms]  # × hf-ar, × llama-ar columns: when they ran
    head = ["method", "tok/s", "× ar", "median × ar"] + [h for r in refs for h in (f"× {r}", f"median × {r}")] + \
        ["α", "τ", "prefill", "draft", "verify", "other", "mismatches vs ar"] + \
        (["matches own ar"] if spec_peers else [])
    rows = []
    for m in names:
        s = ms[m]
        ts = s["time_split"]
        rows.append([f"`{m}`", _f(s["tokens_per_s"]), _f(s["speedup_vs_ar"]), _f(s["median_speedup_vs_ar"])]
                    + [_f(s[f"{p}speedup_vs_{key(r)}"]) for r in refs for p in ("", "median_")]
                    + [_f(s["acceptance_rate"]), _f(s["mean_accepted_length"])]
                    + [_f(ts.get(k) and 100 * ts[k], ".0f") + "%" for k in ("prefill", "draft", "verify", "other")]
                    + [_f(s["mismatches"], "d")] + ([own_match(s)] if spec_peers else []))
    return ("## Overall\n\n" + _table(head, rows) + "\n\nTime split: shares of wall time; `draft` is "
            "everything outside the target's forward passes (drafting and bookkeeping)."
            + (" `beam` is beam search, another search than `ar`'s: its output is not compared (–)."
               if any(m in NOT_COMPARED for m in names) else "")
            + (" Matches own ar: prompts where a speculative peer's greedy output equals its own library's "
               "plain decoding (`hf-ar`, `llama-ar`)." if spec_peers else ""))


def _md_by_category(ms: dict, cats: list[str]) -> list[str]:
    """Speedup, tokens/s, τ and α per prompt category: one table each."""
    parts = []
    for title, k, fmt in (("Speedup vs `ar` by category", "speedup_vs_ar", ".2f"),
                            ("Tokens/s by category", "tokens_per_s", ".2f"),
                            ("τ (mean accepted length) by category", "mean_accepted_length", ".2f"),
                            ("α (acceptance rate) by category", "acceptance_rate", ".2f")):
        rows = [[f"`{m}`"] + [_f(ms[m]["by_category"][c][k], fmt) for c in cats] + [_f(ms[m][k], fmt)]
                for m in ms]
        parts.append(f"## {title}\n\n" + _table(["method"] + cats + ["overall"], rows))
    return parts


def _md_roofline(rf: dict) -> str:
    return ("## Roofline\n\n" + _table(["quantity", "value"], [
        ["memory bandwidth", f"{rf['bandwidth_gb_s']:.1f} GB/s ({rf['bandwidth']['method']})"],
        ["target weights streamed per token", f"{_bytes(rf['weight_bytes_per_token'])} "
         f"({rf['weight_elements_per_token'] / 1e6:,.1f} M elements; "
         + ", ".join(f"{k} {_bytes(v)}" for k, v in rf["bytes_by_dtype"].items()) + ")"],
        ["batch-1 bound", f"{_f(rf['max_tokens_per_s'])} tok/s"],
        ["`ar` measured",
         f"{_f(rf['ar_tokens_per_s'])} tok/s = {_f(rf['ar_percent_of_bound'], '.0f')}% of the bound"]])
        + "\n\nBytes per token count every parameter and buffer but the input embedding (the KV cache "
          "read is not included).")


def _md_outputs_vs_ar(cfg: dict, mismatches: list[dict]) -> str:
    """draftwise's own methods against `ar`, token for token."""
    own = [m for m in mismatches if not is_peer(m["method"])]
    chk = "" if cfg["outputs_checked"] else " (not checked: sampling without a seed)"
    what = "Greedy outputs" if cfg.get("temperature", 0.0) == 0.0 else "Seeded sampled outputs"
    return (f"## {what} vs `ar`" + chk + "\n\n" + (
        _table(["question", "category", "method", "first differing token", "tokens", "`ar` tokens"],
               [[str(m["question_id"]), m["category"], f"`{m['method']}`", str(m["first_diff"]), str(m["tokens"]),
                 str(m["reference_tokens"])] for m in own]) if own else "Every draftwise method equals `ar` token "
                                                                      "for token."))


def _md_peers(cfg: dict, ms: dict, spec_peers: list[str], mismatches: list[dict]) -> str:
    """The peers (HF, llama.cpp) against `ar` and against their own library's plain decoding."""
    peer = [m for m in mismatches if is_peer(m["method"])]
    peers_checked = cfg.get("peers_checked", cfg["outputs_checked"])
    peer_chk = "" if peers_checked else " (not checked: sampling is on)"
    own_table = ""
    if spec_peers and peers_checked:
        own_table = _table(["method", "own reference", "matches own ar", "mismatches vs `ar`"],
                           [[f"`{m}`", f"`{ms[m]['own_reference']}`", own_match(ms[m]), str(ms[m]["mismatches"])]
                            for m in spec_peers]) + "\n\n"
    return ("## Peers vs `ar` and their own plain decoding (other numerics: reported apart)" + peer_chk + "\n\n"
            "HF transformers and llama.cpp compute with their own kernels, so a peer may leave `ar`'s "
            "greedy path without being wrong; a speculative peer is lossless when it equals its own "
            "library's plain decoding (`hf-ar`, `llama-ar`; llama.cpp is not batch-invariant, so a "
            "multi-token verify pass can flip a near-tie).\n\n" + own_table + (
                _table(["question", "category", "method", "reference", "first differing token", "tokens",
                        "reference tokens"],
                       [[str(m["question_id"]), m["category"], f"`{m['method']}`", f"`{m['reference']}`",
                         str(m["first_diff"]), str(m["tokens"]), str(m["reference_tokens"])] for m in peer])
                if peer else "Every peer equals `ar` token for token." if peers_checked else
                "Not compared: peers sample with their own generators."))


def _md_footprint(fp: dict) -> str:
    rows = [[f"`{m}`", r["error"], "", "", ""] if "error" in r else
            [f"`{m}`", f"{r['peak_rss_mb']:.0f} MiB", f"{r['load_s']:.2f}", f"{r['generate_s']:.2f}",
             f"{r['wall_s']:.2f}"] for m, r in fp.items()]
    return ("## Memory and start-up\n\nEach method in a fresh process that loads only what it needs and "
            "generates the first prompt once: peak resident set (VmHWM), model load time, generation "
            "time, and the whole process (interpreter start and imports included). llama.cpp peers run "
            "in a process that imports llama-cpp-python alone.\n\n" + _table(
                ["method", "peak RSS", "load s", "generate s", "whole process s"], rows))


def plot(results: dict, out: Path) -> list[Path]:
    """speedup_by_category.png, tau_alpha.png, tokens_per_s.png (matplotlib, no display needed)."""
    import numpy as np
    from matplotlib.figure import Figure

    ms = results["methods"]
    names = list(ms)
    colour = {m: f"C{i % 10}" for i, m in enumerate(names)}  # one colour per method in every plot
    cats = list(next(iter(ms.values()))["by_category"]) + ["overall"]
    files = []

    def get(m: str, c: str, key: str) -> float:
        s = ms[m] if c == "overall" else ms[m]["by_category"][c]
        return s[key] if s[key] is not None else np.nan

    def bars(ax, key: str, label: str) -> None:  # one bar per method, overall
        x = np.arange(len(names))
        vals = [get(m, "overall", key) for m in names]
        ax.bar(x, np.nan_to_num(vals), color=[colour[m] for m in names])
        for i, v in enumerate(vals):
            ax.annotate("n/a" if np.isnan(v) else f"{v:.2f}", (i, 0 if np.isnan(v) else v), ha="center",
                        va="bottom", fontsize="small")
        ax.set_xticks(x, names, rotation=30, ha="right")
        ax.set_ylabel(label)

    title = f"{results['config']['target']} ({results['config']['dtype']}, γ={results['config']['gamma']})"
    others = [m for m in names if m != REFERENCE]
    fig = Figure(figsize=(max(6.0, 0.35 * len(cats) * max(1, len(others)) + 2.5), 4.2), layout="constrained")
    ax = fig.add_subplot()
    w = 0.8 / max(1, len(others))
    x = np.arange(len(cats))
    for i, m in enumerate(others):
        ax.bar(x + (i - (len(others) - 1) / 2) * w, [get(m, c, "speedup_vs_ar") for c in cats], w, label=m,
               color=colour[m])
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(x, cats)
    ax.set_ylabel("speedup vs ar (ratio of mean tok/s)")
    ax.set_title(title, fontsize="medium")
    if others:
        fig.legend(loc="outside right upper", fontsize="small")
    files.append(out / "speedup_by_category.png")
    fig.savefig(files[-1], dpi=110)

    fig = Figure(figsize=(max(8.0, 1.4 * len(names)), 3.8), layout="constrained")
    bars(fig.add_subplot(1, 2, 1), "mean_accepted_length", "τ (tokens per target pass)")
    bars(fig.add_subplot(1, 2, 2), "acceptance_rate", "α (accepted / drafted)")
    fig.suptitle(title, fontsize="medium")
    files.append(out / "tau_alpha.png")
    fig.savefig(files[-1], dpi=110)

    fig = Figure(figsize=(max(5.0, 0.8 * len(names) + 2), 3.8), layout="constrained")
    ax = fig.add_subplot()
    bars(ax, "tokens_per_s", "tokens/s (mean per prompt)")
    bound = (results.get("roofline") or {}).get("max_tokens_per_s")
    if bound and bound < 20 * max(np.nan_to_num([get(m, "overall", "tokens_per_s") for m in names])):
        ax.axhline(bound, color="red", ls="--", lw=1, label=f"bandwidth bound {bound:.1f} tok/s")
        ax.legend(fontsize="small")
    ax.set_title(title, fontsize="medium")
    files.append(out / "tokens_per_s.png")
    fig.savefig(files[-1], dpi=110)
    return files


COMPARE_BASELINES = ("ar", "llama-ar", "llama-pld", "hf-pld")  # what a user would otherwise run


def speedup_plot(runs: list[tuple[str, dict]], out: Path, baselines: tuple[str, ...] = COMPARE_BASELINES) -> Path:
    """One panel per run (a CPU): for each draftwise method, its mean tok/s over each baseline's that ran
    in the same run (the same prompts, interleaved), as grouped bars with the ratio written on them."""
    import numpy as np
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("no runs to plot")
    fig = Figure(figsize=(6.5 * len(runs), 4.4), layout="constrained")
    axes = fig.subplots(1, len(runs), squeeze=False)[0]
    for ax, (label, results) in zip(axes, runs):
        ms = results["methods"]
        methods = [m for m in ms if not is_peer(m) and m != REFERENCE]
        bases = [b for b in baselines if b in ms and ms[b]["tokens_per_s"]]
        w = 0.8 / max(1, len(bases))
        x = np.arange(len(methods))
        for i, b in enumerate(bases):
            vals = [ms[m]["tokens_per_s"] / ms[b]["tokens_per_s"] for m in methods]
            bars = ax.bar(x + (i - (len(bases) - 1) / 2) * w, vals, w, label=f"vs {b}", color=f"C{i}")
            ax.bar_label(bars, fmt="%.2f", fontsize="x-small", padding=1)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(x, methods)
        ax.set_ylabel("speed-up (ratio of mean tok/s)")
        cfg = results["config"]
        ax.set_title(f"{label}\n{cfg['target']}, {cfg['n_prompts']} Spec-Bench prompts, {cfg['max_tokens']} tokens"
                     if cfg.get("prompts_sha256") == SPEC_BENCH_SHA256 else f"{label}\n{cfg['target']}",
                     fontsize="medium")
        ax.legend(fontsize="small", loc="upper left")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def write_outputs(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    (out / "report.md").write_text(markdown(results), encoding="utf-8")
    return [out / "results.json", out / "report.md", *plot(results, out)]
