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
    """Sustained read bandwidth (GB/s): the fastest of two streams over ``gib`` GiB, so that the bound is the
    memory's and not one routine's: torch's sum of 64 MiB ``dtype`` matrices (like a model's layers, so no cache
    holds them; every thread reading), and, where the kernel is built, its one-row matmul over the same bytes of
    Q4_K codes (the memory-bound call a decoding step makes; Q4_K streamed fastest of the formats, 36 GB/s against
    Q8_0's 29 on an AMD Zen 5). ``torch.mv``, the measure until
    2026-11-29, read at 11-25 GB/s where the kernel streamed 36-60 on an AMD Zen 5, so ``ar`` showed at up to 231 %
    of its "bound". The median of ``repeats`` passes of each (the first pass, touching fresh pages, not timed);
    ``readings`` has every stream's GB/s.
    """
    cols = 4096
    chunk = 64 << 20
    per = torch.empty((), dtype=dtype).element_size()
    rows = chunk // (cols * per)
    mats = [torch.randn(rows, cols).to(dtype) for _ in range(max(1, int(gib * (1 << 30)) // chunk))]
    total = sum(m.numel() * m.element_size() for m in mats)

    def timed(run) -> float:
        times = []
        with torch.inference_mode():
            for r in range(repeats + 1):
                t0 = time.perf_counter()
                run()
                if r:
                    times.append(time.perf_counter() - t0)
        return statistics.median(times)

    readings = {f"torch.sum over {total / (1 << 30):.2f} GiB of {str(dtype).removeprefix('torch.')}":
                total / timed(lambda: [m.sum() for m in mats]) / 1e9}
    del mats
    stream = _kernel_stream(total)
    if stream is not None:
        readings[f"the kernel's one-row Q4_K matmul over {total / (1 << 30):.2f} GiB"] = total / timed(stream) / 1e9
    method = max(readings, key=readings.get)
    return {"method": method, "bytes": total, "seconds": total / readings[method] / 1e9,
            "gb_per_s": readings[method], "readings": readings}


def _kernel_stream(total: int):
    """A call that reads ``total`` bytes of Q4_K codes (64 MiB matrices, K = 4096) through the kernel's one-row
    matmul, or None where the kernel is not built."""
    from ..kernels import extension, zero_matrix
    from ..kernels.gguf_quant import KQ_TYPES

    ext = extension()
    if ext is None:
        return None
    fmt, K = KQ_TYPES["Q4_K"], 4096
    w, N, size = zero_matrix(ext, fmt, K, 64 << 20)
    ws = [w] + [zero_matrix(ext, fmt, K, 64 << 20)[0] for _ in range(max(1, total // size) - 1)]
    x = torch.randn(1, K)  # (1, K)
    return lambda: [ext.qmm_kq(x, w, fmt, N) for w in ws]


def roofline(model, bandwidth_gb_s: float, ar_tokens_per_s: float | None = None) -> dict:
    """Upper bound on batch-1 tokens/s for ``model`` at ``bandwidth_gb_s``; where ``ar`` stands (percent)."""
    w = weight_bytes_per_token(model)
    bound = bandwidth_gb_s * 1e9 / w["bytes"] if w["bytes"] else None
    pct = 100.0 * ar_tokens_per_s / bound if bound and ar_tokens_per_s is not None else None
    return {"bandwidth_gb_s": bandwidth_gb_s, "weight_bytes_per_token": w["bytes"],
            "weight_elements_per_token": w["elements"], "bytes_by_dtype": w["bytes_by_dtype"],
            "max_tokens_per_s": bound, "ar_tokens_per_s": ar_tokens_per_s, "ar_percent_of_bound": pct}
