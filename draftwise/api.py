"""The library's front: load a target (and a drafter), generate text with any method.

    from draftwise import SpeculativeDecoder, SamplingParams
    dw = SpeculativeDecoder("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct")
    out = dw.generate("def quicksort(arr):", SamplingParams(max_tokens=128), method="draft")
    print(out.text, out.stats.acceptance_rate, out.stats.mean_accepted_length)
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from collections.abc import Callable

import torch

from .beam import beam_search
from .decode import Decoder, FixedGamma, GammaPolicy
from .detok import PieceStream
from .costs import AUTO_COST_SIZES, PassCosts, model_identity, prime  # noqa: F401  (AUTO_COST_SIZES: api users)
from .gamma import MAX_GAMMA, AdaptiveGamma, parse_gamma
from .drafters import registry
from .drafters.base import Drafter
from .drafters.cross_vocab import DRAFT_RATIO, VocabBridge
from .drafters.draft_model import check_compatible
from .drafters.registry import TREE_SUFFIX, TREE_WIDTH
from .drafters.suffix import SuffixCache
from .errors import IncompatibleModelsError, InvalidParameterError
from .models import LoadedModel, default_draft_weights, load_model
from .models.base import is_encoder_decoder
from .prefix import (BLOCK, DEFAULT_PREFIX_CACHE_DISK_MB, DEFAULT_PREFIX_CACHE_MB, DISK_FORMAT, DiskBlocks,
                     PrefixCache, chunked)
from .sampling import SamplingParams
from .sequence import GenerationStats, Sequence

log = logging.getLogger("draftwise")

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
AUTO = "auto"  # per request and step, the drafter (or none) with the most expected tokens per second
SUFFIX = "suffix"  # SuffixDecoding: trees from this request and earlier ones (``SpeculativeDecoder.suffix_cache``)
LAYERSKIP = "layerskip"  # the target drafts with a measured subset of its own layers (drafters/layerskip.py)
LOOKAHEAD = "lookahead"  # Jacobi window + n-gram pool in the verifying pass (drafters/lookahead.py); sizes its own tree
HEAD_TREE_COST = 1.3  # head methods draft trees by default where a 7-token pass costs at most this many 1-token ones
# The built-in methods as registered (drafters/registry.py, the one table; read it there to see methods
# registered later by other modules): these names are kept for the library's users.
METHODS = registry.names()
SEQ2SEQ_METHODS = registry.names(seq2seq=True)  # an encoder-decoder target (T5, BART, Marian; backend hf)
HEAD_METHODS = tuple(n for n, m in registry.methods().items() if m.heads)  # trained draft heads, token trees
AUTO_CHILDREN = tuple(n for n, m in registry.methods().items() if m.auto_child)  # auto's default choices
tree_options = registry.drafter_options  # drafter options from --tree-width / --heads / --lookahead


def drafter_kind(method: str) -> tuple[str, bool]:
    """"pld-tree" -> ("pld", True); "draft" -> ("draft", False)."""
    return (method[:-len(TREE_SUFFIX)], True) if method.endswith(TREE_SUFFIX) else (method, False)


def uses_draft_model(method: str) -> bool:
    """Whether ``method`` drafts with the draft model (so the draft model is loaded for it)."""
    m = registry.find(method)
    return m is not None and m.draft_model


def tree_width_help() -> str:
    """``--tree-width``'s help, the same in generate, chat, bench and serve."""
    from .drafters.suffix import MAX_NODES

    return (f"branches of the *-tree methods' token trees (default {TREE_WIDTH}) and of medusa's / eagle's "
            f"(default: {TREE_WIDTH} on a CPU where verifying a 7-token tree costs at most {HEAD_TREE_COST}x one "
            f"token, else 1, a chain); suffix: nodes of its tree (default {MAX_NODES})")


BEAM = "beam"  # beam search: a baseline beside the lossless methods (another search, not ar's output)
AUTO_MAX_GAMMA = MAX_GAMMA  # the adaptive policy chooses γ in [0, 8] per step


@dataclass(frozen=True)
class ModelSpec:
    """What a decoder loads, in one shape for every caller (the command line, chat, the server and its Ray
    replicas, the benchmark and its footprint children): the target, the draft model (None: none; it is
    loaded lazily, by the first method that drafts with it), their weight formats, the backend, the layers
    method layerskip skips (None: the calibrated set), the draft heads (None: the target's default) and the
    prefix cache's MiB per model (0: none)."""

    target: str = DEFAULT_TARGET
    draft: str | None = DEFAULT_DRAFT
    dtype: str = "auto"
    draft_dtype: str | None = None  # None: models.default_draft_weights(dtype, backend)
    backend: str = "native"
    skip_layers: str | None = None
    heads: str | None = None
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB
    prefix_cache_dir: str | None = None
    prefix_cache_disk_mb: float = DEFAULT_PREFIX_CACHE_DISK_MB

    @classmethod
    def from_args(cls, args) -> "ModelSpec":
        """From any object with these names as attributes (parsed options, a config); missing ones keep
        their defaults."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def for_method(self, method: str) -> "ModelSpec":
        """The spec that ``method`` needs: without the draft model unless the method drafts with it (method
        auto may: ``SpeculativeDecoder.auto_takes_draft``)."""
        keep = uses_draft_model(method) or method == "auto"
        return self if keep or self.draft is None else replace(self, draft=None)


def build_decoder(spec: ModelSpec, *, method: str | None = None, progress: bool = True) -> "SpeculativeDecoder":
    """The decoder of ``spec`` (``method``: load only what that method needs; None: keep the draft model,
    to be loaded when a method first asks for it)."""
    if method is not None:
        spec = spec.for_method(method)
    return SpeculativeDecoder(spec.target, spec.draft, dtype=spec.dtype, draft_dtype=spec.draft_dtype,
                              backend=spec.backend, progress=progress, skip_layers=spec.skip_layers,
                              prefix_cache_mb=spec.prefix_cache_mb, prefix_cache_dir=spec.prefix_cache_dir,
                              prefix_cache_disk_mb=spec.prefix_cache_disk_mb)


THREADS_HELP = ("torch CPU threads (default: the cores this process may use: its CPU affinity, capped by a "
                "container's CPU quota)")  # --threads of every command (setup_threads)


def setup_threads(threads: int | None) -> None:
    """torch's CPU threads (and so the kernel's): ``threads``, or every core this process may use (None:
    ``cpus.usable_cores``, its CPU affinity capped by a container's CPU quota)."""
    from .cpus import usable_cores

    torch.set_num_threads(threads or usable_cores())


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


# the draft model's head by default: its first DRAFT_VOCAB ids (with the special tokens and the context's) where
# the head is at least DRAFT_HEAD_SHARE of the weights a drafted token reads (draft_head_tokens)
DRAFT_VOCAB = 32768
DRAFT_HEAD_SHARE = 0.20


def head_share(cfg) -> float:
    """The output head's share of the weights one token reads (the head and every decoder layer's projections
    and MLP; not the embedding, of which a token reads one row). Qwen2.5-0.5B: 136M of 494M, 0.28."""
    D, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    head = cfg.vocab_size * D
    return head / (head + L * (D * (q + 2 * kv) + q * D + 3 * D * F))


def draft_head_tokens(d: LoadedModel, option: int | str | None) -> int | None:
    """How many of its first token ids the draft model's head should compute (``transformer.restrict_vocab``;
    a draft of the target's tokenizer computes the running sequences' context tokens too,
    ``VocabSubset.hold``), None for all. ``option``: a count, "full", "auto" or None — then
    ``DRAFTWISE_DRAFT_VOCAB``, else "auto": ``DRAFT_VOCAB`` ids where the head is at least ``DRAFT_HEAD_SHARE``
    of the weights a drafted token reads (Qwen2.5-0.5B: 0.28) and the vocabulary at least twice that, else all.
    Measured with the 0.5B drafting for the 1.5B, the cut head against the whole one in one process, alternated
    per prompt: AMD Zen 4, code prompts ``draft`` 1.08-1.12x, ``auto`` 1.03-1.07x (medians of two rounds),
    Spec-Bench 1.05-1.06x / 1.04x (α 0.77 against 0.79 there); AMD Zen 5 ``draft`` 1.00x on Spec-Bench, 0.98-1.07x on
    code, ``auto`` 1.02x — the cheaper drafted token (Zen 5: 6.6 ms against 8.5) outweighs the rarer tokens it
    can no longer propose, more where a drafted token costs more of a target's. Native models only."""
    from . import settings
    from .models.transformer import Transformer

    if option is None:
        option = settings.draft_vocab() or "auto"
    if not isinstance(d.model, Transformer) or str(option).lower() == "full":
        return None
    vocab = int(d.config.vocab_size)
    if str(option).lower() == "auto":
        return DRAFT_VOCAB if 2 * DRAFT_VOCAB <= vocab and head_share(d.config) >= DRAFT_HEAD_SHARE else None
    try:
        keep = int(option)
    except ValueError:
        raise InvalidParameterError(
            f"draft vocabulary must be a token count, 'full' or 'auto', got {option!r}") from None
    if keep < 1:
        raise InvalidParameterError(f"draft vocabulary must be at least 1 token, got {keep}")
    return keep if keep < vocab else None


def _weights_bytes(ref: str | LoadedModel) -> int | None:
    """Bytes of a loaded model's weights in memory, or of a model's weight files when they are already on
    this machine (a file, a folder's safetensors, a named model fetched and verified); else None — nothing
    is downloaded."""
    from .models.registry import MODELS, fetched

    if isinstance(ref, LoadedModel):
        model = ref.model
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) \
            if isinstance(model, torch.nn.Module) else None
    if not isinstance(ref, str):
        return None
    try:
        p = Path(ref).expanduser()
        if p.is_file():
            return p.stat().st_size
        if p.is_dir():
            return sum(f.stat().st_size for f in p.glob("*.safetensors")) or None
        if ref in MODELS:
            return MODELS[ref].size if fetched(ref) is not None else None
    except OSError:
        return None
    return None


class SpeculativeDecoder:
    """A target model plus whatever the methods need (a draft model is loaded lazily when asked for)."""

    def __init__(self, target: str | LoadedModel = DEFAULT_TARGET, draft: str | LoadedModel | None = DEFAULT_DRAFT,
                 *, dtype: str = "auto", draft_dtype: str | None = None, backend: str = "native",
                 progress: bool = True, skip_layers: str | list[int] | None = None,
                 draft_vocab: int | str | None = None, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                 prefix_cache_dir: str | Path | None = None,
                 prefix_cache_disk_mb: float = DEFAULT_PREFIX_CACHE_DISK_MB):
        """``skip_layers`` ("3,5,7-12" or indices): the layers method layerskip skips, instead of the
        calibrated set (``layerskip_plan``). ``draft_vocab``: the tokens the draft model's head computes
        (``draft_head_tokens``): a count, "full", "auto", or None (``DRAFTWISE_DRAFT_VOCAB``, else "auto").
        ``prefix_cache_mb``: MiB of prompt keys and values each model keeps for later prompts that start the
        same way (``prefix.py``; 0: none); it never changes the output. ``prefix_cache_dir``: a folder where
        each model's prefix cache also keeps its blocks, ``prefix_cache_disk_mb`` MiB at most per model, for
        later processes (``prefix.DiskBlocks``; None: memory only)."""
        from .cpus import cap_torch_threads

        for name, mib, zero in (("prefix_cache_mb", prefix_cache_mb, True),
                                ("prefix_cache_disk_mb", prefix_cache_disk_mb, False)):
            if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not (mib >= 0 if zero else mib > 0):
                raise InvalidParameterError(f"{name} must be a number {'>=' if zero else '>'} 0, got {mib!r}")
        if prefix_cache_dir is not None and Path(prefix_cache_dir).expanduser().exists() \
                and not Path(prefix_cache_dir).expanduser().is_dir():
            raise InvalidParameterError(f"prefix cache folder {str(prefix_cache_dir)!r} is a file, not a folder")
        self.prefix_cache_mb = prefix_cache_mb
        self.prefix_cache_dir = Path(prefix_cache_dir).expanduser() if prefix_cache_dir is not None else None
        self.prefix_cache_disk_mb = prefix_cache_disk_mb
        self._prefix_caches: dict[int, tuple[object, PrefixCache]] = {}  # id(model) -> (model, its cache)

        cap_torch_threads()  # torch's default thread count ignores a container's CPU quota
        self.dtype, self.backend, self.progress = dtype, backend, progress
        self.draft_vocab = draft_vocab
        self.skip_layers = skip_layers
        self._skip_plans: dict = {}  # method layerskip: skip set (None: calibrated) -> SkipPlan
        self.draft_dtype = draft_dtype or default_draft_weights(dtype, backend)
        self.target = target if isinstance(target, LoadedModel) else load_model(target, dtype, backend, progress)
        self._draft_ref = draft
        self._heads: dict[str, object] = {}
        self._target_id: tuple[Path | str, str] | None = None  # _target_file()
        self._auto: dict[str, AdaptiveGamma] = {}  # per method: step costs are learned across requests
        # this machine's measured pass costs (costs.py), kept on disk per weight file and machine
        self.costs = PassCosts(self.target.model, lambda: model_identity(self.target) if backend == "native" else None)
        self._auto_arms: dict = {}  # method auto: each drafter's acceptance pooled over requests (a prior)
        self.auto_start_costs: dict[str, float] = {}  # method auto: a draft model's start, s per context token
        self.suffix_cache = SuffixCache()  # method suffix: earlier requests' tokens, shared by its drafters
        self._draft: LoadedModel | None = draft if isinstance(draft, LoadedModel) else None
        self._bridge: VocabBridge | None = None  # a draft with another tokenizer (drafters/cross_vocab.py)
        if self._draft is not None:
            self._check_draft(self._draft)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def prefix_cache(self, model=None) -> PrefixCache | None:
        """The prefix cache of ``model`` (default: the target's), shared by every method and request of this
        decoder; None where ``prefix_cache_mb`` is 0 or the model does not prefill in chunks (``prefix.chunked``)."""
        model = self.target.model if model is None else model
        if self.prefix_cache_mb <= 0 or not chunked(model):
            return None
        held = self._prefix_caches.get(id(model))
        if held is None:
            held = self._prefix_caches[id(model)] = (model, PrefixCache(int(self.prefix_cache_mb * 2**20),
                                                                        disk=self._disk_blocks(model)))
        return held[1]

    def _disk_blocks(self, model) -> DiskBlocks | None:
        """``model``'s block folder under ``prefix_cache_dir``: named by what decides its keys' and values' bits (the
        weight file and format, the kernel build, the cache's dtype and shape), so a changed model or kernel never
        reads another's blocks. None without a folder, or for a model that is not a local file (built in memory)."""
        if self.prefix_cache_dir is None:
            return None
        from .kernels import build_name

        loaded = next((m for m in (self.target, self._draft) if m is not None and m.model is model), None)
        ident = model_identity(loaded, min_bytes=0) if loaded is not None else None
        if ident is None:
            log.info("draftwise: %s is not a local weight file: its prefix cache stays in memory",
                     getattr(loaded, "name", "a model"))
            return None
        cfg = model.config
        key = "|".join(map(str, (DISK_FORMAT, ident, build_name(), model.dtype, BLOCK, cfg.num_layers,
                                 cfg.num_kv_heads, cfg.head_dim)))
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(loaded.name)).name)[:60]
        folder = self.prefix_cache_dir / f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        try:
            return DiskBlocks.shared(folder, int(self.prefix_cache_disk_mb * 2**20))
        except OSError as e:
            raise InvalidParameterError(f"prefix cache folder {str(folder)!r} cannot be made: {e}") from None

    @property
    def draft(self) -> LoadedModel:
        if self._draft is None:
            if self._draft_ref is None:
                raise InvalidParameterError("method 'draft' needs a draft model (--draft NAME_OR_PATH)")
            d = load_model(self._draft_ref, self.draft_dtype, self.backend, self.progress)
            self._check_draft(d)
            keep = draft_head_tokens(d, self.draft_vocab)
            if keep is not None:  # a model loaded here, not one the caller passed in (it may be shared)
                from .models.transformer import restrict_vocab

                restrict_vocab(d.model, keep, set(d.tokenizer.eos_ids) | set(
                    d.tokenizer.fast.get_added_tokens_decoder()))
            self._draft = d
        return self._draft

    def heads(self, spec: str | None, kind: str = "medusa"):
        """The ``kind`` draft heads among ``spec`` (a folder, or folders separated by commas; None: the ones
        ``draftwise train-head`` wrote for this target by default), loaded once and checked against this
        target's weight file."""
        from .heads import load_heads, resolve_heads

        if self.backend != "native":
            raise InvalidParameterError("draft heads need the native backend")
        src, sha = self._target_file()
        folder = str(resolve_heads(spec, kind, src, sha, self.target.name))
        if folder not in self._heads:
            self._heads[folder] = load_heads(folder, sha).for_inference()
        return self._heads[folder]

    def layerskip_plan(self, skip_layers: str | list[int] | None = None):
        """Method layerskip's ``SkipPlan`` (``drafters.layerskip.plan_for``): the layers given
        (``skip_layers``, else the decoder's own) with their draft pass timed, else the set calibrated once
        for this target weight file and format and kept in ``$DRAFTWISE_HOME/layerskip/``; one per set."""
        from .drafters import layerskip as ls

        if self.backend != "native":
            raise InvalidParameterError("method 'layerskip' runs a subset of the target's own layers: it needs the "
                                        "native backend (--backend native)")
        spec = skip_layers if skip_layers is not None else self.skip_layers
        key = None if spec is None else ls.parse_skip_layers(spec, self.target.config.num_layers)
        if key not in self._skip_plans:
            self._skip_plans[key] = ls.plan_for(self.target, key, lambda: self._target_file()[1], self.costs,
                                                self.progress)
        return self._skip_plans[key]

    def _target_file(self) -> tuple[Path | str, str]:
        """(the target's weight file or folder, its identity: sha256, or "name:..." for a model built in
        memory), computed once: hashing a weight file that has no sha256 sidecar reads it whole."""
        if self._target_id is None:
            from .heads import target_identity
            from .models.registry import resolve

            try:
                src = resolve(self.target.name, progress=False)
                self._target_id = (src, target_identity(src))
            except Exception:  # a model built in memory: known by its name only
                self._target_id = (self.target.name, f"name:{self.target.name}")
        return self._target_id

    def _check_draft(self, d: LoadedModel) -> None:
        """The target's tokenizer, or one bridged to it (cross-tokenizer drafting; else a clear error).
        An encoder-decoder target takes an encoder-decoder draft with its own tokenizer (no bridge)."""
        if is_encoder_decoder(self.target.model) or is_encoder_decoder(d.model):
            if is_encoder_decoder(self.target.model) != is_encoder_decoder(d.model):
                raise IncompatibleModelsError("draft and target must both be encoder-decoder models or both "
                                              "decoder-only")
            check_compatible(self.target.tokenizer, d.tokenizer, self.target.config, d.config)
            return
        try:
            check_compatible(self.target.tokenizer, d.tokenizer, self.target.config, d.config)
        except IncompatibleModelsError:
            self._bridge = VocabBridge(self.target.tokenizer, d.tokenizer, self.target.config.vocab_size,
                                       d.config.vocab_size)

    @property
    def bridge(self) -> VocabBridge | None:
        """The map to the draft model's vocabulary when its tokenizer is not the target's (None: same)."""
        self.draft
        return self._bridge

    @property
    def is_encoder_decoder(self) -> bool:
        """An encoder-decoder target (T5, BART, Marian; ``--backend hf``): the prompt is its source."""
        return is_encoder_decoder(self.target.model)

    def encode(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        if self.is_encoder_decoder and (chat or isinstance(prompt, list)):
            raise InvalidParameterError("an encoder-decoder model takes the prompt text as its source, without "
                                        "a chat template; drop --chat / give a string")
        if isinstance(prompt, list):
            return self.tokenizer.apply_chat(prompt)
        if not prompt:
            raise InvalidParameterError("empty prompt")
        if chat:
            return self.tokenizer.apply_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def make_drafter(self, method: str, rows: int, capacity: int, **opts) -> Drafter | None:
        """The drafter of a registered method (None for "ar") for ``rows`` rows of ``capacity`` tokens;
        ``opts`` are its drafter options (``tree_options``). A tree variant's branches default to TREE_WIDTH."""
        m = registry.get(method)
        if m.tree:
            opts = {"branches": TREE_WIDTH, **opts}
        return m.build(self, rows, capacity, **opts)

    @property
    def auto_arms(self) -> dict:
        """Method auto: each drafter's acceptance pooled over this decoder's requests (a new one's prior)."""
        return self._auto_arms

    def head_width(self) -> int:
        """A head method's tree width when none is given: EAGLE-2's trees of TREE_WIDTH branches where this
        machine verifies a two-level tree (1 + 2 * TREE_WIDTH tokens) for at most HEAD_TREE_COST times a
        one-token pass (AMX: a matmul costs the same for 1 and 32 rows), else a chain (AVX2 and the like,
        where every token fed costs: there a tree's unchosen siblings cost more than they bring)."""
        if self.backend != "native":
            return 1
        flat = self.pass_cost(1 + 2 * TREE_WIDTH) <= HEAD_TREE_COST * self.pass_cost(1)
        return TREE_WIDTH if flat else 1

    def auto_takes_draft(self) -> bool:
        """Whether method ``auto`` drafts with the draft model too when not told which drafters to use: a
        native target, a draft model with the target's tokenizer that is already on this machine (auto never
        downloads one) and smaller than the target (whether it pays is the cost model's call, per step).
        Loads the draft model when it qualifies (its cost per token prices it)."""
        if self.backend != "native" or self._draft_ref is None or self.is_encoder_decoder:
            return False
        if isinstance(self._draft_ref, LoadedModel):  # a model given: the two in memory
            mine, theirs = _weights_bytes(self._draft_ref), _weights_bytes(self.target)
        else:  # a name or path: the two weight files
            mine, theirs = _weights_bytes(self._draft_ref), _weights_bytes(self.target.name)
        if mine is None or theirs is None or mine >= theirs:
            return False
        return self.bridge is None

    def draft_start_cost(self) -> float:
        """Seconds per context token of starting the draft model on a request (its prefill), before one was
        timed: its one-token pass scaled by how much cheaper a token is in the target's 9-token pass than
        alone (a prompt's tokens are cheaper still: an upper estimate). Method auto times real starts."""
        return self.per_draft_cost("draft") * self.pass_cost(9) / (9 * self.pass_cost(1))

    def per_draft_cost(self, method: str) -> float:
        """Seconds per token the draft model drafts for ``method`` (measured once per process)."""
        if self.backend != "native":
            return 0.0
        # a draft with another tokenizer feeds about 1.5 of its tokens per target token (cross_vocab)
        return self._draft_pass() * (DRAFT_RATIO if self.bridge is not None else 1.0)

    def _draft_pass(self) -> float:
        """Seconds of the draft model's one-token pass as the γ policy prices it (``PassCosts.draft_pass``:
        its ratio to the target's, timed alternately in this process)."""
        return self.costs.draft_pass(self.draft.model)

    @property
    def _target_costs(self) -> dict[int, float]:  # the measured points (tests set them)
        return self.costs.seconds

    def pass_cost(self, tokens: int) -> float:
        """Seconds of a batch-1 target pass over ``tokens`` new tokens on this machine (``costs.PassCosts``)."""
        return self.costs(tokens)

    def gamma_policy(self, method: str, gamma: int | str | GammaPolicy, params: SamplingParams | None = None
                     ) -> GammaPolicy:
        """An int is a fixed γ; "auto" the adaptive policy of this method (its measured step costs are
        kept across requests, acceptance is tracked per request). Seeded requests may take it too: their
        draws are position-keyed, so the text does not depend on the γ chosen (sampling.py)."""
        if isinstance(gamma, (bool, int, str)):
            gamma = parse_gamma(gamma)
        own = registry.get(method).own_gamma  # auto, lookahead: the drafter sizes its drafts, up to this
        if own is not None and gamma == "auto":
            return FixedGamma(own)
        if isinstance(gamma, int):
            return FixedGamma(gamma)
        if gamma == "auto":
            if method not in self._auto:
                self._auto[method] = self.prime(AdaptiveGamma(AUTO_MAX_GAMMA), method)
            return self._auto[method]
        if method == AUTO and isinstance(gamma, AdaptiveGamma):  # its own per-row choice is the policy
            raise InvalidParameterError("method 'auto' chooses its draft lengths itself: give gamma as an "
                                        "integer (the deepest draft) or 'auto'")
        return gamma

    def prime(self, policy: AdaptiveGamma, method: str) -> AdaptiveGamma:
        """Seed an adaptive policy's cost fit with this machine's measured step costs for ``method``
        (``costs.prime``): its tree width, and the seconds of a drafted token for the draft model (k + 1
        drafted tokens for k with another tokenizer) or layerskip."""
        if method == "ar" or self.backend != "native" or self.is_encoder_decoder:
            return policy
        m = registry.get(method)
        width = TREE_WIDTH if m.tree else self.head_width() if m.heads else 1
        per_draft = 0.0
        if m.name == LAYERSKIP:
            per_draft = self.layerskip_plan().draft_ratio * self.pass_cost(1)
        if m.draft_model:
            per_draft = self._draft_pass()
        return prime(policy, self.costs, width=width, per_draft=per_draft,
                     text_drafts=m.draft_model and self.bridge is not None)

    def generate(self, prompt: str | list[dict] | list[int], params: SamplingParams | None = None, *,
                 method: str = "draft", gamma: int | str | GammaPolicy = "auto", chat: bool = False,
                 drafter_options: dict | None = None, num_beams: int = 4, length_penalty: float = 1.0,
                 on_text: Callable[[list[tuple[str, str]]], None] | None = None) -> GenerationResult:
        """``method="beam"``: beam search (greedy only; ``num_beams``, ``length_penalty``; see beam.py).
        ``on_text``: called after each step with the new text as ``[(piece, kind), ...]``, a piece per new
        token (``detok.PieceStream``); the pieces join to the result's ``text``. Beam search calls it once,
        at the end."""
        params = params or SamplingParams()
        ids = list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) \
            else self.encode(prompt, chat)
        if method == BEAM:
            if self.is_encoder_decoder:
                raise InvalidParameterError("method 'beam' is for decoder-only models (use transformers' "
                                            "generate for an encoder-decoder beam search)")
            with torch.inference_mode():
                r = beam_search(self.target.model, ids, params, num_beams=num_beams, length_penalty=length_penalty,
                                eos_ids=self.tokenizer.eos_ids)
            result = GenerationResult(self.tokenizer.decode(r.token_ids), r.token_ids,
                                      ["plain"] * len(r.token_ids), method, r.finish_reason, r.stats)
            if on_text is not None and result.text:
                on_text([(result.text, "plain")])
            return result
        source, eos = None, self.tokenizer.eos_ids
        if self.is_encoder_decoder:  # the text is the encoder's source; the decoder starts from its own prompt
            if not registry.get(method).seq2seq:
                raise InvalidParameterError(f"method {method!r} is not available for encoder-decoder models; "
                                            f"choose one of {', '.join(SEQ2SEQ_METHODS)}")
            source, ids, eos = ids, list(self.target.model.decoder_prompt), eos | self.target.model.eos_ids
        policy = self.gamma_policy(method, gamma, params)
        capacity = len(ids) + params.max_tokens + policy.max_gamma + 2
        capacity = min(capacity, self.target.config.max_context + policy.max_gamma + 2)
        drafter = self.make_drafter(method, 1, capacity, **(drafter_options or {}))
        tok = self.tokenizer
        dec = Decoder(self.target.model, drafter, policy, eos_ids=eos, detokenize=tok.decode,
                      rows=1, capacity=capacity, prefix_cache=self.prefix_cache())
        seq = Sequence(ids, params, encoder_ids=source)
        stream = None if on_text is None else PieceStream(tok.decode, params.stop, on_text)

        def step(seqs: list[Sequence]) -> None:
            if seq.finish_reason is None:  # the last step's tokens go through finish: cut at a stop string
                stream.step(seq.output_ids, seq.kinds)
        with torch.inference_mode():
            dec.run([seq], on_step=None if stream is None else step)
        text = output_text(seq, tok.decode)
        if stream is not None:
            stream.finish(seq.output_ids, seq.kinds, text)
        return GenerationResult(text, seq.output_ids, seq.kinds, method, seq.finish_reason or "length", seq.stats)
