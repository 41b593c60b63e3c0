"""Layer-skip self-speculation (Draft & Verify, SWIFT): the target drafts with a subset of its own layers.

The draft model is the target with some decoder layers skipped (the hidden state passes a skipped layer
unchanged), followed by the target's own final norm and LM head: no second model, no training, no second
cache. It drafts in the **target's KV cache** (handed over by the ``Decoder``, ``bind_target_cache``):

- a row holds the target's keys/values of all its tokens but the last (length n - 1 for n tokens);
- draft step j feeds one token at slot n - 1 + j through the kept layers only, which write their K/V
  there; the skipped layers' slots are not touched. The kept layers' cached prefix (slots < n - 1) is
  the full model's, so the first draft sees exactly the target's context;
- after the k draft steps the row's length is set back to n - 1. The verification pass (all layers)
  then writes slots n - 1 .. n - 1 + k in every layer before reading them, so after acceptance the kept
  layers' cache is the full model's again. Slots below n - 1 are never written by a draft step, so the
  target never reads a draft's K/V (nothing to roll back: ``accept`` has nothing to do).

Which layers to skip is **measured** (``calibrate``): the target continues a few snippets of Python
stdlib source greedily (text it generates for itself), then for candidate skip sets the skipped model
drafts chains from positions of that text in the target's own cache — exactly what decoding does — and
the accepted run lengths and the measured cost of a draft pass give an expected speedup

    speedup(S, k) = (1 + A_S(k)) · C(1) / (k · c_S + C(k + 1))

(A_S(k): drafts accepted of k, c_S: a draft pass, C(T): a target pass over T tokens). Candidates: the m
layers whose residual update changes the hidden state least (block influence, 1 - cos(h_in, h_out),
measured on the same text) and the contiguous block of m layers with the least total influence, for
several m; the first and last layers always stay. The best set is cached per target weight file and
format under ``$DRAFTWISE_HOME/layerskip/`` (``SpeculativeDecoder.layerskip_plan``).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..errors import InvalidParameterError
from ..sampling import logits_to_probs, sample, sample_at
from ..sequence import Sequence
from .base import Draft, Needs, StatelessDrafter
from .registry import Method, register

CALIBRATION_VERSION = 1
# (module, where its snippet starts): code and prose (docstrings, comments) the target continues itself
CALIBRATION_SOURCES = (("textwrap", "class TextWrapper"), ("heapq", "__about__ ="), ("fractions", "    def limit_denominator"),
                       ("shlex", "def split("))
SKIP_FRACTIONS = (0.15, 0.25, 0.35, 0.45, 0.55)  # candidate sizes, as fractions of the layers
CALIBRATION_DEPTH = 6  # drafts per measured chain (the expected speedup is maximised over k = 1..this)


def parse_skip_layers(spec: str | Iterable[int], num_layers: int) -> tuple[int, ...]:
    """"3,5,7-12" (or integers) -> sorted layer indices, each in [0, num_layers); at least one layer
    skipped and one kept."""
    if isinstance(spec, str):
        out: set[int] = set()
        for part in (p.strip() for p in spec.split(",")):
            m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
            if not m:
                raise InvalidParameterError(f"--skip-layers: expected layer indices like 3,5,7-12, got {spec!r}")
            lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
            if hi < lo:
                raise InvalidParameterError(f"--skip-layers: empty range {part!r} in {spec!r}")
            out.update(range(lo, hi + 1))
    else:
        vals = list(spec)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in vals):
            raise InvalidParameterError(f"skip_layers: expected integer layer indices, got {vals!r}")
        out = set(vals)
    bad = sorted(i for i in out if not 0 <= i < num_layers)
    if bad:
        raise InvalidParameterError(f"--skip-layers: layer(s) {bad} out of range: the target has {num_layers} "
                                    f"layers, 0..{num_layers - 1}")
    if not out:
        raise InvalidParameterError("--skip-layers: name at least one layer to skip")
    if len(out) == num_layers:
        raise InvalidParameterError(f"--skip-layers: all {num_layers} layers skipped; keep at least one")
    return tuple(sorted(out))


def format_layers(layers: Iterable[int]) -> str:
    """(3, 5, 7, 8, 9) -> "3,5,7-9" (what --skip-layers takes)."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(layers):
        if run and i != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


class LayerSkipDrafter(StatelessDrafter):
    """Drafts k tokens per row with the target minus ``skip`` layers, in the target's own KV cache.

    Greedy rows draft the argmax; seeded rows the coupled draw (the target's position-keyed noise on q,
    one-hot); other sampled rows draw from q, the skipped model's distribution under the same
    temperature / top-k / top-p. No per-sequence state: the verification pass rewrites everything a
    draft step wrote.
    """

    name = "layerskip"
    needs = Needs(target_cache=True)  # drafts in the target's own KV cache (bind_target_cache)

    def __init__(self, model, skip: Iterable[int]):
        if not hasattr(model, "layers"):
            raise InvalidParameterError("method 'layerskip' runs a subset of the target's layers: it needs the "
                                        "native backend (--backend native)")
        L = len(model.layers)
        self.model = model
        self.skip = parse_skip_layers(list(skip), L)
        self.kept = tuple(i for i in range(L) if i not in self.skip)  # the layers a draft pass runs
        self.cache = None  # the target's KV cache (bind_target_cache)

    def bind_target_cache(self, cache) -> None:
        self.cache = cache

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        K = max(ks, default=0)
        if K == 0:
            return [Draft([]) for _ in seqs]
        if self.cache is None:
            raise InvalidParameterError("the layerskip drafter drafts in the target's KV cache: run it through a "
                                        "Decoder (which hands the cache over)")
        B = len(seqs)
        assert all(s.row == i for i, s in enumerate(seqs)), "engine rows must be 0..B-1"
        view = self.cache.view(slice(0, B))
        lengths = view.lengths.clone()  # (B,) each row's n - 1: restored below
        assert lengths.tolist() == [len(s.tokens) - 1 for s in seqs], "cache out of step with the sequences"
        tokens = torch.zeros(B, K, dtype=torch.long)  # (B, K) drafts
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        x = torch.tensor([[s.tokens[-1]] for s in seqs])  # (B, 1)
        try:
            for j in range(K):
                logits = self.model.forward(x, view, logits_for="last", layers=self.kept).logits[:, -1]  # (B, V)
                for i, s in enumerate(seqs):
                    if j >= ks[i]:
                        continue
                    p = s.params
                    if p.greedy:
                        tokens[i, j] = int(logits[i].argmax())
                    elif p.seed is not None:  # coupled draw: the target's keyed noise at that position
                        q = logits_to_probs(logits[i], p)
                        pos = s.num_output + j
                        tokens[i, j] = sample_at(q, p.seed, pos, s.uniforms(pos, q.shape[-1]))
                    else:
                        q = logits_to_probs(logits[i], p)  # (V,)
                        tokens[i, j] = int(sample(q, s.generator))
                        probs[i].append(q)
                x = tokens[:, j:j + 1]
        finally:
            view.set_lengths(lengths)  # the target's valid prefix is untouched: only slots >= n - 1 were written
        return [Draft(tokens[i, :k].tolist(), torch.stack(probs[i]) if probs[i] else None)
                for i, k in enumerate(ks)]


# ---- calibration -------------------------------------------------------------------------------------
@dataclass
class Candidate:
    skip: list[int]
    family: str  # "influence": the m lowest-influence layers; "block": the best contiguous block of m
    accepted: list[float]  # A(j), j = 0..depth: mean drafts accepted when j are drafted
    draft_ratio: float  # a draft pass / a target pass (batch 1, one token), measured
    best_k: int
    speedup: float  # expected tokens/s over plain decoding at best_k


@dataclass
class SkipPlan:
    """The skip set a target drafts with, and what calibration measured for it."""

    skip: list[int]
    num_layers: int
    draft_ratio: float  # seconds of a draft pass / a target pass
    source: str = "calibrated"  # "calibrated" | "given"
    speedup: float | None = None  # expected over plain decoding (calibrated plans)
    best_k: int | None = None
    accepted: list[float] = field(default_factory=list)  # A(j) of the chosen set
    influence: list[float] = field(default_factory=list)  # per layer: 1 - cos(h_in, h_out) (0 for 0, L-1)
    candidates: list[dict] = field(default_factory=list)
    chains: int = 0  # drafting chains measured per candidate
    seconds: float = 0.0  # calibration wall time
    target: str = ""
    weights: str = ""
    version: int = CALIBRATION_VERSION

    def describe(self) -> str:
        kept = self.num_layers - len(self.skip)
        s = (f"skipping {len(self.skip)} of {self.num_layers} layers [{format_layers(self.skip)}] "
             f"(draft pass {self.draft_ratio:.2f}x a target pass, {kept} layers + LM head)")
        if self.speedup is not None:
            acc = ", ".join(f"{a:.2f}" for a in self.accepted[1:])
            s += (f"; calibrated in {self.seconds:.0f}s over {self.chains} chains: drafts accepted of "
                  f"k=1..{len(self.accepted) - 1}: {acc}; expected {self.speedup:.2f}x plain at γ={self.best_k}")
        return s


def calibration_prompts(tokenizer, tokens: int = 48) -> list[list[int]]:
    """Snippets of Python stdlib source (code and prose), ``tokens`` tokens each: never benchmark data."""
    out = []
    for module, anchor in CALIBRATION_SOURCES:
        src = inspect.getsource(importlib.import_module(module))
        at = max(src.find(anchor), 0)
        ids = tokenizer.encode(src[at:at + 16 * tokens])[:tokens]
        if ids:
            out.append(ids)
    return out


def skip_candidates(influence: list[float], fractions=SKIP_FRACTIONS) -> list[tuple[str, tuple[int, ...]]]:
    """(family, skip set) candidates, growing in size: the m lowest-influence inner layers, and the
    contiguous inner block of m with the least total influence (layers 0 and L-1 always stay)."""
    L = len(influence)
    inner = list(range(1, L - 1))
    order = sorted(inner, key=lambda i: (influence[i], i))
    sizes = sorted({min(max(1, round(f * L)), len(inner)) for f in fractions})
    out: list[tuple[str, tuple[int, ...]]] = []
    for m in sizes:
        for fam, s in (("influence", tuple(sorted(order[:m]))),
                       ("block", min((tuple(range(a, a + m)) for a in range(1, L - m)),
                                     key=lambda b: (sum(influence[i] for i in b), b)))):
            if s not in [c for _, c in out]:
                out.append((fam, s))
    return out


def expected_speedup(accepted: list[float], ratio: float, pass_cost: Callable[[int], float]) -> tuple[int, float]:
    """(best k, its expected tokens/s relative to plain decoding) for a drafter whose k drafts keep
    ``accepted[k]`` on average and whose pass costs ``ratio`` target passes."""
    c1 = pass_cost(1)
    rates = [(1 + accepted[k]) * c1 / (k * ratio * c1 + pass_cost(k + 1)) for k in range(1, len(accepted))]
    k = max(range(len(rates)), key=lambda i: rates[i])
    return k + 1, rates[k]


@torch.inference_mode()
def measure_draft_ratio(model, kept: tuple[int, ...], context: int = 32, repeats: int = 4) -> float:
    """Seconds of a one-token pass through ``kept`` layers / through all (batch 1, after ``context``
    tokens; timed alternately, the fastest of ``repeats`` each, so load on the machine hits both alike)."""
    cache = model.new_cache(1, context + 2)
    ids = (torch.arange(context + 1) * 7919 % model.config.vocab_size).view(1, -1)  # (1, C + 1)
    model.forward(ids[:, :context], cache, logits_for="last")
    return _ratio(model, cache.view(slice(0, 1)), ids[:, context:], kept, repeats)


def _ratio(model, row, x: torch.Tensor, kept: tuple[int, ...], repeats: int) -> float:
    n = row.length()
    best = {None: float("inf"), kept: float("inf")}
    for r in range(repeats + 1):
        for layers in (None, kept):
            row.set_lengths(n)
            t0 = time.perf_counter()
            model.forward(x, row, logits_for="last", layers=layers)
            if r:  # the first round warms up
                best[layers] = min(best[layers], time.perf_counter() - t0)
    row.set_lengths(n)
    return best[kept] / best[None]


@torch.inference_mode()
def calibrate(model, prompts: list[list[int]], pass_cost: Callable[[int], float], *, gen_tokens: int = 48,
              depth: int = CALIBRATION_DEPTH, stride: int = 3, fractions=SKIP_FRACTIONS, log: Callable[[str], None] | None = None
              ) -> SkipPlan:
    """Choose the skip set with the best expected speedup, by measurement (see the module docstring).

    ``prompts``: token ids (one cache row each) the target continues greedily for ``gen_tokens`` tokens;
    from every ``stride``-th position of that continuation the candidate drafts up to ``depth`` tokens in
    the target's cache, counting how many match the target's own continuation (its greedy choice there).
    ``pass_cost(T)``: seconds of a batch-1 target pass over T new tokens (T = 1..depth + 1)."""
    t_start = time.perf_counter()
    L = len(model.layers)
    if L < 3:
        raise InvalidParameterError(f"layer skipping needs a target with at least 3 layers, this one has {L}")
    if not prompts or gen_tokens <= depth:
        raise InvalidParameterError("calibration needs prompts and gen_tokens > depth")
    B = len(prompts)
    cache = model.new_cache(B, max(len(p) for p in prompts) + gen_tokens + 1)
    seqs, influence = _prefill_with_influence(model, prompts, cache)
    view = cache.view(slice(0, B))
    _continue_greedily(model, view, seqs, gen_tokens)
    chains = _Chains(model, cache, view, prompts, seqs, depth, stride)
    cands: list[Candidate] = []
    dead: set[str] = set()  # families whose drafts stopped being accepted: larger sets only do worse
    for fam, skip in skip_candidates(influence, fractions):
        if fam in dead:
            continue
        kept = tuple(i for i in range(L) if i not in skip)
        runs = chains.accepted_runs(kept)
        accepted = [sum(min(r, j) for r in runs) / len(runs) for j in range(depth + 1)]
        view.set_lengths([len(s) - 1 for s in seqs])
        ratio = _ratio(model, cache.view(slice(0, 1)), torch.tensor([[seqs[0][-1]]]), kept, repeats=3)
        k, speed = expected_speedup(accepted, ratio, pass_cost)
        cands.append(Candidate(list(skip), fam, accepted, ratio, k, speed))
        if log:
            log(f"layerskip calibration: skip {format_layers(skip):<24} ({fam}) accepted of 1..{depth}: "
                f"{' '.join(f'{a:.2f}' for a in accepted[1:])} draft pass {ratio:.2f}x -> {speed:.2f}x at γ={k}")
        if accepted[1] < 0.25:
            dead.add(fam)
    best = max(cands, key=lambda c: c.speedup)
    return SkipPlan(skip=best.skip, num_layers=L, draft_ratio=best.draft_ratio, speedup=best.speedup,
                    best_k=best.best_k, accepted=best.accepted, influence=influence,
                    candidates=[asdict(c) for c in cands], chains=chains.rounds * B,
                    seconds=time.perf_counter() - t_start)


def _prefill_with_influence(model, prompts: list[list[int]], cache) -> tuple[list[list[int]], list[float]]:
    """Prefill each prompt into its cache row, recording the residual stream entering every layer. Returns
    each prompt plus the target's greedy next token, and each layer's block influence: 1 - cos(h_i, h_{i+1})
    averaged over the prompts' tokens (0 for the first and last layers, which are never skipped)."""
    L = len(model.layers)
    entering: list[list[torch.Tensor]] = [[] for _ in range(L)]  # [layer] -> (T, D) per prompt
    hooks = [layer.attn_norm.register_forward_hook(
        lambda mod, args, out, i=i: entering[i].append(args[0][0].float())) for i, layer in enumerate(model.layers)]
    seqs = []
    try:
        for b, p in enumerate(prompts):
            out = model.forward(torch.tensor([p]), cache.view(slice(b, b + 1)), logits_for="last")
            seqs.append(list(p) + [int(out.logits[0, -1].argmax())])
    finally:
        for h in hooks:
            h.remove()
    influence = [0.0] * L
    for i in range(1, L - 1):
        h0, h1 = torch.cat(entering[i]), torch.cat(entering[i + 1])  # (N, D)
        influence[i] = float(1 - torch.nn.functional.cosine_similarity(h0, h1, dim=-1).mean())
    return seqs, influence


def _continue_greedily(model, view, seqs: list[list[int]], gen_tokens: int) -> None:
    """The target's own greedy continuation of every row to ``gen_tokens`` tokens, appended to ``seqs``:
    all rows in one batch, one token per row (the decode path)."""
    for _ in range(gen_tokens - 1):
        nxt = model.forward(torch.tensor([[s[-1]] for s in seqs]), view, logits_for="last").logits[:, -1].argmax(-1)
        for s, t in zip(seqs, nxt.tolist()):
            s.append(t)


class _Chains:
    """Draft chains of a candidate layer set in the target's own cache, scored against its continuation.

    The rows hold the target's K/V of all their tokens but the last. Chains start at positions t (feeding
    token t at slot t) from the last prompt token on, every ``stride``-th, latest first: a chain writes slots
    t..t+depth-1, which later (earlier-starting) chains never read; the slots chains overwrite are restored
    after each candidate."""

    def __init__(self, model, cache, view, prompts: list[list[int]], seqs: list[list[int]], depth: int, stride: int):
        self.model, self.cache, self.view, self.seqs, self.depth = model, cache, view, seqs, depth  # view: all rows
        self.starts = [list(range(len(s) - 1 - depth, len(p) - 2, -stride)) for s, p in zip(seqs, prompts)]
        self.rounds = min(len(t) for t in self.starts)
        self.lo = min(len(p) for p in prompts) - 1
        self.saved = (cache.k[:, :, :, self.lo:].clone(), cache.v[:, :, :, self.lo:].clone())

    def accepted_runs(self, kept: tuple[int, ...]) -> list[int]:
        """For every chain: how many of its drafts (through the ``kept`` layers only, up to ``depth``) match
        the target's continuation before the first that does not."""
        seqs, B = self.seqs, len(self.seqs)
        runs: list[int] = []
        for r in range(self.rounds):
            ts = [t[r] for t in self.starts]
            self.view.set_lengths(ts)
            x = torch.tensor([[s[t]] for s, t in zip(seqs, ts)])  # (B, 1)
            run, alive = [0] * B, [True] * B
            for j in range(self.depth):
                d = self.model.forward(x, self.view, logits_for="last", layers=kept).logits[:, -1].argmax(-1).tolist()
                for b in range(B):
                    alive[b] = alive[b] and d[b] == seqs[b][ts[b] + 1 + j]
                    run[b] += alive[b]
                if not any(alive):
                    break
                x = torch.tensor([[s[t + 1 + j]] for s, t in zip(seqs, ts)])  # = the drafts where alive
            runs += run
        self.cache.k[:, :, :, self.lo:], self.cache.v[:, :, :, self.lo:] = self.saved
        return runs


# ---- the plan cache ------------------------------------------------------------------------------------
def plan_path(home: Path, identity: str, weights: str, name: str) -> Path:
    """Where the plan of a target weight file (``identity``: its sha256) in format ``weights`` is kept."""
    key = hashlib.sha256(f"{identity}|{weights}|{CALIBRATION_VERSION}".encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(name)).name)[:60] or "target"
    return home / "layerskip" / f"{stem}-{weights}-{key}.json"


def load_plan(path: Path, num_layers: int) -> SkipPlan | None:
    """The cached plan at ``path``, or None when there is none (or it does not fit this target)."""
    try:
        plan = SkipPlan(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    ok = plan.version == CALIBRATION_VERSION and plan.num_layers == num_layers and plan.skip \
        and all(0 <= i < num_layers for i in plan.skip) and len(plan.skip) < num_layers
    return plan if ok else None


def save_plan(plan: SkipPlan, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(plan), indent=1))
    tmp.replace(path)



def plan_for(target, skip: list[int] | None, identity, costs, progress: bool = True) -> "SkipPlan":
    """The ``SkipPlan`` of a loaded target (a ``LoadedModel``): the layers ``skip`` (parsed) with their
    draft pass timed; or (None) the set calibrated for this target weight file and format — measured once
    (``calibrate``, about a minute for the 1.5B target on 2 cores) and kept under ``$DRAFTWISE_HOME/
    layerskip/`` (``identity()``: the weight file's sha256). ``costs``: the decoder's ``PassCosts``. Says
    which layers it skips on stderr."""
    import sys

    from .. import settings

    L = target.config.num_layers
    if skip is not None:
        kept = tuple(i for i in range(L) if i not in skip)
        plan, where = SkipPlan(list(skip), L, measure_draft_ratio(target.model, kept), source="given"), "as given"
    else:
        path = plan_path(settings.home(), identity(), target.weights, target.name)
        plan, where = load_plan(path, L), f"cached in {path}"
        if plan is None:
            costs.measure(range(1, CALIBRATION_DEPTH + 2))  # target passes over k + 1 tokens
            if progress:
                print(f"draftwise: layerskip: no skip set measured for {target.name} ({target.weights}) "
                      "yet: calibrating once (about a minute) ...", file=sys.stderr)
            log = (lambda m: print(f"draftwise: {m}", file=sys.stderr)) if progress else None
            plan = calibrate(target.model, calibration_prompts(target.tokenizer), lambda T: costs.seconds[T], log=log)
            plan.target, plan.weights = str(target.name), target.weights
            save_plan(plan, path)
            where = f"saved to {path}"
    print(f"draftwise: layerskip: {plan.describe()} ({where})", file=sys.stderr)
    return plan

def _build(dw, rows: int, capacity: int, skip_layers=None, branches: int | None = None,
           **opts) -> LayerSkipDrafter:
    """Option skip_layers: instead of the plan's set (``dw.layerskip_plan``). A chain drafter: no branches."""
    return LayerSkipDrafter(dw.target.model, dw.layerskip_plan(skip_layers).skip, **opts)


register(Method("layerskip", _build, help="the target drafts with a measured subset of its own layers"))
