"""Aggregation, output checks and the written report: ``results.json``, ``report.md``, PNG plots.

Spec-Bench's protocol: per prompt tokens/s = new tokens / wall; a method's speedup = mean tokens/s of the
method / mean tokens/s of the reference (``ar``, and ``hf-ar`` when it ran); the median of per-prompt
speedups is reported beside it. α = accepted / drafted pooled over prompts (null when nothing was
drafted); τ = new tokens / target passes pooled (1.00 for plain decoding).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

REFERENCE, HF_REFERENCE = "ar", "hf-ar"
TIME_PARTS = ("prefill_s", "draft_s", "verify_s")


# ---- checks --------------------------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix of the other), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def find_mismatches(per_prompt: list[dict], methods: list[str]) -> list[dict]:
    """Every (prompt, method) whose token ids differ from ``ar``'s; HF drafting peers also vs ``hf-ar``."""
    out = []
    for p in per_prompt:
        runs = p["runs"]
        for m in methods:
            refs = [REFERENCE] + ([HF_REFERENCE] if m.startswith("hf-") and m != HF_REFERENCE else [])
            for ref in refs:
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


def summarize(per_prompt: list[dict], method: str, mismatches: list[dict]) -> dict:
    """One method over some prompts (all of them, or one category's)."""
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
    for ref in (REFERENCE, HF_REFERENCE):
        key = ref.replace("-", "_")
        ref_tps = [r[ref]["tokens_per_s"] for r in rows if ref in r]
        per = [r[method]["tokens_per_s"] / r[ref]["tokens_per_s"] for r in rows
               if ref in r and r[ref]["tokens_per_s"] > 0]
        out[f"speedup_vs_{key}"] = _ratio(out["tokens_per_s"], _mean(ref_tps)) if len(ref_tps) == len(rows) else None
        out[f"median_speedup_vs_{key}"] = statistics.median(per) if per and len(per) == len(rows) else None
    ids = {p["question_id"] for p in per_prompt}
    mine = [m for m in mismatches if m["method"] == method and m["question_id"] in ids]
    out["mismatches"] = sum(m["reference"] == REFERENCE for m in mine)
    out["mismatch_ids"] = [m["question_id"] for m in mine if m["reference"] == REFERENCE]
    if method.startswith("hf-") and method != HF_REFERENCE:
        out["mismatches_vs_hf_ar"] = sum(m["reference"] == HF_REFERENCE for m in mine)
    out["time_split"] = {k.removesuffix("_s"): sum(r[k] for r in runs) / wall if wall else None for k in TIME_PARTS}
    if wall:
        out["time_split"]["other"] = max(0.0, 1.0 - sum(out["time_split"].values()))
    return out


def categories_of(per_prompt: list[dict]) -> list[str]:
    return list(dict.fromkeys(p["category"] for p in per_prompt))


def aggregate(per_prompt: list[dict], methods: list[str], mismatches: list[dict]) -> dict:
    """{method: {overall keys..., "by_category": {category: {same keys}}}}"""
    out = {}
    for m in methods:
        out[m] = summarize(per_prompt, m, mismatches)
        out[m]["by_category"] = {c: summarize([p for p in per_prompt if p["category"] == c], m, mismatches)
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


def markdown(results: dict) -> str:
    cfg, ms = results["config"], results["methods"]
    names = list(ms)
    cats = list(next(iter(ms.values()))["by_category"]) if ms else []
    has_hf = HF_REFERENCE in ms
    parts = [f"# draftwise bench\n\n"
             f"target `{cfg['target']}`, draft `{cfg['draft']}`, {cfg['dtype']}, γ={cfg['gamma']}, "
             f"max_tokens={cfg['max_tokens']}, "
             f"{'greedy' if not cfg['temperature'] else 'T=' + str(cfg['temperature'])}, "
             f"chat={cfg['chat']}, {cfg['n_prompts']} prompts ({', '.join(cats)}) from `{cfg['prompts']}`, "
             f"{cfg['threads']} threads, torch {cfg['versions']['torch']}, transformers "
             f"{cfg['versions']['transformers']}. Warm-up excluded; methods interleaved per prompt."
             + ("\n\n**Interrupted**: only the prompts that finished are reported." if cfg.get("interrupted") else "")]
    head = ["method", "tok/s", "× ar", "median × ar"] + (["× hf-ar", "median × hf-ar"] if has_hf else []) + \
        ["α", "τ", "prefill", "draft", "verify", "other", "mismatches vs ar"]
    rows = []
    for m in names:
        s = ms[m]
        ts = s["time_split"]
        rows.append([f"`{m}`", _f(s["tokens_per_s"]), _f(s["speedup_vs_ar"]), _f(s["median_speedup_vs_ar"])]
                    + ([_f(s["speedup_vs_hf_ar"]), _f(s["median_speedup_vs_hf_ar"])] if has_hf else [])
                    + [_f(s["acceptance_rate"]), _f(s["mean_accepted_length"])]
                    + [_f(ts.get(k) and 100 * ts[k], ".0f") + "%" for k in ("prefill", "draft", "verify", "other")]
                    + [str(s["mismatches"])])
    parts.append("## Overall\n\n" + _table(head, rows) + "\n\nTime split: shares of wall time; `draft` is "
                 "everything outside the target's forward passes (drafting and bookkeeping).")
    for title, key, fmt in (("Speedup vs `ar` by category", "speedup_vs_ar", ".2f"),
                            ("Tokens/s by category", "tokens_per_s", ".2f"),
                            ("τ (mean accepted length) by category", "mean_accepted_length", ".2f"),
                            ("α (acceptance rate) by category", "acceptance_rate", ".2f")):
        rows = [[f"`{m}`"] + [_f(ms[m]["by_category"][c][key], fmt) for c in cats] + [_f(ms[m][key], fmt)]
                for m in names]
        parts.append(f"## {title}\n\n" + _table(["method"] + cats + ["overall"], rows))
    rf = results.get("roofline")
    if rf:
        parts.append("## Roofline\n\n" + _table(["quantity", "value"], [
            ["memory bandwidth", f"{rf['bandwidth_gb_s']:.1f} GB/s ({rf['bandwidth']['method']})"],
            ["target weights streamed per token", f"{_bytes(rf['weight_bytes_per_token'])} "
             f"({rf['weight_elements_per_token'] / 1e6:,.1f} M elements; "
             + ", ".join(f"{k} {_bytes(v)}" for k, v in rf["bytes_by_dtype"].items()) + ")"],
            ["batch-1 bound", f"{_f(rf['max_tokens_per_s'])} tok/s"],
            ["`ar` measured",
             f"{_f(rf['ar_tokens_per_s'])} tok/s = {_f(rf['ar_percent_of_bound'], '.0f')}% of the bound"]])
            + "\n\nBytes per token count every parameter and buffer but the input embedding (the KV cache "
              "read is not included).")
    mm = results["mismatches"]
    own = [m for m in mm if not m["method"].startswith("hf-")]
    hf = [m for m in mm if m["method"].startswith("hf-")]
    chk = "" if cfg["outputs_checked"] else " (not checked: sampling is on)"
    parts.append("## Greedy outputs vs `ar`" + chk + "\n\n" + (
        _table(["question", "category", "method", "first differing token", "tokens", "`ar` tokens"],
               [[str(m["question_id"]), m["category"], f"`{m['method']}`", str(m["first_diff"]), str(m["tokens"]),
                 str(m["reference_tokens"])] for m in own]) if own else "Every draftwise method equals `ar` token "
                                                                      "for token."))
    if any(n.startswith("hf-") for n in names):
        parts.append("## HF peers vs `ar` and `hf-ar` (HF numerics differ: reported apart)\n\n" + (
            _table(["question", "category", "method", "reference", "first differing token", "tokens",
                    "reference tokens"],
                   [[str(m["question_id"]), m["category"], f"`{m['method']}`", f"`{m['reference']}`",
                     str(m["first_diff"]), str(m["tokens"]), str(m["reference_tokens"])] for m in hf])
            if hf else "Every HF peer equals `ar` token for token."))
    if results.get("skipped"):
        parts.append("## Skipped prompts\n\n" + "\n".join(f"- {s['question_id']} ({s['category']}): {s['reason']}"
                                                          for s in results["skipped"]))
    return "\n\n".join(parts) + "\n"


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


def write_outputs(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    (out / "report.md").write_text(markdown(results), encoding="utf-8")
    return [out / "results.json", out / "report.md", *plot(results, out)]
