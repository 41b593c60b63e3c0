"""Model backends and loading. ``load_model`` is the entry point."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidParameterError, ModelNotFoundError
from .base import CausalLM, KVCache, ModelConfig, ModelOutput
from .registry import MODELS, resolve
from .tokenizer import Tokenizer

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
          "float32": torch.float32}


@dataclass
class LoadedModel:
    name: str
    model: CausalLM
    tokenizer: Tokenizer
    load_s: float

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidParameterError(f"unknown dtype {dtype!r}; choose one of {sorted(set(DTYPES))}")
    return DTYPES[dtype]


def load_model(name_or_path: str, dtype: str | torch.dtype = "bf16", backend: str = "native",
               progress: bool = True) -> LoadedModel:
    """Load a model by name (see ``MODELS``), GGUF path, HF folder or HF hub id."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    dt = parse_dtype(dtype)
    src = resolve(name_or_path, progress)
    if backend == "hf":
        from .hf import load_hf

        model, tok = load_hf(src, dt)
        return LoadedModel(name_or_path, model, Tokenizer.from_hf(tok), time.perf_counter() - t0)
    if backend != "native":
        raise InvalidParameterError(f"unknown backend {backend!r}; choose native or hf")
    from .loading import hf_folder_config, hf_folder_state_dict, load_gguf
    from .transformer import from_state_dict

    if isinstance(src, str):  # hub id: download the folder (needs the hub)
        src = _snapshot(src)
    if src.is_file():
        cfg, sd, tok_dir = load_gguf(src, dt, progress)
    else:
        cfg, sd, tok_dir = hf_folder_config(src), hf_folder_state_dict(src), src
    model = from_state_dict(cfg, sd, dt)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    return LoadedModel(name_or_path, model, Tokenizer.from_hf(tok), time.perf_counter() - t0)


def _snapshot(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                               "*.txt", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, ...
        raise ModelNotFoundError(f"could not fetch {repo_id!r} from the model hub: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from None


__all__ = ["CausalLM", "KVCache", "LoadedModel", "MODELS", "ModelConfig", "ModelOutput", "Tokenizer",
           "load_model", "parse_dtype"]
