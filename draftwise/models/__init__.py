"""Model backends and loading. ``load_model`` is the entry point."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidParameterError, ModelNotFoundError
from .base import CausalLM, KVCache, ModelConfig, ModelOutput
from .registry import MODELS, resolve
from .tokenizer import Tokenizer

DENSE = {"bf16": torch.bfloat16, "fp32": torch.float32}
QUANTIZED = ("gguf", "int8", "int4")
WEIGHT_FORMATS = ("auto", *QUANTIZED, *DENSE)


@dataclass
class LoadedModel:
    name: str
    model: CausalLM
    tokenizer: Tokenizer
    load_s: float
    weights: str = "bf16"  # the weight format it runs with

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def resolve_weights(weights: str | torch.dtype, src: Path | str, backend: str) -> str:
    """Pick the weight format. ``auto``: a GGUF file keeps its own quantization (exact, ~4-6 bits per
    weight, fastest here) when the kernel builds; anything else runs in bf16."""
    if isinstance(weights, torch.dtype):
        weights = {v: k for k, v in DENSE.items()}.get(weights, str(weights))
    weights = {"bfloat16": "bf16", "float32": "fp32"}.get(weights, weights)
    if weights not in WEIGHT_FORMATS:
        raise InvalidParameterError(f"unknown weight format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if backend == "hf" and weights in QUANTIZED:
        raise InvalidParameterError(f"--dtype {weights} needs the native backend; the hf backend runs bf16 or fp32")
    if weights == "auto":
        if backend == "native" and isinstance(src, Path) and src.is_file():
            from ..kernels import extension

            return "gguf" if extension() is not None else "bf16"
        return "bf16"
    if weights == "gguf" and not (isinstance(src, Path) and src.is_file()):
        raise InvalidParameterError("--dtype gguf keeps a GGUF file's own quantization; this model is not a GGUF "
                                    "file (use int8 / int4 / bf16 / fp32)")
    return weights


def peer_dtype(weights: str) -> torch.dtype:
    """The dtype to run transformers in beside a draftwise model of this weight format: the same dense
    dtype, or, when draftwise runs quantized, transformers' fastest CPU path for a GGUF file: bf16 where
    the CPU has bf16 matrix hardware (AMX / AVX512-BF16), else fp32 (on AVX2, torch's bf16 matmul is
    compute-bound: a 700-token prefill takes minutes)."""
    from ..kernels import cpu_has_bf16_matmul

    return DENSE.get(weights, torch.bfloat16 if cpu_has_bf16_matmul() else torch.float32)


def default_draft_weights(dtype: str, backend: str = "native") -> str:
    """The draft model's weight format when none is given: ``int4`` where the target runs quantized on the
    native backend (the draft is read once per drafted token, so its bytes are its cost, and its precision
    only moves the acceptance rate, never the output: the 0.5B as int4 — Q4_1 blocks on the K-quant rule,
    5 bits a weight — drafts a token in 8.6 ms against 12 ms as its own Q5_0 / Q8_0 blocks on AMD Zen 5),
    else the target's ``dtype`` (also without the C++ kernel, where int4 would be de-quantized to fp32)."""
    from .. import settings

    quantized = dtype in ("auto", "gguf", "int8", "int4")
    return "int4" if backend == "native" and quantized and not settings.kernels_disabled() else dtype


def load_model(name_or_path: str, dtype: str | torch.dtype = "auto", backend: str = "native",
               progress: bool = True, keep_converted: bool | None = None) -> LoadedModel:
    """Load a model by name (see ``MODELS``), GGUF path, HF folder or HF hub id.

    ``dtype`` is the weight format: auto | gguf | int8 | int4 | bf16 | fp32 (see ``resolve_weights``).
    Every format computes in fp32 through draftwise's batch-invariant kernel (weights stay in their
    format: int4 / int8 codes, bf16, fp32); without a C++ compiler, dense formats fall back to torch.
    """
    from ..memory import gc_paused

    with gc_paused():
        return _load_model(name_or_path, dtype, backend, progress, keep_converted)


def _load_model(name_or_path: str, dtype: str | torch.dtype, backend: str, progress: bool,
                keep_converted: bool | None) -> LoadedModel:
    t0 = time.perf_counter()
    if backend not in ("native", "hf"):
        raise InvalidParameterError(f"unknown backend {backend!r}; choose native or hf")
    src = resolve(name_or_path, progress)
    if backend == "native" and isinstance(src, Path) and src.is_dir():
        from .loading import hf_folder_config

        hf_folder_config(src)  # an architecture the native backend lacks (encoder-decoder, ...): say so first
    weights = resolve_weights(dtype, src, backend)
    compute = DENSE.get(weights, torch.float32)
    storage = None  # dense weights run by the batch-invariant kernel, in this dtype
    if backend == "native" and weights in DENSE:
        from ..kernels import extension

        if extension() is not None:
            compute, storage = torch.float32, DENSE[weights]
    if backend == "hf":
        from .hf import load_hf

        model, tok = load_hf(src, compute)
        return LoadedModel(name_or_path, model, Tokenizer.from_hf(tok), time.perf_counter() - t0, weights)
    from .loading import converted_dir, hf_folder_config, hf_folder_state_dict, load_gguf, quantize_linears
    from .transformer import from_state_dict

    if isinstance(src, str):  # hub id: download the folder (needs the hub)
        src = _snapshot(src)
    tok_soon = _read_tokenizer_meanwhile(converted_dir(src) if src.is_file() else src)
    if src.is_file():  # a GGUF: int8 / int4 are quantized once, at conversion, and mapped from then on
        fmt = weights if weights in ("gguf", "int8", "int4") else storage or compute
        cfg, sd, tok_dir = load_gguf(src, fmt, progress, keep_converted)
    else:
        cfg, sd, tok_dir = hf_folder_config(src), hf_folder_state_dict(src), src
        if weights in ("int8", "int4"):
            sd = quantize_linears(sd, 8 if weights == "int8" else 4)
    model = from_state_dict(cfg, sd, compute, storage)
    if tok_soon is not None:
        tok_soon.exception()  # wait for it: the Rust tokenizer is then cached (a failure: from_folder says why)
    return LoadedModel(name_or_path, model, Tokenizer.from_folder(tok_dir), time.perf_counter() - t0, weights)


def _read_tokenizer_meanwhile(folder: Path):
    """Parsing ``folder``'s tokenizer.json (~0.3 s for Qwen's, in Rust, without the GIL) started on a thread
    (a Future), so that it overlaps reading the weights on a core the kernel's threads leave free; the
    parsed tokenizer is cached by content (``tokenizer._rust_tokenizer``), so ``Tokenizer.from_folder``
    afterwards finds it. Only the Rust parse runs there (never transformers: two threads importing it at
    once can see a half-made module). None when no core is free (measured on 2 cores: 0.82-0.87 s with the
    thread against 0.80-0.81 s without) or the folder has no tokenizer.json yet (a first conversion writes it)."""
    from concurrent.futures import ThreadPoolExecutor

    from .tokenizer import _rust_tokenizer

    if not (folder / "tokenizer.json").is_file():
        return None
    from ..cpus import usable_cores

    if usable_cores() <= torch.get_num_threads():
        return None  # no spare core: the weights' re-packing uses every thread, a third would only slow it
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftwise-tokenizer")
    fut = pool.submit(_rust_tokenizer, folder / "tokenizer.json")
    pool.shutdown(wait=False)
    return fut


def _snapshot(repo_id: str) -> Path:
    from .registry import hub_reachable

    if not hub_reachable():
        raise ModelNotFoundError(f"{repo_id!r} looks like a model hub id, but the hub is not reachable from "
                                 "this machine; give a GGUF file, an HF folder or a named model")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                               "*.txt", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, ...
        raise ModelNotFoundError(f"could not fetch {repo_id!r} from the model hub: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from None


__all__ = ["CausalLM", "KVCache", "LoadedModel", "MODELS", "ModelConfig", "ModelOutput", "Tokenizer",
           "WEIGHT_FORMATS", "default_draft_weights", "load_model", "peer_dtype", "resolve_weights"]
