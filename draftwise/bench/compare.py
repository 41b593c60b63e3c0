"""``python -m draftwise.bench.compare``: the README's results picture from ``draftwise bench`` runs — the
speed-up of each draftwise method against plain decoding (``ar``) and llama.cpp's and HF's decoding
(``llama-ar``, ``llama-pld``, ``hf-pld``), one panel per run (a CPU). The ratios are of mean tokens/s within
one run: the same prompts, methods interleaved per prompt."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import report


def run_label(results: dict, fallback: str) -> str:
    """A run's name in a comparison: its CPU and date when results.json records them, else ``fallback``."""
    cfg = results["config"]
    return f"{cfg['cpu']}, {str(cfg.get('started', ''))[:10]}" if cfg.get("cpu") else fallback


def main(argv: list[str] | None = None) -> int:
    """``python -m draftwise.bench.compare RUN [RUN ...] --out FILE.png``: the speed-up of each draftwise
    method against llama.cpp's and HF's decoding, one panel per ``draftwise bench`` run (a results.json or
    the folder holding it), as in the README."""
    ap = argparse.ArgumentParser(prog="python -m draftwise.bench.compare", description=main.__doc__.split(": ", 1)[1])
    ap.add_argument("runs", nargs="+", help="results.json files or `draftwise bench --out` folders")
    ap.add_argument("--label", action="append", default=[],
                    help="panel title, once per run in order (default: the CPU and date the run recorded, else "
                         "the folder's name)")
    ap.add_argument("--baselines", default=",".join(report.COMPARE_BASELINES),
                    help=f"comma-separated (default {','.join(report.COMPARE_BASELINES)}); those a run lacks are left out")
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    if args.label and len(args.label) != len(args.runs):
        ap.error(f"--label given {len(args.label)} times for {len(args.runs)} runs")
    runs = []
    for i, r in enumerate(args.runs):
        path = Path(r) / "results.json" if Path(r).is_dir() else Path(r)
        if not path.is_file():
            ap.error(f"{r}: no results.json there")
        results = json.loads(path.read_text(encoding="utf-8"))
        runs.append((args.label[i] if args.label else run_label(results, path.parent.name), results))
    print(report.speedup_plot(runs, Path(args.out), tuple(b for b in args.baselines.split(",") if b)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
