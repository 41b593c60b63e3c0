"""The machine's roofline for batch-1 decoding: tokens/s <= memory bandwidth / bytes streamed per token.

Bytes per token are counted from the model itself — every parameter *and buffer* of every module except
the input embedding table (a lookup reads one row of it), each once — so a quantized linear layer that
keeps int8/int4 weights and scales in buffers reports its own storage, with no change here.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

EMBEDDING_NAMES = ("embed", "embed_tokens", "wte", "tok_embeddings", "word_embeddings")


def _is_embedding(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) or name.rsplit(".", 1)[-1] in EMBEDDING_NAMES


def weight_bytes_per_token(model) -> dict:
    """Bytes (and elements) of weights read to decode one token: all modules but the input embedding.

    ``model``: an ``nn.Module``, or a draftwise backend wrapping one (``.hf`` of the hf backend). A weight
    tied between the embedding and the output head is counted once, as the head (it is read per token).
    """
    module = model if isinstance(model, nn.Module) else getattr(model, "hf", model)
    seen: set[int] = set()
    nbytes = numel = 0
    by_dtype: dict[str, int] = {}
    for name, m in module.named_modules():
        if _is_embedding(name, m):
            continue
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            if t is None or id(t) in seen or t.device.type == "meta":
                continue
            seen.add(id(t))
            b = t.numel() * t.element_size()
            nbytes += b
            numel += t.numel()
            key = str(t.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + b
    return {"bytes": nbytes, "elements": numel, "bytes_by_dtype": by_dtype}


def measure_bandwidth(gib: float = 0.5, repeats: int = 5, dtype: torch.dtype = torch.float32) -> dict:
    """Sustained read bandwidth (GB/s): matrix-vector products streaming ``gib`` GiB of weights.

    The weights are split into 64 MiB matrices (like a model's layers) so no cache holds them; the
    median of ``repeats`` passes is reported (the first pass, touching fresh pages, is not timed).
    """
    cols = 4096
    chunk = 64 << 20
    per = torch.empty((), dtype=dtype).element_size()
    rows = chunk // (cols * per)
    mats = [torch.randn(rows, cols).to(dtype) for _ in range(max(1, int(gib * (1 << 30)) // chunk))]
    x = torch.randn(cols).to(dtype)
    total = sum(m.numel() * m.element_size() for m in mats)
    times = []
    with torch.inference_mode():
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            for m in mats:
                torch.mv(m, x)
            if r:
                times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"method": f"torch.mv over {total / (1 << 30):.2f} GiB of {str(dtype).removeprefix('torch.')} weights",
            "bytes": total, "seconds": med, "gb_per_s": total / med / 1e9}


def roofline(model, bandwidth_gb_s: float, ar_tokens_per_s: float | None = None) -> dict:
    """Upper bound on batch-1 tokens/s for ``model`` at ``bandwidth_gb_s``; where ``ar`` stands (percent)."""
    w = weight_bytes_per_token(model)
    bound = bandwidth_gb_s * 1e9 / w["bytes"] if w["bytes"] else None
    pct = 100.0 * ar_tokens_per_s / bound if bound and ar_tokens_per_s is not None else None
    return {"bandwidth_gb_s": bandwidth_gb_s, "weight_bytes_per_token": w["bytes"],
            "weight_elements_per_token": w["elements"], "bytes_by_dtype": w["bytes_by_dtype"],
            "max_tokens_per_s": bound, "ar_tokens_per_s": ar_tokens_per_s, "ar_percent_of_bound": pct}
