"""Shared fixtures: tiny random models (fast tests) and the real SmolLM2-135M (slow tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import draftwise  # noqa: F401  (before torch: GNU OpenMP's short spin, settings.openmp_spin_default)

# isort: split
import pytest
import torch
from hypothesis import settings

from draftwise.models.base import ModelConfig
from draftwise.models.transformer import Transformer, random_model

torch.set_num_threads(2)

# property tests draw the same examples on every run (CI must not fail by the luck of the draw);
# HYPOTHESIS_PROFILE=explore draws fresh ones
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TINY = ModelConfig(arch="llama", vocab_size=96, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=12, rope_theta=10000.0, rms_eps=1e-6, max_context=512)
TINY_QWEN = ModelConfig(**{**TINY.to_dict(), "arch": "qwen2", "qkv_bias": True})


def reference_state_dict(reader, kernel_layout: bool = False) -> dict[str, torch.Tensor]:
    """The unfused state dict of a GGUF with every block format decoded by the numpy reference
    (gguf_quant.parse) instead of the kernel's C++ re-packer: what the in-place loader must equal.
    ``kernel_layout``: tensors the K-quant rule takes (``kq_format``: Q4_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q8_0
    of whole 16-row tiles) are re-laid out one by one into its x16 layout instead (that layout is checked
    against the numpy reference in test_kquant / test_kblock), so that a model built from this state dict
    computes with the same rule as the in-place loader's fused one, bit for bit."""
    from draftwise.kernels import gguf_quant
    from draftwise.models.loading import gguf_config, gguf_state_dict

    real = gguf_quant.repack

    def reference(data, qtype, shape, out=None):
        if kernel_layout and gguf_quant.kq_format(qtype, tuple(shape)) is not None:
            return real(data, qtype, shape)
        return gguf_quant.parse(data, qtype, shape)

    try:
        gguf_quant.repack = reference
        return gguf_state_dict(reader, gguf_config(reader), keep_quantized=True)
    finally:
        gguf_quant.repack = real


def perturbed(model: Transformer, noise: float, seed: int) -> Transformer:
    """A copy of ``model`` with noisy weights: a draft model that agrees often, not always. Works for
    plain nn.Linear models and for kernel-backed ones (dense weights get noise, integer codes noisy scales)."""
    import copy

    from draftwise.kernels import QLinear

    g = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)

    def noisy(t: torch.Tensor) -> None:
        t.add_((torch.randn(t.shape, generator=g) * noise * t.float().std()).to(t.dtype))

    for m in other.modules():
        if isinstance(m, QLinear):
            if m.bits >= 16:  # dense weights behind an integer view
                noisy(m.q.view(torch.bfloat16 if m.bits == 16 else torch.float32))
            else:
                m.scale.mul_(1 + noise * torch.randn(m.scale.shape, generator=g))
        elif isinstance(m, torch.nn.Linear):
            noisy(m.weight)
    return other


def through_kernel(m: Transformer) -> Transformer:
    """``m`` with every nn.Linear replaced by the batch-invariant kernel on the same fp32 weights (in place)."""
    from draftwise.kernels import QLinear

    for mod in list(m.modules()):
        for name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(mod, name, QLinear.dense(child.weight.float(), child.bias))
    return m


@pytest.fixture(scope="session")
def tiny_target() -> Transformer:
    return random_model(TINY_QWEN, seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target) -> Transformer:
    return perturbed(tiny_target, 0.5, seed=1)


def _byte_level_tokenizer(folder: Path, vocab_size: int) -> None:
    """Train a tiny byte-level BPE tokenizer and save it as an HF tokenizer folder (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["def quicksort(arr): return arr", "hello world, the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None,
                                   additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(str(folder))


def make_hf_folder(folder: Path, vocab_size: int = 300, seed: int = 0, max_context: int = 256,
                   num_layers: int = TINY.num_layers, tied: bool = False, hidden_size: int = TINY.hidden_size) -> Path:
    """A tiny random Llama saved the way HF saves models: config.json + safetensors + tokenizer. ``tied``: no
    ``lm_head.weight``, the embedding table is the output head too (``tie_word_embeddings``)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    _byte_level_tokenizer(folder, vocab_size)
    from transformers import AutoTokenizer

    n_vocab = len(AutoTokenizer.from_pretrained(str(folder)))
    cfg = ModelConfig(**{**TINY.to_dict(), "vocab_size": n_vocab, "max_context": max_context, "num_layers": num_layers,
                           "hidden_size": hidden_size})
    m = random_model(cfg, seed=seed)
    sd = {"model.embed_tokens.weight": m.embed.weight, "model.norm.weight": m.norm.weight,
          "lm_head.weight": m.lm_head.weight}
    D, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.attn.qkv.weight.split([nh * hd, nkv * hd, nkv * hd])
        gate, up = layer.mlp.gate_up.weight.split(cfg.intermediate_size)
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.attn.o.weight,
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": layer.mlp.down.weight,
                   p + "input_layernorm.weight": layer.attn_norm.weight,
                   p + "post_attention_layernorm.weight": layer.mlp_norm.weight})
    if tied:
        del sd["lm_head.weight"]
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": n_vocab, "hidden_size": D,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_eps, "max_position_embeddings": max_context, "tie_word_embeddings": tied,
        "hidden_act": "silu", "torch_dtype": "float32"}))
    return folder


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory) -> Path:
    return make_hf_folder(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hf_folder_other_vocab(tmp_path_factory) -> Path:
    return make_hf_folder(tmp_path_factory.mktemp("tiny-llama-other"), vocab_size=280, seed=3)


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct (fetched once into DRAFTWISE_HOME, sha256-verified)."""
    from draftwise.models import load_model

    return load_model("smollm2-135m-instruct", "bf16", progress=False)


# ---- running in parallel (pytest-xdist: `-n auto --dist loadgroup` in pyproject.toml's addopts) ----------
def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for `-n auto`: the cores this process may use (a container's quota counted), at most 4 —
    the tiny-model tests are single-threaded Python, and more workers only add start-up and memory."""
    from draftwise.cpus import usable_cores

    return max(1, min(usable_cores(), 4))


def pytest_collection_modifyitems(config, items) -> None:
    """The real-weight tests (`slow`, `qwen`) run one after another on one worker: each uses every core's
    kernel thread and holds a model of up to 1.5 GB, while the other workers run the tiny-model tests."""
    for item in items:
        if item.get_closest_marker("slow") or item.get_closest_marker("qwen"):
            item.add_marker(pytest.mark.xdist_group("real-weights"))
