"""Sampling parameters, logits → probabilities, and the two ways of drawing a token. Pure functions.

The same transform (temperature, then top-k, then top-p) is applied to the target's and the drafter's
logits, so the draft distribution q the drafts are sampled from is exactly the q the verifier divides by.

Draws:
- unseeded requests draw from their own ``torch.Generator`` in step order (``sample``);
- seeded requests draw *position-keyed* (``sample_at``): the token at output position i is
  ``argmax_j p_j / E_j`` with ``E_j = -log u_j ~ Exp(1)``, u from SFC64 seeded by (seed, i) alone — the
  exponential race (the Gumbel-max trick), an exact sample of p. Nothing depends on how positions were grouped into
  verification steps, so a seed means the same text whatever γ, batch and load, and every method equals
  plain decoding with the same seed (see ``verify.verify_keyed``). A drafter using the same noise for its
  own distribution q (``sample_at(q, seed, i)``) proposes the target's token with high probability when
  q ≈ p (Gumbel coupling: P(equal) >= (1 - TV) / (1 + TV); Daliri et al., 2024, "Coupling without
  communication and drafter-invariant speculative decoding").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import InvalidParameterError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None  # any integer in [-2**63, 2**64 - 1], used modulo 2**64
    ignore_eos: bool = False

    def __post_init__(self):
        object.__setattr__(self, "seed", check_seed(self.seed))
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise InvalidParameterError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidParameterError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidParameterError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise InvalidParameterError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits → (..., V) float32 probabilities after temperature, top-k and top-p.

    Greedy params give a one-hot on the argmax (what greedy decoding samples from).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop_sorted[..., 0] = False  # and always the most likely token (a top_p below float32's range is 0 here)
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / row_sum(probs)
    return probs


SUM_BLOCK = 1024  # row_sum's block: each block's sum is one thread's, in the order torch vectorizes it


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1, keepdim=True)`` with the same bits whatever torch's thread count: torch splits the sum of a
    single row (a (V,) or (1, V) tensor) across its threads, so 1 and 2 threads may round it 1 ulp apart, and a
    seeded draw from top-p probabilities could follow; here each block of ``SUM_BLOCK`` values is summed by one
    thread (a reduction with several outputs is split over the outputs), then the block sums, fewer than
    torch's grain, on one. x: (..., V) -> (..., 1)."""
    V = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, -V % SUM_BLOCK)).reshape(*x.shape[:-1], -1, SUM_BLOCK)  # (..., n, B)
    return blocks.sum(-1).sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of (..., V) probabilities with the given generator → (...) int64."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
_ONE = np.uint64(0x3FF0000000000000)  # the exponent bits of float64 1.0


def check_seed(seed) -> int | None:
    """A seed as the generators take it: any integer in [-2**63, 2**64 - 1] (int64 or uint64, as
    clients send them), reduced modulo 2**64; anything else is an InvalidParameterError."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
        raise InvalidParameterError(f"seed must be an integer in [-2**63, 2**64 - 1], got {seed!r}")
    return seed % (1 << 64)


def position_uniforms(seed: int, position: int, size: int) -> np.ndarray:
    """(size,) float64 uniforms in (0, 1), odd multiples of 2**-53, that depend on (seed, position) alone:
    SFC64 seeded with SeedSequence([seed, position]) (NumPy's stable hash of the pair; bit-generator
    streams do not change between NumPy versions). About 0.5 ms for 152k tokens."""
    bits = np.random.SFC64(np.random.SeedSequence([seed, position])).random_raw(size)  # (size,) uint64
    u = ((bits >> np.uint64(12)) | _ONE).view(np.float64)  # [1, 2), exact
    u -= 1.0 - 2.0 ** -53  # exact
    return u


def sample_at(probs: torch.Tensor, seed: int, position: int, uniforms: np.ndarray | None = None) -> int:
    """The position-keyed draw from (V,) probabilities: argmax_j p_j / E_j with E_j = -log(u_j) ~ Exp(1)
    (the exponential race), an exact sample of p to which any other distribution drawn with the same
    (seed, position) is coupled. ``uniforms``: ``position_uniforms(seed, position, >= V)`` if at hand.

    The logarithm is taken only where it can matter: E_j >= 1 - u_j, so p_j / (1 - u_j) bounds the ratio
    from above; tokens whose bound falls below a ratio already reached cannot win."""
    V = probs.shape[-1]
    u = position_uniforms(seed, position, V) if uniforms is None else uniforms[:V]
    p = probs.float().contiguous().numpy()  # (V,)
    bound = p / (1.0 - u)  # (V,) >= p / E (float64)
    a = int(np.argmax(bound))
    reached = float(p[a]) / -math.log(u[a])
    cand = np.flatnonzero(bound >= reached * (1.0 - 1e-9))  # margin for rounding; sorted, includes a
    ratio = p[cand] / -np.log(u[cand])
    return int(cand[int(np.argmax(ratio))])  # ties: the lowest token id


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


TOP_CHUNK = 128  # values per chunk of top_indices' first pass


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dimension, largest first: ``torch.topk(x, k).indices``
    for drafters that rank a whole vocabulary every step (NASD's filler, a draft model's greedy choice). Two
    passes: each chunk of ``TOP_CHUNK`` values' maximum, then the k best chunks' values — every one of the k
    largest values lies in a chunk whose maximum is among the k largest maxima. Over Qwen's 151936 logits on 2
    cores (AMD Zen 5) 27 us a row against torch.topk's 148 (5 rows: 58 against 352). Ties may be ordered
    differently from torch.topk's; the values are the same. x: (..., V) -> (..., k) int64."""
    V = x.shape[-1]
    if k < 1 or V % TOP_CHUNK or V < 8 * k * TOP_CHUNK or not x.is_floating_point():
        return torch.topk(x, min(k, V), dim=-1).indices
    lead = x.shape[:-1]
    chunks = x.reshape(-1, V // TOP_CHUNK, TOP_CHUNK)  # (R, V / C, C)
    best = chunks.amax(-1).topk(k, dim=-1).indices  # (R, k) the chunks with the k largest maxima
    cand = chunks.gather(1, best[..., None].expand(-1, k, TOP_CHUNK)).reshape(-1, k * TOP_CHUNK)  # (R, k C)
    i = cand.topk(k, dim=-1).indices  # (R, k) into cand
    return (best.gather(1, i // TOP_CHUNK) * TOP_CHUNK + i % TOP_CHUNK).reshape(*lead, k)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, -1)`` exactly — the first of equal maxima, NaN counted as the largest as torch does —
    in two passes like ``top_indices`` (the first chunk holding the maximum, then its first maximum): every
    greedy choice (plain decoding, verification, the first token after a prompt) takes it: over Qwen's 151936
    logits 20 us a row against torch.argmax's 83 (AMD Zen 5, 2 threads). x: (..., V) -> (...) int64."""
    V = x.shape[-1]
    if V % TOP_CHUNK or V < 8 * TOP_CHUNK or not x.is_floating_point():
        return x.argmax(-1)
    chunks = x.reshape(-1, V // TOP_CHUNK, TOP_CHUNK)  # (R, V / C, C)
    c = chunks.amax(-1).argmax(-1)  # (R,) the first chunk whose maximum is the row's
    i = chunks[torch.arange(chunks.shape[0]), c].argmax(-1)  # (R,) its first maximum
    return (c * TOP_CHUNK + i).reshape(x.shape[:-1])
