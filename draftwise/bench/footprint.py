"""Memory and start-up per method, each in a fresh process: peak RSS, load time, time to the output.

Peak RSS is a property of a whole process, and the benchmark's own process holds every method's models
at once, so each method is measured in a child that loads only what that method needs, generates the
first prompt once and reports its own peak resident set (``VmHWM``) and timings as one JSON line.
llama.cpp peers run in a child that imports llama-cpp-python alone (``_llama_child.py``, no torch), so
their number is llama.cpp's, not ours plus theirs. HF transformers peers are not measured (their fp32
copies are a different order of memory; see docs/performance.md).

    python -m draftwise.bench.footprint own '{"target": ..., "method": "ar", "ids": [...], ...}'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

LLAMA_CHILD = Path(__file__).with_name("_llama_child.py")


def run_child(argv: list[str], timeout: float = 1800.0) -> dict:
    """Run a child process: its JSON (last stdout line), plus wall_s of the whole child (start-up included)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (err or out).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0][:300]}"}
    res = json.loads(lines[-1])
    res["wall_s"] = wall
    return res


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(methods: list[str], cfg, ids: list[int], llama_ctx: int | None, eos_ids, threads: int,
            log=None) -> dict:
    """{method: {peak_rss_mb, load_s, generate_s, wall_s, new_tokens} | {error}} for draftwise's own
    methods and the llama.cpp peers among ``methods``."""
    from ..api import tree_options
    from .harness import LLAMA_PEERS, PEERS

    out: dict[str, dict] = {}
    for m in methods:
        if m in PEERS:
            continue
        if log:
            log(f"footprint: {m} in a fresh process ...")
        if m in LLAMA_PEERS:
            from ..models.registry import resolve
            from .llama_peers import PLD_MAX_NGRAM, gguf_path

            spec = {"model_path": str(gguf_path(resolve(cfg.target, False))), "method": m, "ids": ids,
                    "max_tokens": cfg.max_tokens, "n_ctx": llama_ctx, "threads": threads,
                    "eos_ids": sorted(eos_ids), "pld_tokens": cfg.gamma if isinstance(cfg.gamma, int) else 10,
                    "max_ngram": PLD_MAX_NGRAM}
            out[m] = run_child([sys.executable, str(LLAMA_CHILD), json.dumps(spec)])
        else:
            spec = {"target": cfg.target, "draft": cfg.draft, "dtype": cfg.dtype, "draft_dtype": cfg.draft_dtype,
                    "backend": cfg.backend, "method": m, "gamma": cfg.gamma, "ids": ids,
                    "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "seed": cfg.seed,
                    "num_beams": cfg.num_beams, "length_penalty": cfg.length_penalty,
                    "skip_layers": getattr(cfg, "skip_layers", None),
                    "prefix_cache_mb": getattr(cfg, "prefix_cache_mb", 0),
                    "drafter_options": tree_options(m, getattr(cfg, "tree_width", None), getattr(cfg, "heads", None),
                                                    getattr(cfg, "lookahead", None))}
            out[m] = run_child([sys.executable, "-m", "draftwise.bench.footprint", "own", json.dumps(spec)])
    return out


def _own_child(spec: dict) -> dict:
    t0 = time.perf_counter()
    from ..api import ModelSpec, build_decoder, uses_draft_model
    from ..drafters import registry
    from ..sampling import SamplingParams

    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    model = ModelSpec(spec["target"], spec["draft"], spec["dtype"], spec["draft_dtype"], spec["backend"],
                      spec.get("skip_layers"), prefix_cache_mb=spec.get("prefix_cache_mb", 0))
    dw = build_decoder(model, progress=False)
    if uses_draft_model(spec["method"]):
        dw.draft  # noqa: B018  (the draft model loads lazily: count it in the load)
    opts = spec.get("drafter_options") or {}
    if (m := registry.find(spec["method"])) is not None and m.heads:
        dw.heads(opts.get("heads"), spec["method"])  # the heads too
    load = time.perf_counter() - t1
    params = SamplingParams(temperature=spec["temperature"], max_tokens=spec["max_tokens"], seed=spec["seed"])
    t2 = time.perf_counter()
    r = dw.generate(spec["ids"], params, method=spec["method"], gamma=spec["gamma"], drafter_options=dict(opts),
                    num_beams=spec.get("num_beams", 4), length_penalty=spec.get("length_penalty", 1.0))
    gen = time.perf_counter() - t2
    return {"import_s": t_import, "load_s": load, "generate_s": gen, "new_tokens": len(r.token_ids),
            "peak_rss_mb": peak_rss_mb()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "own":
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print(json.dumps(_own_child(json.loads(argv[1]))))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (the peak is taken already)


if __name__ == "__main__":
    sys.exit(main())
