"""``draftwise bench``: every requested method — the engine's, the HF peers' and (optional) the llama.cpp
peers' — on the same prompts,
model files, dtype and budget, in one process; warm-up excluded; methods interleaved per prompt (and
their order rotated) so the machine's drift hits all alike. Writes results.json, report.md and plots.

Timing: wall clock around each ``generate`` call on pre-tokenized prompt ids (the same ids for every
method), prefill included, tokenization excluded — the same measurement for the engine and the peers.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..api import BEAM, DEFAULT_DRAFT, DEFAULT_TARGET, tree_options
from ..drafters import registry
from ..digest import sha256_file
from ..errors import InvalidParameterError
from .. import gamma
from . import report
from .llama_peers import LLAMA_PEERS, LlamaPeers, context_size, require_llama_cpp
from .peers import PEERS
from .prompts import Prompt, load_prompts
from .roofline import measure_bandwidth, roofline


DEFAULT_METHODS = ("ar", "draft", "pld", "nasd")


def all_methods() -> tuple[str, ...]:
    return (*registry.names(), BEAM, *PEERS, *LLAMA_PEERS)


def training_free() -> tuple[str, ...]:
    """"all": the registered methods that need no trained heads."""
    return tuple(n for n, m in registry.methods().items() if not m.heads)


def parse_methods(spec: str) -> list[str]:
    """"ar,draft,hf-ar" → ["ar", "draft", "hf-ar"]; "all" → every engine method that needs no trained heads,
    and every HF peer (head methods and the llama.cpp peers, an optional install, only by name:
    "all,medusa,llama-ar"). ``ar`` (the reference of every speedup and output check) is added first when
    missing."""
    names = [n for m in spec.split(",") if m.strip()
             for n in ((*training_free(), *PEERS) if m.strip() == "all" else (m.strip(),))]
    unknown = [m for m in names if m not in all_methods()]
    if unknown or not names:
        what = f"unknown method {unknown[0]!r}" if unknown else "no methods given"
        raise InvalidParameterError(f"{what}; choose from {', '.join(all_methods())} (or all)")
    names = list(dict.fromkeys(names))
    return names if report.REFERENCE in names else [report.REFERENCE, *names]


def parse_gamma(s: str | int) -> int | str:
    """An integer γ >= 1, or a policy name (e.g. "auto") passed through to the engine."""
    return gamma.parse_gamma(s, any_policy=True)


@dataclass
class BenchConfig:
    target: str = DEFAULT_TARGET
    draft: str | None = DEFAULT_DRAFT
    dtype: str = "auto"
    draft_dtype: str | None = None  # None: models.default_draft_weights(dtype, backend)
    backend: str = "native"
    gamma: int | str = "auto"
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    prompts: str | None = None  # None: Spec-Bench next to the repository
    categories: list[str] | None = None
    limit: int | None = None  # per category
    max_tokens: int = 128
    chat: bool = False
    temperature: float = 0.0
    seed: int | None = None
    warmup_tokens: int = 8
    bandwidth_gib: float = 0.5  # 0: skip the roofline measurement
    footprint: bool = True  # peak RSS and load time per method, each in a fresh process
    num_beams: int = 4  # method "beam"
    tree_width: int | None = None  # the *-tree methods' branches (None: TREE_WIDTH; heads: head_width), suffix's nodes
    heads: str | None = None  # draft heads folder(s), comma-separated (methods medusa, eagle)
    lookahead: str | None = None  # method lookahead's "W,N,G" (None: its defaults)
    skip_layers: str | None = None  # method layerskip: the layers skipped (None: the calibrated set)
    # MiB of prompt keys and values kept across prompts (0: none, so every method prefills each prompt as the
    # peers do; the same prompt runs once per method)
    prefix_cache_mb: float = 0.0
    length_penalty: float = 1.0
    out: str = "bench-out"


def _versions(llama: LlamaPeers | None = None) -> dict:
    import transformers

    from .. import __version__

    v = {"draftwise": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
         "python": platform.python_version()}
    if llama is not None:
        v["llama_cpp"] = getattr(llama.llama_cpp, "__version__", None)
    return v


def checkout_commit(repo: Path) -> str | None:
    """The short commit of the git checkout at ``repo`` (None where it is none: an installed wheel), with
    "+dirty" where tracked files other than the documentation (``docs/``, ``*.md``) differ from it: edits to
    what runs, not to what describes it."""
    import subprocess

    if not (repo / ".git").exists():
        return None
    git = ["git", "-C", str(repo)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)docs", ":(exclude)*.md"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def _provenance() -> dict:
    """Where the numbers come from: the CPU's name and family (/proc/cpuinfo), the kernel paths used, and the
    git commit of the checkout draftwise runs from (``checkout_commit``)."""
    from ..kernels import cpu_fields, cpu_name, kernel_info

    cpu = {k: v for k, v in cpu_fields().items() if k in ("cpu family", "model", "CPU implementer", "CPU part")}
    name = cpu_name()
    info = kernel_info()
    commit = checkout_commit(Path(__file__).resolve().parents[2])
    return {"cpu": name, "cpu_id": "; ".join(f"{k} {v}" for k, v in cpu.items()), "isa": info["isa"],
            "isa_multi_row": info.get("isa_multi_row"), "commit": commit}


class Runner:
    """Runs one method on one prompt and returns a record: new tokens, wall, stats, token ids, text."""

    def __init__(self, cfg: BenchConfig, progress: bool):
        from ..api import ModelSpec, build_decoder
        from ..models.registry import resolve
        from ..sampling import SamplingParams

        self.cfg = cfg
        self.params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.seed)
        peers = [m for m in cfg.methods if m in PEERS]
        llama = [m for m in cfg.methods if m in LLAMA_PEERS]
        if llama:  # before loading anything: one clear line when llama-cpp-python is missing
            require_llama_cpp(llama)
        # the draft model is loaded lazily, by the first method that drafts with it (during warm-up)
        self.dw = build_decoder(ModelSpec.from_args(cfg), progress=progress)
        self.peers = None
        if peers:  # loaded once, only when asked for
            from ..models import peer_dtype
            from .peers import HFPeers

            if progress:
                print("draftwise bench: loading the HF peers' models with transformers ...", file=sys.stderr)
            self.peers = HFPeers(resolve(cfg.target, progress),
                                 resolve(cfg.draft, progress) if "hf-assisted" in peers and cfg.draft else None,
                                 peer_dtype(self.dw.target.weights), peers, cfg.gamma, self.dw.tokenizer.eos_ids)
        self.llama = None
        if llama:  # the contexts are created by prepare(), once the longest prompt is known
            self.llama = LlamaPeers(resolve(cfg.target, progress), llama, cfg.gamma, self.dw.tokenizer.eos_ids,
                                    torch.get_num_threads())

    def prepare(self, longest: int) -> None:
        """Size and load what depends on the prompts: the llama.cpp contexts (prompt + budget tokens)."""
        if self.llama is not None:
            self.llama.load(context_size(longest + self.cfg.max_tokens, self.dw.target.config.max_context))

    def peer_settings(self) -> dict:
        return {**(self.peers.settings() if self.peers else {}), **(self.llama.settings() if self.llama else {})}

    def encode(self, p: Prompt) -> list[int]:
        return self.dw.encode(p.text, chat=self.cfg.chat)

    def run(self, method: str, ids: list[int], max_tokens: int | None = None) -> dict:
        n = max_tokens or self.cfg.max_tokens
        if method in PEERS or method in LLAMA_PEERS:
            t0 = time.perf_counter()
            r = (self.peers if method in PEERS else self.llama).generate(method, ids, n, self.cfg.temperature)
            wall = r.wall_s or time.perf_counter() - t0
            rec = {"new_tokens": len(r.token_ids), "drafted": r.drafted, "accepted": r.accepted,
                   "target_passes": r.target_passes, "prefill_s": r.prefill_s, "verify_s": r.verify_s,
                   "draft_s": max(0.0, wall - r.prefill_s - r.verify_s), "finish_reason": r.finish_reason,
                   "token_ids": r.token_ids, "past_eos": r.past_eos}
        else:
            params = self.params if max_tokens is None else replace(self.params, max_tokens=n)
            t0 = time.perf_counter()
            try:
                res = self.dw.generate(ids, params, method=method, gamma=self.cfg.gamma,
                                       num_beams=self.cfg.num_beams, length_penalty=self.cfg.length_penalty,
                                       drafter_options=tree_options(method, self.cfg.tree_width, self.cfg.heads,
                                                                    self.cfg.lookahead))
            except (AttributeError, TypeError) as e:
                if isinstance(self.cfg.gamma, str):  # a policy name this engine does not know yet
                    raise InvalidParameterError(f"gamma {self.cfg.gamma!r} is not supported by this engine "
                                                f"({type(e).__name__}: {e})") from None
                raise
            wall = time.perf_counter() - t0
            s = res.stats
            rec = {"new_tokens": s.new_tokens, "drafted": s.drafted, "accepted": s.accepted,
                   "target_passes": s.target_passes, "prefill_s": s.prefill_s, "draft_s": s.draft_s,
                   "verify_s": s.verify_s, "engine_wall_s": s.wall_s, "finish_reason": res.finish_reason,
                   "token_ids": res.token_ids}
        rec["wall_s"] = wall
        rec["tokens_per_s"] = rec["new_tokens"] / wall if wall > 0 else 0.0
        rec["acceptance_rate"] = rec["accepted"] / rec["drafted"] if rec["drafted"] else None
        rec["mean_accepted_length"] = rec["new_tokens"] / rec["target_passes"] if rec["target_passes"] else None
        rec["text"] = self.dw.tokenizer.decode(rec["token_ids"])
        return rec


def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=not enabled)


def run_bench(cfg: BenchConfig, progress: bool = True, log=None) -> dict:
    """Run the benchmark described by ``cfg``; return the results (the shape of results.json)."""
    log = log or (lambda msg: print(f"draftwise bench: {msg}", file=sys.stderr) if progress else None)
    if cfg.max_tokens < 1:
        raise InvalidParameterError(f"--max-tokens must be >= 1, got {cfg.max_tokens}")
    cfg.gamma = parse_gamma(cfg.gamma)
    methods = cfg.methods = parse_methods(",".join(cfg.methods))
    _check_before_loading(cfg, methods, progress)
    path, prompts = load_prompts(cfg.prompts, cfg.categories, cfg.limit)  # fail before loading models
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")

    log(f"loading models for {', '.join(methods)} ...")
    runner = Runner(cfg, progress)
    work, skipped = _fitting_prompts(runner, prompts, cfg.max_tokens)
    runner.prepare(max(len(ids) for _, ids in work))
    bw = None
    if cfg.bandwidth_gib > 0:
        log("measuring memory bandwidth ...")
        bw = measure_bandwidth(cfg.bandwidth_gib)

    per_prompt, interrupted = _timed_runs(runner, methods, work, cfg.warmup_tokens, progress)

    # greedy: every method is checked against `ar` (peers also against their own plain decoding); seeded
    # sampling: draftwise's methods still equal `ar` token for token (position-keyed draws), peers not
    greedy = cfg.temperature == 0.0
    checked = greedy or cfg.seed is not None
    mismatches = report.find_mismatches(
        per_prompt, methods if greedy else [m for m in methods if not report.is_peer(m)]) if checked else []
    agg = report.aggregate(per_prompt, methods, mismatches, greedy)
    rf = None
    if bw is not None:
        rf = roofline(runner.dw.target.model, bw["gb_per_s"], agg[report.REFERENCE]["tokens_per_s"])
        rf["bandwidth"] = bw
    config = {**asdict(cfg), "prompts": str(path), "prompts_sha256": sha256_file(path), "methods": methods,
              "categories": report.categories_of(per_prompt), "n_prompts": len(per_prompt),
              "reference": report.REFERENCE, "outputs_checked": checked, "peers_checked": greedy, "interrupted": interrupted,
              "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
              "versions": _versions(runner.llama), **_provenance(), "started": started,
              "timing": "wall clock per generate call on pre-tokenized ids, prefill included; warm-up excluded; "
                        "methods interleaved per prompt, order rotated",
              "peers": runner.peer_settings()}
    footprint = None
    llama_ctx = runner.llama.n_ctx if runner.llama is not None else None
    if runner.llama is not None:
        runner.llama.close()  # the llama.cpp contexts (KV caches, logits buffers) are not needed past here
    if cfg.footprint and not interrupted:
        from .footprint import measure as measure_footprint

        footprint = measure_footprint(methods, cfg, work[0][1], llama_ctx, runner.dw.tokenizer.eos_ids,
                                      torch.get_num_threads(), log)
    return {"methods": agg, "config": config, "roofline": rf, "footprint": footprint, "mismatches": mismatches,
            "skipped": skipped, "per_prompt": per_prompt}


def _check_before_loading(cfg: BenchConfig, methods: list[str], progress: bool) -> None:
    """Refuse a run that would fail part-way, before any model is loaded: a heads method without heads for
    this target, beam search with sampling, a llama.cpp peer without llama.cpp."""
    if any(registry.get(m).heads for m in methods if registry.find(m)):  # heads: --heads or the target's default
        from ..heads import resolve_heads, target_identity
        from ..models.registry import resolve

        src = resolve(cfg.target, progress)
        sha = target_identity(src)
        for m in methods:
            if registry.find(m) and registry.get(m).heads:
                resolve_heads(cfg.heads, registry.get(m).heads, src, sha, cfg.target)
    if BEAM in methods:  # greedy only
        from ..beam import check_beam_params
        from ..sampling import SamplingParams

        check_beam_params(SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens), cfg.num_beams,
                          cfg.length_penalty)
    if llama := [m for m in methods if m in LLAMA_PEERS]:
        require_llama_cpp(llama)


def _fitting_prompts(runner: Runner, prompts: list[Prompt], max_tokens: int) -> tuple[list, list[dict]]:
    """The prompts, tokenized, that fit the target's context with ``max_tokens`` more ((prompt, ids) pairs),
    and a record of each one skipped; none fitting is an error."""
    max_context = runner.dw.target.config.max_context
    work, skipped = [], []
    for p in prompts:
        ids = runner.encode(p)
        if len(ids) + max_tokens > max_context:
            skipped.append({"question_id": p.question_id, "category": p.category,
                            "reason": f"prompt {len(ids)} + max_tokens {max_tokens} tokens > context "
                                      f"{max_context}"})
        else:
            work.append((p, ids))
    if not work:
        raise InvalidParameterError("no prompt fits the model's context with this --max-tokens")
    return work, skipped


def _timed_runs(runner: Runner, methods: list[str], work: list, warmup_tokens: int,
                progress: bool) -> tuple[list[dict], bool]:
    """One untimed warm-up generation per method, then every method on every prompt, interleaved per prompt
    with the order rotated. Returns the per-prompt records and whether Ctrl-C stopped the run early (the
    prompts finished by then are kept)."""
    per_prompt: list[dict] = []
    interrupted = False
    with _progress(progress) as bar:
        task = bar.add_task("warm-up", total=len(methods) * (len(work) + 1))
        for m in methods:  # warm-up: one short generation per method, not timed
            bar.update(task, description=f"warm-up {m}")
            runner.run(m, work[0][1], max_tokens=min(warmup_tokens, runner.cfg.max_tokens))
            bar.advance(task)
        runner.dw.suffix_cache.clear()  # the warm-up's output must not draft the first prompt's timed run
        try:
            for i, (p, ids) in enumerate(work):
                order = methods[i % len(methods):] + methods[:i % len(methods)]
                runs = {}
                with runner.dw.suffix_cache.deferred():  # suffix drafts from earlier prompts, not this one's
                    for m in order:                      # output by another method
                        bar.update(task, description=f"{p.category}:{p.question_id} {m}")
                        runs[m] = runner.run(m, ids)
                        bar.advance(task)
                per_prompt.append({"question_id": p.question_id, "category": p.category,
                                   "subcategory": p.subcategory, "prompt_tokens": len(ids), "order": order,
                                   "runs": {m: runs[m] for m in methods}})
                if progress:  # one line per prompt (above the bar; the only output when stderr is a file)
                    bar.console.print(f"{i + 1}/{len(work)} {p.category}:{p.question_id} tok/s " + " ".join(
                        f"{m} {runs[m]['tokens_per_s']:.2f}" for m in methods), highlight=False)
        except KeyboardInterrupt:  # a long run stopped early still reports the prompts it finished
            if not per_prompt:
                raise
            interrupted = True
    return per_prompt, interrupted


__all__ = ["BenchConfig", "all_methods", "parse_gamma", "parse_methods", "run_bench", "training_free"]
