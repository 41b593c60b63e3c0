"""This machine's measured costs, which the adaptive γ policy, method auto and layerskip's calibration
price drafting with: the seconds of a batch-1 target pass over T new tokens, and of a draft model's
one-token pass. The target's are measured when first needed (about half a second for the 1.5B) with
``gamma.measure_forward_costs`` and kept in ``$DRAFTWISE_HOME/kernels`` per weight file, weight format,
kernel build, CPU and thread count, so that later processes (each ``draftwise generate``) start without
measuring. They are a prior: the adaptive policy fits real step costs as it runs.

A timing taken while something else ran on the machine is slow, and a kept one would mislead every later
process (AMD Zen 4: points kept from a busy minute priced the 0.5B draft's token at 0.67 of the 1.5B's
instead of 0.31, and ``--gamma auto`` stopped drafting: ``draft`` 0.99x ``ar`` on code instead of 1.65x).
So each process first times one target token afresh (``one_token_seconds``, ~0.1 s) and measures again,
replacing what was kept, when the kept one-token pass is over ``STALE`` times slower; and a draft model's
token is priced as its ratio to the target's, the two timed alternately in this process (a busy minute
slows both), times the target's kept one-token pass."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from .gamma import AdaptiveGamma, measure_forward_costs
from .models.base import MAX_TREE_TOKENS

log = logging.getLogger("draftwise")
KEEP_MIN_BYTES = 16 << 20  # smaller weight files (test models) are timed in milliseconds: nothing kept

AUTO_COST_SIZES = (1, 2, 3, 5, 9)  # target pass sizes measured for method auto's cost model
# kept points whose one-token pass is this many times a fresh timing's were measured on a busier machine:
# measured again (this machine's own spread between minutes is ±20 %)
STALE = 1.3
CHECK_CONTEXT = 4  # cached tokens before the one-token passes of one_token_seconds


@torch.inference_mode()
def one_token_seconds(models, rounds: int = 3, context: int = CHECK_CONTEXT) -> list[float]:
    """Seconds of each model's one-token pass after ``context`` cached tokens (the fastest of ``rounds``,
    after a warm-up), the models timed alternately: their ratio then holds whatever else the machine runs."""
    runs = []
    for model in models:
        ids = (torch.arange(context + 1, dtype=torch.long) * 7919 % model.config.vocab_size).view(1, -1)  # (1, C+1)
        cache = model.new_cache(1, context + 2)
        model.forward(ids[:, :context], cache, logits_for="last")
        runs.append((model, ids, cache))
    best = [float("inf")] * len(runs)
    for r in range(rounds + 1):  # round 0 warms up
        for i, (model, ids, cache) in enumerate(runs):
            cache.set_lengths(context)
            t0 = time.perf_counter()
            model.forward(ids[:, context:], cache, logits_for="last")
            if r:
                best[i] = min(best[i], time.perf_counter() - t0)
    for _, _, cache in runs:
        cache.set_lengths(0)
    return best


def model_identity(loaded, min_bytes: int | None = None) -> str | None:
    """What a loaded model's measured costs are kept under: its weight file (path, size, modification time),
    weight format and class; None for a model that is not a local file or folder (a hub id, one built in
    memory) or is smaller than ``min_bytes`` (default KEEP_MIN_BYTES: its costs are measured in each process)."""
    from .models.registry import resolve

    try:
        src = resolve(loaded.name, progress=False)
        if not isinstance(src, Path):
            return None
        st = src.stat()
        if src.is_file() and st.st_size < (KEEP_MIN_BYTES if min_bytes is None else min_bytes):
            return None
        return f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}|{loaded.weights}|{type(loaded.model).__name__}"
    except Exception:  # nothing to key on: measure
        return None


class _Kept:
    """Measured seconds kept on disk for one model on this machine (``kernels._machine_cache``): a dict of
    name -> seconds that later processes read instead of measuring. Nothing is kept without the compiled
    kernel (torch's ops: nothing to key a build on) or without an identity."""

    def __init__(self, identity: str | None):
        self.path = None
        if identity is None:
            return
        from .kernels import _machine_cache, extension

        ext = extension()
        if ext is not None:
            self.path, self.sig = _machine_cache(ext, "costs", identity, ext.isa(), ext.isa_multi(),
                                                 str(torch.get_num_threads()), str(ext.get_threads()))

    def read(self) -> dict[str, float]:
        if self.path is None:
            return {}
        try:
            rec = json.loads(self.path.read_text())
            return {str(k): float(v) for k, v in rec["seconds"].items()} if rec.get("signature") == self.sig else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def add(self, seconds: dict[str, float], *, forget: str = "draft:") -> None:
        """Keep ``seconds`` beside the kept entries, forgetting those whose names start with ``forget`` (by
        default a draft's seconds, kept before they were timed in each process)."""
        if self.path is None:
            return
        try:
            from .kernels import _save_cache

            old = {k: v for k, v in self.read().items() if not k.startswith(forget)}
            _save_cache(self.path, {"seconds": {**old, **seconds}, "signature": self.sig})
        except OSError as e:  # an unwritable home: measured again next time
            log.info("draftwise: measured pass costs not kept (%s)", e)


class PassCosts:
    """``costs(T)``: seconds of a batch-1 target pass over T new tokens on this machine — measured at
    AUTO_COST_SIZES and any size measured for this decoder (``measure``), made non-decreasing (timings
    are noisy), linear in between and beyond. ``seconds``: the measured points. ``identity``: the target's
    ``model_identity`` (computed when first needed), under which measured points are kept on disk; a process
    takes them after one fresh timing agrees (``STALE``)."""

    def __init__(self, target_model, identity=None):
        self.model = target_model
        self.seconds: dict[int, float] = {}  # measured forward seconds over T new tokens
        self._draft: dict[int, float] = {}  # id(draft model) -> seconds of its one-token pass
        self._identity = identity  # () -> str | None
        self._kept: _Kept | None = None
        self._now1: float | None = None  # the target's one-token pass timed in this process (one_token_seconds)
        self._checked = False  # the kept points compared with it

    def _fresh1(self) -> float:
        if self._now1 is None:
            self._now1 = one_token_seconds([self.model])[0]
        return self._now1

    def _kept_points(self) -> dict[str, float]:
        """What earlier processes kept, once per process checked against a fresh one-token timing: points
        whose one-token pass is over STALE times slower were timed on a busier machine, and are dropped
        (from disk too) to be measured again. Points faster than now are kept: the machine is busy now."""
        kept, first = self._store().read(), not self._checked
        self._checked = True
        if not first or "pass1" not in kept:
            return kept
        now = self._fresh1()
        if kept["pass1"] > STALE * now:
            log.info("draftwise: kept pass costs (one token %.1f ms) are slower than now (%.1f ms): measured again",
                     kept["pass1"] * 1e3, now * 1e3)
            self._store().add({}, forget="pass")
            return {k: v for k, v in kept.items() if not k.startswith("pass")}
        return kept

    def _store(self) -> _Kept:
        if self._kept is None:
            self._kept = _Kept(self._identity() if self._identity is not None else None)
        return self._kept

    def measure(self, sizes) -> None:
        """Time the target over each of ``sizes`` new tokens not measured yet (one call for them all), or
        take them from an earlier process's measurement of this model on this machine."""
        missing = sorted(set(sizes) - set(self.seconds))
        if not missing:
            return
        kept = self._kept_points()
        for T in missing:
            if f"pass{T}" in kept:
                self.seconds[T] = kept[f"pass{T}"]
        missing = [T for T in missing if T not in self.seconds]
        if missing:
            measured = dict(zip(missing, measure_forward_costs(self.model, max(missing), sizes=missing)))
            self.seconds.update(measured)
            self._store().add({f"pass{T}": s for T, s in measured.items()})

    def __call__(self, tokens: int) -> float:
        self.measure(AUTO_COST_SIZES)
        pts, top = [], 0.0
        for T, c in sorted(self.seconds.items()):
            top = max(top, c)
            pts.append((T, top))
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            if tokens <= t1 or t1 == pts[-1][0]:
                return max(c0 + (c1 - c0) * (tokens - t0) / (t1 - t0), pts[0][1])
        return pts[0][1]

    def draft_pass(self, draft_model) -> float:
        """Seconds of one single-token pass of ``draft_model``, as the policy compares it with the target's
        passes: its ratio to the target's one-token pass, the two timed alternately in this process (~0.1 s,
        measured once), times the target's kept or measured one-token pass."""
        key = id(draft_model)
        if key not in self._draft:
            target, draft = one_token_seconds([self.model, draft_model])
            if self._now1 is None:
                self._now1 = target  # the fresh timing the kept points are checked against
            self._draft[key] = draft / target * self(1)
        return self._draft[key]


def prime(policy: AdaptiveGamma, costs: PassCosts, *, width: int = 1, per_draft: float = 0.0,
          text_drafts: bool = False) -> AdaptiveGamma:
    """Seed an adaptive policy's cost fit with this machine's measured step costs: a target pass over
    1 + min(k·width, MAX_TREE_TOKENS - 1) tokens (a tree of ``width`` branches, k deep) plus k drafted
    tokens at ``per_draft`` seconds each (``text_drafts``: k + 1 of them, a draft with another tokenizer);
    the fit takes the measured pass costs as a feature (``AdaptiveGamma.set_pass_cost``)."""
    fed = [1 + min(k * width, MAX_TREE_TOKENS - 1) for k in range(policy.max_gamma + 1)]  # tokens per pass
    costs.measure(fed)
    policy.set_pass_cost(costs)  # the fit follows the measured shape of a pass's cost in T
    for k, T in enumerate(fed):
        drafts = k + 1 if text_drafts and k else k
        policy.prime(1, k, costs.seconds[T] + drafts * per_draft)
    return policy


__all__ = ["AUTO_COST_SIZES", "PassCosts", "model_identity", "prime"]
