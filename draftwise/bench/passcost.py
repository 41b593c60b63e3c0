"""What verifying costs: one target forward over T new tokens against one over a single token, and prefill
speed, for draftwise's kernel and (when llama-cpp-python is installed) llama.cpp on the same GGUF.

Speculative decoding pays only when a pass over γ + 1 tokens costs about what a pass over one costs; this
table is the shape every drafter's speed-up is bounded by (``gamma.py`` prices steps with it). Each cell is
the median over ``repeats`` rounds of the fastest of two timings of a forward after ``context`` cached
tokens (all T positions' logits, as verification needs them); prefill is a P-token prompt from an empty
cache as the decode loop prefills it (``prefix.prefill``: exact chunks of up to 128 tokens; the last position's
logits), the median of ``repeats`` rounds after one warm-up round.

    draftwise bench-forward [--target NAME|GGUF] [--sizes 1,2,4,8,16,32] [--llama] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SIZES = (1, 2, 4, 8, 16, 32)
PREFILL = (64, 128, 256, 512)


def _ids(n: int, vocab: int) -> list[int]:
    return [(i * 7919 + 13) % vocab for i in range(n)]


def _timed(run, rewind, context: int, sizes, repeats: int, prefill) -> dict:
    """The table for one engine. ``run(a, b, last)`` feeds prompt tokens a..b-1 after what is cached (logits
    for the last position only, or for all); ``rewind(n)`` keeps the first n cached tokens."""
    rewind(0)
    run(0, context, True)
    rounds: dict[int, list[float]] = {T: [] for T in sizes}
    for _ in range(repeats):
        for T in sizes:
            best = float("inf")
            for _ in range(2):
                rewind(context)
                t0 = time.perf_counter()
                run(context, context + T, False)
                best = min(best, time.perf_counter() - t0)
            rounds[T].append(best)
    times: dict[int, list[float]] = {P: [] for P in prefill or ()}
    for r in range(repeats + 1):  # round 0 warms each length up (its first chunked pass) and is not counted
        for P in times:
            rewind(0)
            t0 = time.perf_counter()
            run(0, P, True)
            if r:
                times[P].append(time.perf_counter() - t0)
    pre = {P: P / statistics.median(v) for P, v in times.items()}
    rewind(0)
    return {"forward_s": {T: statistics.median(v) for T, v in rounds.items()}, "prefill_tok_s": pre}


@torch.inference_mode()
def draftwise_costs(model, sizes=SIZES, context: int = 64, repeats: int = 5, prefill=PREFILL) -> dict:
    """Seconds per forward over T new tokens (median of ``repeats`` bests of two) and prefill tok/s."""
    from ..prefix import prefill as prefill_prompt
    ids = torch.tensor([_ids(context + max(sizes) + max(prefill or [1]), model.config.vocab_size)])  # (1, n)
    cache = model.new_cache(1, ids.shape[1] + 1)

    def run(a: int, b: int, last: bool) -> None:
        if a == 0 and last:  # a prompt, as the decode loop prefills one (exact chunks: prefix.prefill)
            prefill_prompt(model, ids[0, :b].tolist(), cache, logits_for="last")
        else:
            model.forward(ids[:, a:b], cache, logits_for="last" if last else "all")

    return _timed(run, cache.set_lengths, context, sizes, repeats, prefill)


def llama_costs(gguf: str, sizes=SIZES, context: int = 64, repeats: int = 5, prefill=PREFILL,
                threads: int | None = None) -> dict:
    """The same table for llama.cpp (llama-cpp-python) on the same file: ``Llama.eval`` over T tokens after
    ``context`` cached ones (the KV cache trimmed back each time), all logits kept."""
    from .llama_peers import require_llama_cpp

    llama_cpp = require_llama_cpp(["llama-ar"])
    threads = threads or torch.get_num_threads()
    n_ctx = context + max(sizes) + max(prefill or [1]) + 8
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=max(512, max(prefill or [1])), n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    ids = _ids(context + max(sizes) + max(prefill or [1]), llm.n_vocab())

    def rewind(n: int) -> None:
        llm._ctx.kv_cache_seq_rm(-1, n, -1)
        llm.n_tokens = n

    return _timed(lambda a, b, last: llm.eval(ids[a:b]), rewind, context, sizes, repeats, prefill)


def markdown(res: dict) -> str:
    sizes = sorted(int(t) for t in res["draftwise"]["forward_s"])
    rows = [("draftwise", res["draftwise"])] + ([("llama.cpp", res["llama"])] if res.get("llama") else [])
    out = [f"Forward over T new tokens after {res['context']} cached ({res['target']}, {res['threads']} threads, "
           f"{res['cpu']}, kernel path {res['isa']}); ms, and x the cost of T = 1", "",
           "| | " + " | ".join(f"T={t}" for t in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for name, r in rows:
        f = {int(k): v for k, v in r["forward_s"].items()}
        out.append(f"| {name} | " + " | ".join(f"{f[t] * 1e3:.1f} ({f[t] / f[1]:.2f}x)" for t in sizes) + " |")
    pre = sorted(int(p) for p in res["draftwise"]["prefill_tok_s"])
    if pre:
        out += ["", "Prefill (tokens/s) of a P-token prompt", "", "| | " + " | ".join(f"P={p}" for p in pre) + " |",
                "|---|" + "---|" * len(pre)]
        for name, r in rows:
            p = {int(k): v for k, v in r["prefill_tok_s"].items()}
            out.append(f"| {name} | " + " | ".join(f"{p[x]:.1f}" for x in pre) + " |")
    return "\n".join(out) + "\n"


def run(target: str, sizes=SIZES, context: int = 64, repeats: int = 5, prefill=PREFILL, llama: bool = False) -> dict:
    from ..kernels import cpu_name, isa, kernel_info
    from ..models import load_model
    from ..models.registry import resolve

    loaded = load_model(target, "auto", progress=True)
    res = {"target": target, "context": context, "threads": torch.get_num_threads(), "cpu": cpu_name(),
           "isa": isa(), "kernel": kernel_info(), "draftwise": draftwise_costs(loaded.model, sizes, context, repeats,
                                                                              prefill)}
    del loaded
    if llama:
        res["llama"] = llama_costs(str(resolve(target, progress=False)), sizes, context, repeats, prefill)
    return res


def add_arguments(p) -> None:
    from ..api import DEFAULT_TARGET, THREADS_HELP

    p.add_argument("--target", default=DEFAULT_TARGET, help=f"model name or GGUF path (default {DEFAULT_TARGET})")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="new-token counts T (default 1,2,4,8,16,32)")
    p.add_argument("--prefill", default=",".join(map(str, PREFILL)),
                   help="prompt lengths P for prefill tok/s ('' to skip; default 64,128,256,512)")
    p.add_argument("--context", type=int, default=64, help="cached tokens before each forward (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="rounds; each cell is their median (default 5)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--llama", action="store_true", help="also llama.cpp on the same GGUF (llama-cpp-python)")
    p.add_argument("--out", default=None, help="write passcost.json and passcost.md into this folder")


def cmd(a) -> int:
    from ..api import setup_threads
    from ..errors import InvalidParameterError

    setup_threads(a.threads)  # --threads, else the cores this process may use, as every command
    try:
        sizes = tuple(int(s) for s in a.sizes.split(",") if s.strip())
        prefill = tuple(int(s) for s in a.prefill.split(",") if s.strip())
    except ValueError:
        raise InvalidParameterError("--sizes / --prefill take comma-separated integers") from None
    if not sizes or min(sizes) < 1 or 1 not in sizes or (prefill and min(prefill) < 1):
        raise InvalidParameterError("--sizes must list positive counts, 1 among them; --prefill positive lengths")
    if a.context < 1 or a.repeats < 1:
        raise InvalidParameterError("--context and --repeats must be >= 1")
    from ..outputs import out_folder

    out = out_folder(a.out, "--out") if a.out else None  # before minutes of timing
    res = run(a.target, sizes, a.context, a.repeats, prefill, a.llama)
    md = markdown(res)
    print(md)
    if out is not None:
        (out / "passcost.json").write_text(json.dumps(res, indent=1, default=str))
        (out / "passcost.md").write_text(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftwise.bench.passcost", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return cmd(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
