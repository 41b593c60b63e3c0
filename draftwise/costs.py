"""This machine's measured costs, which the adaptive γ policy, method auto and layerskip's calibration
price drafting with: the seconds of a batch-1 target pass over T new tokens, and of a draft model's
one-token pass. Each is measured once, when first needed (about half a second for the 1.5B target and
its draft), with ``gamma.measure_forward_costs``, and kept in ``$DRAFTWISE_HOME/kernels`` per weight
file, weight format, kernel build, CPU and thread count, so that later processes (each ``draftwise
generate``) start without measuring. They are a prior: the adaptive policy fits real step costs as it
runs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .gamma import AdaptiveGamma, measure_forward_costs
from .models.base import MAX_TREE_TOKENS

log = logging.getLogger("draftwise")
KEEP_MIN_BYTES = 16 << 20  # smaller weight files (test models) are timed in milliseconds: nothing kept

AUTO_COST_SIZES = (1, 2, 3, 5, 9)  # target pass sizes measured for method auto's cost model


def model_identity(loaded) -> str | None:
    """What a loaded model's measured costs are kept under: its weight file (path, size, modification time),
    weight format and class; None for a model that is not a local file or folder (a hub id, one built in
    memory) or is smaller than KEEP_MIN_BYTES: its costs are measured in each process."""
    from .models.registry import resolve

    try:
        src = resolve(loaded.name, progress=False)
        if not isinstance(src, Path):
            return None
        st = src.stat()
        if src.is_file() and st.st_size < KEEP_MIN_BYTES:
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

    def add(self, seconds: dict[str, float]) -> None:
        if self.path is None:
            return
        try:
            from .kernels import _save_cache

            _save_cache(self.path, {"seconds": {**self.read(), **seconds}, "signature": self.sig})
        except OSError as e:  # an unwritable home: measured again next time
            log.info("draftwise: measured pass costs not kept (%s)", e)


class PassCosts:
    """``costs(T)``: seconds of a batch-1 target pass over T new tokens on this machine — measured at
    AUTO_COST_SIZES and any size measured for this decoder (``measure``), made non-decreasing (timings
    are noisy), linear in between and beyond. ``seconds``: the measured points. ``identity``: the target's
    ``model_identity`` (computed when first needed), under which measured points are kept on disk."""

    def __init__(self, target_model, identity=None):
        self.model = target_model
        self.seconds: dict[int, float] = {}  # measured forward seconds over T new tokens
        self._draft: dict[int, float] = {}  # id(draft model) -> seconds of its one-token pass
        self._identity = identity  # () -> str | None
        self._kept: _Kept | None = None

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
        kept = self._store().read()
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

    def draft_pass(self, draft_model, identity=None) -> float:
        """Seconds of one single-token pass of ``draft_model`` (measured once; kept on disk beside the target's
        points under ``identity()``, called when first needed, when it gives one)."""
        key = id(draft_model)
        if key not in self._draft:
            ident = identity() if identity is not None else None
            name = f"draft:{ident}" if ident is not None else None
            kept = self._store().read() if name is not None else {}
            if name in kept:
                self._draft[key] = kept[name]
            else:
                self._draft[key] = measure_forward_costs(draft_model, 1, logits_for="last")[0]
                if name is not None:
                    self._store().add({name: self._draft[key]})
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
