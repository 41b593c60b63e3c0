"""The library's front: load a target (and a drafter), generate text with any method.

    from draftwise import SpeculativeDecoder, SamplingParams
    dw = SpeculativeDecoder("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct")
    out = dw.generate("def quicksort(arr):", SamplingParams(max_tokens=128), method="draft")
    print(out.text, out.stats.acceptance_rate, out.stats.mean_accepted_length)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .beam import beam_search
from .decode import MAX_TREE_TOKENS, Decoder, FixedGamma, GammaPolicy
from .gamma import AdaptiveGamma, measure_forward_costs
from .drafters.base import Drafter
from .drafters.draft_model import DraftModelDrafter, check_compatible
from .drafters.nasd import NASDDrafter
from .drafters.pld import PromptLookupDrafter
from .errors import InvalidParameterError
from .models import LoadedModel, load_model
from .sampling import SamplingParams
from .sequence import GenerationStats, Sequence

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
METHODS = ("ar", "draft", "pld", "nasd", "draft-tree", "pld-tree", "nasd-tree", "medusa")
HEAD_METHODS = ("medusa",)  # draft heads trained on the target (``draftwise train-head``), token trees
TREE_SUFFIX = "-tree"  # the same drafter proposing a token tree (``branches`` > 1, default TREE_WIDTH)
TREE_WIDTH = 3


def drafter_kind(method: str) -> tuple[str, bool]:
    """"pld-tree" -> ("pld", True); "draft" -> ("draft", False)."""
    return (method[:-len(TREE_SUFFIX)], True) if method.endswith(TREE_SUFFIX) else (method, False)


def uses_draft_model(method: str) -> bool:
    return drafter_kind(method)[0] == "draft"


def tree_options(method: str, width: int, heads: str | None = None) -> dict:
    """drafter options: a tree method's branches, a head method's heads folder."""
    opts: dict = {"branches": width} if method.endswith(TREE_SUFFIX) or method in HEAD_METHODS else {}
    if method in HEAD_METHODS and heads:
        opts["heads"] = heads
    return opts
BEAM = "beam"  # beam search: a baseline beside the lossless methods (another search, not ar's output)
AUTO_MAX_GAMMA = 8  # the adaptive policy chooses γ in [0, 8] per step


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    kinds: list[str]  # per token: plain / accepted / recovered / bonus
    method: str
    finish_reason: str
    stats: GenerationStats

    def to_json(self) -> dict:
        s = self.stats.summary()
        keys = ("new_tokens", "drafted", "accepted", "acceptance_rate", "mean_accepted_length",
                "tokens_per_s", "wall_s")
        extra = {k: v for k, v in s.items() if k not in keys}
        return {"text": self.text, "token_ids": self.token_ids, "method": self.method,
                "finish_reason": self.finish_reason, "stats": {**{k: s[k] for k in keys}, **extra}}


def output_text(seq: Sequence, detok) -> str:
    ids = seq.output_ids
    text = detok(ids)
    return text[:seq.stop_text_end] if seq.stop_text_end is not None else text


class SpeculativeDecoder:
    """A target model plus whatever the methods need (a draft model is loaded lazily when asked for)."""

    def __init__(self, target: str | LoadedModel = DEFAULT_TARGET, draft: str | LoadedModel | None = DEFAULT_DRAFT,
                 *, dtype: str = "auto", draft_dtype: str | None = None, backend: str = "native",
                 progress: bool = True):
        self.dtype, self.backend, self.progress = dtype, backend, progress
        self.draft_dtype = draft_dtype or dtype
        self.target = target if isinstance(target, LoadedModel) else load_model(target, dtype, backend, progress)
        self._draft_ref = draft
        self._heads: dict[str, object] = {}
        self._auto: dict[str, AdaptiveGamma] = {}  # per method: step costs are learned across requests
        self._target_costs: dict[int, float] = {}  # measured forward seconds over T new tokens (prime)
        self._draft_cost: float | None = None
        self._draft: LoadedModel | None = draft if isinstance(draft, LoadedModel) else None
        if self._draft is not None:
            self._check_draft(self._draft)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def draft(self) -> LoadedModel:
        if self._draft is None:
            if self._draft_ref is None:
                raise InvalidParameterError("method 'draft' needs a draft model (--draft NAME_OR_PATH)")
            d = load_model(self._draft_ref, self.draft_dtype, self.backend, self.progress)
            self._check_draft(d)
            self._draft = d
        return self._draft

    def heads(self, folder: str):
        """Draft heads from ``folder`` (loaded once), checked against this target's weight file."""
        if folder not in self._heads:
            from .heads import load_heads, target_identity
            from .models.registry import resolve

            if self.backend != "native":
                raise InvalidParameterError("draft heads need the native backend")
            sha = target_identity(resolve(self.target.name, progress=False))
            self._heads[folder] = load_heads(folder, sha).for_inference()
        return self._heads[folder]

    def _check_draft(self, d: LoadedModel) -> None:
        check_compatible(self.target.tokenizer, d.tokenizer, self.target.config, d.config)

    def encode(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return self.tokenizer.apply_chat(prompt)
        if not prompt:
            raise InvalidParameterError("empty prompt")
        if chat:
            return self.tokenizer.apply_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def make_drafter(self, method: str, rows: int, capacity: int, **opts) -> Drafter | None:
        if method == "ar":
            return None
        base, tree = drafter_kind(method)
        opts = {"branches": TREE_WIDTH if tree else 1, **opts}
        if method in METHODS and base == "draft":
            return DraftModelDrafter(self.draft.model, rows, capacity, **opts)
        if method in METHODS and base == "pld":
            return PromptLookupDrafter(**opts)
        if method in METHODS and base == "nasd":
            return NASDDrafter(**opts)
        if method == "medusa":
            from .drafters.medusa import MedusaDrafter

            heads = opts.pop("heads", None)
            if not heads:
                raise InvalidParameterError("method 'medusa' needs draft heads (--heads DIR, trained with "
                                            "`draftwise train-head --kind medusa`)")
            opts["branches"] = opts.get("branches", TREE_WIDTH)
            return MedusaDrafter(self.heads(heads), **opts)
        raise InvalidParameterError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")

    def gamma_policy(self, method: str, gamma: int | str | GammaPolicy, params: SamplingParams | None = None
                     ) -> GammaPolicy:
        """An int is a fixed γ; "auto" the adaptive policy of this method (its measured step costs are
        kept across requests, acceptance is tracked per request). Seeded requests may take it too: their
        draws are position-keyed, so the text does not depend on the γ chosen (sampling.py)."""
        if isinstance(gamma, bool):
            raise InvalidParameterError(f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
        if isinstance(gamma, int):
            return FixedGamma(gamma)
        if isinstance(gamma, str):
            if gamma.strip().isdigit():
                return FixedGamma(int(gamma))
            if gamma != "auto":
                raise InvalidParameterError(f"gamma must be an integer >= 1 or 'auto', got {gamma!r}")
            if method not in self._auto:
                self._auto[method] = self.prime(AdaptiveGamma(AUTO_MAX_GAMMA), method)
            return self._auto[method]
        return gamma

    def prime(self, policy: AdaptiveGamma, method: str) -> AdaptiveGamma:
        """Seed an adaptive policy's cost fit with this machine's measured step costs for ``method``:
        a target pass over k + 1 tokens plus, for the draft model, k single-token draft passes. Measured
        once per process (about two seconds for the 1.5B target)."""
        if method == "ar" or self.backend != "native":
            return policy
        base, tree = drafter_kind(method)
        width = TREE_WIDTH if tree or method in HEAD_METHODS else 1
        fed = [1 + min(k * width, MAX_TREE_TOKENS - 1) for k in range(policy.max_gamma + 1)]  # tokens per pass
        missing = sorted(set(fed) - set(self._target_costs))
        if missing:
            self._target_costs.update(zip(missing, measure_forward_costs(self.target.model, max(missing),
                                                                         sizes=missing)))
        per_draft = 0.0
        if base == "draft":
            if self._draft_cost is None:
                self._draft_cost = measure_forward_costs(self.draft.model, 1, logits_for="last")[0]
            per_draft = self._draft_cost
        for k, T in enumerate(fed):
            policy.prime(1, k, self._target_costs[T] + k * per_draft)
        return policy

    def generate(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None, *,
                 method: str = "draft", gamma: int | str | GammaPolicy = "auto", chat: bool = False,
                 drafter_options: dict | None = None, num_beams: int = 4,
                 length_penalty: float = 1.0) -> GenerationResult:
        """``method="beam"``: beam search (greedy only; ``num_beams``, ``length_penalty``; see beam.py)."""
        params = params or SamplingParams()
        ids = list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) \
            else self.encode(prompt, chat)
        if method == BEAM:
            with torch.inference_mode():
                r = beam_search(self.target.model, ids, params, num_beams=num_beams, length_penalty=length_penalty,
                                eos_ids=self.tokenizer.eos_ids)
            return GenerationResult(self.tokenizer.decode(r.token_ids), r.token_ids, ["plain"] * len(r.token_ids),
                                    method, r.finish_reason, r.stats)
        policy = self.gamma_policy(method, gamma, params)
        capacity = len(ids) + params.max_tokens + policy.max_gamma + 2
        capacity = min(capacity, self.target.config.max_context + policy.max_gamma + 2)
        drafter = self.make_drafter(method, 1, capacity, **(drafter_options or {}))
        tok = self.tokenizer
        dec = Decoder(self.target.model, drafter, policy, eos_ids=tok.eos_ids, detokenize=tok.decode,
                      rows=1, capacity=capacity)
        seq = Sequence(ids, params)
        with torch.inference_mode():
            dec.run([seq])
        return GenerationResult(output_text(seq, tok.decode), seq.output_ids, seq.kinds, method,
                                seq.finish_reason or "length", seq.stats)
