"""Model backend: cache pointer semantics, batch invariance (what makes speculation token-exact),
tree masks, GGUF de-quantization and layout, HF folder loading, and the HF adapter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from draftwise.models.base import KVCache
from draftwise.models.transformer import random_model
from tests.conftest import TINY, TINY_QWEN, through_kernel


def test_cache_pointer_rollback_and_views():
    c = KVCache(2, 3, 2, 16, 4, torch.float32)
    c.set_lengths([5, 6, 7])
    v = c.view(slice(1, 3))
    v.set_lengths(2)
    assert c.lengths.tolist() == [5, 2, 2]
    v.k[0, 0, 0, 0, 0] = 1.0
    assert c.k[0, 1, 0, 0, 0] == 1.0  # shares storage
    c.k[:, 2, :, :2] = 3.0
    c.move_row(2, 0)
    assert c.lengths[0] == 2 and bool((c.k[:, 0, :, :2] == 3.0).all())
    with pytest.raises(ValueError):
        c.set_lengths(17)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_many_equals_one_by_one(dtype):
    """Verification (T tokens in one pass) computes each token exactly like plain decoding does."""
    m = random_model(TINY_QWEN, seed=3, dtype=dtype)
    toks = torch.randint(0, TINY.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    a, b = m.new_cache(1, 64), m.new_cache(1, 64)
    m.forward(toks[:, :6], a)
    m.forward(toks[:, :6], b)
    many = m.forward(toks[:, 6:], a).logits  # (1, 6, V)
    one = torch.cat([m.forward(toks[:, i:i + 1], b).logits for i in range(6, 12)], dim=1)
    if dtype == torch.bfloat16:  # bf16 matmuls are row-invariant on CPU: bit-exact
        assert torch.equal(many, one)
    else:
        torch.testing.assert_close(many, one, atol=1e-4, rtol=1e-4)


def test_batch_rows_equal_single_rows_bf16():
    m = random_model(TINY_QWEN, seed=4, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 9, 5)]
    batch = m.new_cache(3, 64)
    singles = []
    for i, p in enumerate(prompts):
        m.forward(torch.tensor([p]), batch.view(slice(i, i + 1)))
        c = m.new_cache(1, 64)
        m.forward(torch.tensor([p]), c)
        singles.append(c)
    nxt = torch.randint(0, 96, (3, 4), generator=g)
    out = m.forward(nxt, batch).logits
    for i, c in enumerate(singles):
        assert torch.equal(out[i], m.forward(nxt[i:i + 1], c).logits[0])


def test_tree_attention_mask():
    """A custom mask over the new tokens: a branch token that cannot see its sibling gets the same
    logits as if the sibling were not there (the basis of token-tree verification)."""
    m = random_model(TINY, seed=5)
    prefix = torch.tensor([[1, 2, 3, 4]])
    a, b = m.new_cache(1, 32), m.new_cache(1, 32)
    m.forward(prefix, a)
    m.forward(prefix, b)
    # new tokens: x (depth 0), y (depth 1, child of x), z (depth 1, child of x, sibling of y)
    mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    positions = torch.tensor([[4, 5, 5]])
    tree = m.forward(torch.tensor([[7, 8, 9]]), a, positions=positions, attn_mask=mask).logits
    chain = m.forward(torch.tensor([[7, 9]]), b).logits  # x then z, no y
    torch.testing.assert_close(tree[0, 2], chain[0, 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree[0, 0], chain[0, 0], atol=1e-5, rtol=1e-5)


def _write_gguf(path, model, arch="llama", qtypes=("F32",)):
    """Write a tiny model as llama.cpp would: GGUF names, Q/K rows permuted for llama, quantized."""
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_context)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_vocab_size(cfg.vocab_size)

    def permute(x, n_head):  # what llama.cpp's converter does to HF q/k weights
        return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    tensors = {"token_embd.weight": model.embed.weight, "output_norm.weight": model.norm.weight,
               "output.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        q, k, v = layer.attn.qkv.weight.split([nh * hd, nkv * hd, nkv * hd])
        gate, up = layer.mlp.gate_up.weight.split(cfg.intermediate_size)
        if arch == "llama":
            q, k = permute(q, nh), permute(k, nkv)
        tensors.update({f"blk.{i}.attn_q.weight": q, f"blk.{i}.attn_k.weight": k, f"blk.{i}.attn_v.weight": v,
                        f"blk.{i}.attn_output.weight": layer.attn.o.weight, f"blk.{i}.ffn_gate.weight": gate,
                        f"blk.{i}.ffn_up.weight": up, f"blk.{i}.ffn_down.weight": layer.mlp.down.weight,
                        f"blk.{i}.attn_norm.weight": layer.attn_norm.weight,
                        f"blk.{i}.ffn_norm.weight": layer.mlp_norm.weight})
        if cfg.qkv_bias:
            qb, kb, vb = layer.attn.qkv.bias.split([nh * hd, nkv * hd, nkv * hd])
            tensors.update({f"blk.{i}.attn_q.bias": qb, f"blk.{i}.attn_k.bias": kb, f"blk.{i}.attn_v.bias": vb})
    for j, (name, t) in enumerate(tensors.items()):
        arr = t.detach().float().numpy()
        qt = getattr(gguf.GGMLQuantizationType, qtypes[j % len(qtypes)]) if arr.ndim == 2 else \
            gguf.GGMLQuantizationType.F32
        data = quantize(arr, qt) if qt != gguf.GGMLQuantizationType.F32 else arr
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,qtypes,tol", [("llama", ("F32",), 0.0), ("qwen2", ("F16",), 2e-3),
                                             ("llama", ("Q8_0", "F16"), 2e-2)])
def test_gguf_dequantize_and_layout(tmp_path, arch, qtypes, tol):
    from gguf import GGUFReader

    from draftwise.models.loading import gguf_config, gguf_state_dict

    cfg = TINY_QWEN if arch == "qwen2" else TINY
    cfg = cfg.__class__(**{**cfg.to_dict(), "hidden_size": 64, "head_dim": 16, "intermediate_size": 128})
    m = random_model(cfg, seed=7)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, m, arch, qtypes)
    reader = GGUFReader(str(path))
    got = gguf_config(reader)
    assert (got.arch, got.num_layers, got.num_heads, got.num_kv_heads, got.head_dim, got.qkv_bias) == \
        (arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, arch == "qwen2")
    sd = gguf_state_dict(reader, got)
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, _ = m.layers[1].attn.qkv.weight.split([nh * hd, nkv * hd, nkv * hd])
    for name, ref in [("model.layers.1.self_attn.q_proj.weight", q), ("model.layers.1.self_attn.k_proj.weight", k),
                      ("model.layers.1.mlp.down_proj.weight", m.layers[1].mlp.down.weight)]:
        err = (sd[name] - ref).abs().max().item() / ref.abs().max().item()
        assert err <= tol + 1e-7, (name, err)


def test_hf_folder_native_equals_transformers(hf_folder):
    """Native backend vs the HF adapter (transformers' own Llama) on the same folder: same greedy tokens."""
    from draftwise import SamplingParams, SpeculativeDecoder

    native = SpeculativeDecoder(str(hf_folder), None, dtype="fp32", progress=False)
    hf = SpeculativeDecoder(str(hf_folder), str(hf_folder), dtype="fp32", backend="hf", progress=False)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in ["def quicksort(arr):", "hello world", "the lazy dog"]:
        a = native.generate(prompt, params, method="ar")
        b = hf.generate(prompt, params, method="ar")
        assert a.token_ids == b.token_ids
        # speculation on the HF adapter: rollback through DynamicCache.crop
        c = hf.generate(prompt, params, method="pld")
        d = hf.generate(prompt, params, method="nasd", gamma=3)
        # a draft model on the adapter (itself: every draft accepted), its lookup feeding several tokens a pass
        e = hf.generate(prompt, params, method="draft", gamma=4)
        assert c.token_ids == a.token_ids == d.token_ids == e.token_ids


def test_unknown_and_bad_model_refs(tmp_path):
    from draftwise.errors import ModelNotFoundError
    from draftwise.models import load_model

    with pytest.raises(ModelNotFoundError, match="unknown model"):
        load_model("no-such-model")
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(ModelNotFoundError):
        load_model(str(tmp_path / "x.bin"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_long_prefill_takes_the_gemm_path_and_stays_close(hf_folder):
    """Prefills longer than the exact-attention limit use de-quantized bf16 GEMMs (fast); their logits
    stay close to the exact kernel's, and decoding after them is still token-exact across methods."""
    from draftwise import SamplingParams, SpeculativeDecoder
    from draftwise.models import load_model

    from draftwise.models.transformer import EXACT_MAX_T

    lm = load_model(str(hf_folder), "bf16", progress=False)
    m = lm.model
    n = EXACT_MAX_T + 12  # past the exact path's limit: one GEMM pass
    toks = torch.randint(0, m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    a, b = m.new_cache(1, n), m.new_cache(1, n)
    bulk = m.forward(toks, a).logits  # GEMM path
    exact = torch.cat([m.forward(toks[:, i:i + n // 4], b).logits for i in range(0, n, n // 4)], dim=1)
    assert not torch.equal(bulk, exact)  # really a different path
    torch.testing.assert_close(bulk, exact, atol=0.05 * float(exact.abs().max()), rtol=0.05)
    dw = SpeculativeDecoder(lm, lm, progress=False)
    ids = toks[0].tolist()
    ref = dw.generate(ids, SamplingParams(max_tokens=20, ignore_eos=True), method="ar").token_ids
    for method in ("draft", "pld", "nasd"):
        assert dw.generate(ids, SamplingParams(max_tokens=20, ignore_eos=True), method=method).token_ids == ref


def test_exact_prefill_keeps_fp32_numbers_for_long_prompts(hf_folder, monkeypatch):
    """Under ``kernels.exact_prefill`` (what ``draftwise agreement`` measures with) a long prefill of an fp32
    model never takes the bf16 bulk GEMM: its logits are the chunked exact kernel's to fp32 accuracy."""
    from draftwise import kernels
    from draftwise.models import load_model

    monkeypatch.setattr(kernels, "_bulk_pays", lambda: True)  # a CPU where the bf16 bulk path runs
    from draftwise.models.transformer import EXACT_MAX_T

    m = load_model(str(hf_folder), "fp32", progress=False).model
    n = EXACT_MAX_T + 12
    toks = torch.randint(0, m.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    a, b, c = m.new_cache(1, n), m.new_cache(1, n), m.new_cache(1, n)
    exact = torch.cat([m.forward(toks[:, i:i + n // 4], b).logits for i in range(0, n, n // 4)], dim=1)
    with kernels.exact_prefill():
        kept = m.forward(toks, a).logits
    bulk = m.forward(toks, c).logits
    scale = float(exact.abs().max())
    assert float((kept - exact).abs().max()) < 1e-4 * scale
    assert float((bulk - exact).abs().max()) > 10 * float((kept - exact).abs().max())  # bf16 really differs


def test_draft_dtype_loads_the_draft_in_its_own_format(hf_folder):
    from draftwise.api import SpeculativeDecoder
    from draftwise.sampling import SamplingParams

    dw = SpeculativeDecoder(str(hf_folder), str(hf_folder), dtype="fp32", draft_dtype="int8", progress=False)
    assert dw.target.weights == "fp32" and dw.draft.weights == "int8"
    plain = dw.generate("def quicksort", SamplingParams(temperature=0, max_tokens=12), method="ar")
    spec = dw.generate("def quicksort", SamplingParams(temperature=0, max_tokens=12), method="draft", gamma=3)
    assert spec.token_ids == plain.token_ids


def test_fused_decode_attention_matches_torch_ops(monkeypatch):
    """The fused rotary + KV append + attention call computes what the torch ops compute."""
    from draftwise.models import transformer

    m = random_model(TINY_QWEN, seed=5, dtype=torch.float32)
    toks = torch.randint(0, TINY.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    a = m.new_cache(2, 64)
    m.forward(toks[:, :4], a)
    fused = m.forward(toks[:, 4:], a).logits
    monkeypatch.setattr(transformer, "extension", lambda: None)
    b = m.new_cache(2, 64)
    m.forward(toks[:, :4], b)
    ref = m.forward(toks[:, 4:], b).logits
    torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.k[:, :, :, :10], b.k[:, :, :, :10], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.v[:, :, :, :10], b.v[:, :, :, :10], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cached", [0, 5])
def test_long_prefill_through_the_compiled_row_ops_matches_torch_ops(monkeypatch, cached):
    """A prompt longer than the exact-attention limit: norms, silu * up, rotary and the KV append run compiled
    (the rows spread over the kernel's threads), attention through torch (causal from an empty cache, masked
    after a cached prefix): what the torch ops compute, and the same keys and values in the cache."""
    from draftwise.models import transformer

    if transformer.extension() is None:
        pytest.skip("the C++ kernel is not built here")
    m = random_model(TINY_QWEN, seed=7, dtype=torch.float32)
    T = transformer.EXACT_MAX_T + 9
    toks = torch.randint(0, TINY.vocab_size, (2, cached + T), generator=torch.Generator().manual_seed(4))

    def prefill():
        c = m.new_cache(2, cached + T)
        if cached:
            m.forward(toks[:, :cached], c)
        return m.forward(toks[:, cached:], c).logits, c

    fused, a = prefill()
    monkeypatch.setattr(transformer, "extension", lambda: None)
    ref, b = prefill()
    torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-4)
    n = cached + T
    torch.testing.assert_close(a.k[:, :, :, :n], b.k[:, :, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.v[:, :, :, :n], b.v[:, :, :, :n], atol=1e-5, rtol=1e-5)


def test_a_long_prompts_mlp_in_chunks_of_rows_gives_the_same_bits(monkeypatch):
    """A prompt's MLP runs MLP_ROWS rows at a time (bounded buffers); every op is row-wise, so the logits
    and the cache are the bits of one call over all rows (with the kernel's exact rule for every row count,
    as K-quant weights always have: no bf16 GEMM for the long calls)."""
    from draftwise import kernels
    from draftwise.models import transformer

    monkeypatch.setattr(kernels, "BULK_MIN_ROWS", 10 ** 9)
    m = through_kernel(random_model(TINY_QWEN, seed=8, dtype=torch.float32))
    toks = torch.randint(0, TINY.vocab_size, (2, 45), generator=torch.Generator().manual_seed(5))
    whole_cache = m.new_cache(2, 64)
    whole = m.forward(toks, whole_cache).logits
    monkeypatch.setattr(transformer, "MLP_ROWS", 16)  # 90 rows: 6 chunks, the last one short
    parts_cache = m.new_cache(2, 64)
    parts = m.forward(toks, parts_cache).logits
    assert torch.equal(whole, parts)
    assert torch.equal(whole_cache.k[..., :45, :], parts_cache.k[..., :45, :])
    assert torch.equal(whole_cache.v[..., :45, :], parts_cache.v[..., :45, :])


def test_forward_many_equals_one_by_one_through_the_kernels_bit_exact():
    """fp32 weights through the kernel + fused attention: verification is bit-identical to decoding."""
    m = through_kernel(random_model(TINY_QWEN, seed=6, dtype=torch.float32))
    toks = torch.randint(0, TINY.vocab_size, (1, 14), generator=torch.Generator().manual_seed(3))
    a, b = m.new_cache(1, 64), m.new_cache(1, 64)
    m.forward(toks[:, :6], a)
    m.forward(toks[:, :6], b)
    many = m.forward(toks[:, 6:], a).logits
    one = torch.cat([m.forward(toks[:, i:i + 1], b).logits for i in range(6, 14)], dim=1)
    assert torch.equal(many, one)


# ---- lean loading: quantized embeddings, fused projections on disk, memory-mapped weights -----------------
@pytest.mark.parametrize("bits,affine", [(4, True), (8, False), (8, True)])
def test_quantized_embedding_rows_equal_the_dense_table(bits, affine):
    from draftwise.kernels import dequantize, quantize_rtn
    from draftwise.models.transformer import QEmbedding

    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(bits))
    q, scale, minv = quantize_rtn(w, bits, 32)
    if affine and minv is None:
        minv = torch.rand(scale.shape, generator=torch.Generator().manual_seed(1))
    table = dequantize(q, scale, minv, 32, bits)  # what the model used to hold, (300, 64) fp32
    emb = QEmbedding(q, scale, minv if minv is not None else torch.empty(0), 32, bits, torch.float32)
    ids = torch.tensor([[0, 299, 7, 7], [150, 3, 298, 1]])
    assert torch.equal(emb(ids), table[ids])


MIXED = ("Q8_0", "Q8_0", "Q4_0", "Q4_0", "Q8_0", "Q4_1")


def _mixed_gguf(tmp_path, monkeypatch, arch="qwen2", qtypes=MIXED):
    """A Q4_K_M-like GGUF (q/k and gate in one format, v and up in another) in a fresh $DRAFTWISE_HOME."""
    from draftwise.models import loading

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    base = TINY_QWEN if arch == "qwen2" else TINY
    cfg = base.__class__(**{**base.to_dict(), "hidden_size": 64, "head_dim": 16, "intermediate_size": 128})
    m = random_model(cfg, seed=9)
    path = tmp_path / "mixed.gguf"
    _write_gguf(path, m, arch, qtypes)
    monkeypatch.setattr(loading, "_save_gguf_tokenizer", lambda p, dest: _copy_tokenizer(dest, cfg.vocab_size))
    return cfg, path


def _unfused_reference(path):
    """The model built from the GGUF's unfused tensors, parsed by the numpy reference (gguf_quant.parse)."""
    from gguf import GGUFReader

    from draftwise.models.loading import gguf_config
    from draftwise.models.transformer import from_state_dict
    from tests.conftest import reference_state_dict

    reader = GGUFReader(str(path))
    return from_state_dict(gguf_config(reader), reference_state_dict(reader, kernel_layout=True), torch.float32)


@pytest.mark.parametrize("arch,qtypes", [("qwen2", MIXED), ("llama", MIXED), ("qwen2", ("Q8_0", "F16", "Q4_1"))])
def test_gguf_is_read_in_place_fused_and_equals_the_unfused_model(tmp_path, monkeypatch, arch, qtypes):
    """With DRAFTWISE_KEEP_CONVERTED=0 a GGUF is the only copy on disk: its converted folder holds config,
    tokenizer and tensor table, no weights; every load re-packs the blocks (fused runs written in place,
    llama's Q/K rows put back in order), later loads never parse the GGUF's header again, the embedding stays quantized, and the
    logits equal those of the model built from the unfused tensors by the numpy reference, bit for bit
    (also when a projection mixes dense F16 parts with quantized ones: those are concatenated whole). The
    untied token embedding is not re-packed at all: lookups read its rows from the file."""
    import gguf

    from draftwise.kernels import QLinear, extension
    from draftwise.models import load_model
    from draftwise.models.loading import LAYOUT_FILE, converted_dir
    from draftwise.models.transformer import Concat, GGUFEmbedding, QEmbedding

    if extension() is None:
        pytest.skip("the kernel is not built here (no compiler): GGUFs are converted instead")
    cfg, path = _mixed_gguf(tmp_path, monkeypatch, arch, qtypes)
    monkeypatch.setenv("DRAFTWISE_KEEP_CONVERTED", "0")
    lm = load_model(str(path), "gguf", progress=False)  # reads the layout, then the blocks
    folder = converted_dir(path)
    assert (folder / LAYOUT_FILE).exists() and not list(folder.glob("*.safetensors"))

    def boom(*a, **k):
        raise AssertionError("GGUF header parsed again")

    real_reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", boom)
    again = load_model(str(path), "gguf", progress=False)
    for model in (lm.model, again.model):
        assert isinstance(model.embed, GGUFEmbedding)  # untied: the table stays in the file
        assert _is_file_backed(model.embed.raw, path)
        qkv = model.layers[0].attn.qkv
        assert isinstance(qkv, (QLinear, Concat))
        q = qkv.q if isinstance(qkv, QLinear) else qkv.parts[0].q
        assert not _is_file_backed(q, path)
    monkeypatch.setattr(gguf, "GGUFReader", real_reader)
    ref = _unfused_reference(path)
    assert isinstance(ref.embed, QEmbedding)
    toks = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    every = torch.arange(cfg.vocab_size).view(2, -1)
    assert torch.equal(again.model.embed(every), ref.embed(every))  # every row, bit for bit
    a, b = again.model.new_cache(1, 32), ref.new_cache(1, 32)
    assert torch.equal(again.model.forward(toks, a).logits, ref.forward(toks, b).logits)


def test_kept_converted_copy_is_mapped_and_equal(tmp_path, monkeypatch):
    """By default the first load of a GGUF keeps its re-packed code as safetensors; later loads (with or
    without the variable) memory-map it, and the model equals the in-place one bit for bit."""
    from draftwise.kernels import QLinear, extension
    from draftwise.models import load_model
    from draftwise.models.loading import converted_dir

    cfg, path = _mixed_gguf(tmp_path, monkeypatch)
    monkeypatch.delenv("DRAFTWISE_KEEP_CONVERTED", raising=False)
    if extension() is not None:
        in_place = load_model(str(path), "gguf", progress=False, keep_converted=False)
    weights = converted_dir(path) / "model-gguf.safetensors"
    assert not weights.exists()
    first = load_model(str(path), "gguf", progress=False)  # re-packs and keeps (or converts, without the kernel)
    assert weights.exists() and not list(weights.parent.glob("*.tmp"))
    monkeypatch.setenv("DRAFTWISE_KEEP_CONVERTED", "0")
    mapped = load_model(str(path), "gguf", progress=False)
    for m in (first, mapped):
        qkv = m.model.layers[0].attn.qkv
        assert _is_file_backed(qkv.q if isinstance(qkv, QLinear) else qkv.parts[0].q, weights)
    if extension() is not None:
        toks = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
        a, b = mapped.model.new_cache(1, 32), in_place.model.new_cache(1, 32)
        assert torch.equal(mapped.model.forward(toks, a).logits, in_place.model.forward(toks, b).logits)


def test_converted_copies_are_aligned_and_standard_safetensors(tmp_path):
    """save_aligned: every tensor 64-byte aligned in a memory map of the file (fillers between them, never
    returned), and the file still a valid safetensors file (the library reads it back equal)."""
    from safetensors.torch import load_file

    from draftwise.models.loading import ST_ALIGN, mmap_safetensors, save_aligned

    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randint(0, 255, (3, 7), dtype=torch.uint8, generator=g), "b": torch.randn(5, generator=g),
          "c": torch.randn(2, 3, generator=g).bfloat16(), "d": torch.tensor([1, 2, 3], dtype=torch.int64),
          "e": torch.empty(4, 0), "f": torch.randint(-9, 9, (11,), dtype=torch.int8, generator=g),
          "g": torch.tensor([True, False])}
    path = tmp_path / "x.safetensors"
    save_aligned(sd, path)
    back, mapped = load_file(str(path)), mmap_safetensors(path)
    assert set(mapped) == set(sd) and set(back) - set(sd) <= {k for k in back if k.startswith("__pad")}
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
        assert mapped[k].dtype == v.dtype and torch.equal(mapped[k], v), k
        if v.numel():
            assert mapped[k].data_ptr() % ST_ALIGN == 0, k


def test_int4_conversion_keeps_an_untied_embedding_in_its_blocks(tmp_path, monkeypatch):
    """An int4 (or int8) conversion quantizes the projections and keeps the untied token embedding exact: as
    the GGUF's own blocks (no fp32 table in the copy), every row equal to the de-quantized table's."""
    import json

    from draftwise.kernels import extension
    from draftwise.models import load_model
    from draftwise.models.loading import converted_dir
    from draftwise.models.transformer import GGUFEmbedding

    if extension() is None:
        pytest.skip("the kernel is not built here")
    cfg, path = _mixed_gguf(tmp_path, monkeypatch)
    lm = load_model(str(path), "int4", progress=False)
    f = converted_dir(path) / "model-int4.safetensors"
    header = json.loads(f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8], "little")])
    assert "model.embed_tokens.weight" not in header and "model.embed_tokens.weight.gguf" in header
    assert isinstance(lm.model.embed, GGUFEmbedding)
    ref = _unfused_reference(path)
    every = torch.arange(cfg.vocab_size).view(2, -1)
    assert torch.equal(lm.model.embed(every), ref.embed(every))


@pytest.mark.parametrize("why", ["room", "write"])
def test_no_room_for_a_kept_copy_reads_in_place(tmp_path, monkeypatch, capsys, why):
    """A disk without room for the copy (its size + KEEP_MARGIN free), or one that refuses the write, keeps
    no copy and leaves no partial file: the load goes on from the re-packed code, with a note saying why."""
    import errno
    import shutil
    from collections import namedtuple

    from draftwise.kernels import extension
    from draftwise.models import load_model, loading
    from draftwise.models.loading import converted_dir

    if extension() is None:
        pytest.skip("the kernel is not built here: GGUFs are converted instead")
    cfg, path = _mixed_gguf(tmp_path, monkeypatch)
    monkeypatch.delenv("DRAFTWISE_KEEP_CONVERTED", raising=False)
    if why == "room":
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 10**8, 10**8))
    else:
        def full(sd, filename, *a, **k):
            with open(filename, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(loading, "save_aligned", full)
    lm = load_model(str(path), "gguf", progress=True)
    assert "not keeping a converted copy" in capsys.readouterr().err
    folder = converted_dir(path)
    assert not list(folder.glob("model-*")) and not list(folder.glob("*.tmp"))
    toks = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    assert torch.isfinite(lm.model.forward(toks, lm.model.new_cache(1, 16)).logits).all()


def test_truncated_gguf_is_a_clear_error(tmp_path, monkeypatch):
    from draftwise.errors import ModelNotFoundError
    from draftwise.kernels import extension
    from draftwise.models import load_model
    from draftwise.models.loading import LAYOUT_FILE, converted_dir

    if extension() is None:
        pytest.skip("the kernel is not built here")
    _, path = _mixed_gguf(tmp_path, monkeypatch)
    load_model(str(path), "gguf", progress=False, keep_converted=False)  # (a kept copy would be mapped instead)
    table = (converted_dir(path) / LAYOUT_FILE).read_text()
    st = path.stat()
    with open(path, "r+b") as f:
        f.truncate(st.st_size - 64)
    import os
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    folder = converted_dir(path)  # keyed on the size: a new folder, so plant the old table in it
    folder.mkdir(parents=True, exist_ok=True)
    old = next(d for d in folder.parent.iterdir() if d != folder and (d / LAYOUT_FILE).exists())
    for f in old.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    assert (folder / LAYOUT_FILE).read_text() == table
    with pytest.raises(ModelNotFoundError, match="shorter than its tensor table"):
        load_model(str(path), "gguf", progress=False)


def _is_file_backed(t: torch.Tensor, path) -> bool:
    """Whether the tensor's memory lies in a mapping of ``path`` (/proc/self/maps)."""
    ptr = t.untyped_storage().data_ptr()
    for line in open("/proc/self/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return len(parts) >= 6 and parts[5] == str(path)
    return False


def _copy_tokenizer(dest, vocab_size: int):
    from tests.conftest import _byte_level_tokenizer

    _byte_level_tokenizer(dest, vocab_size)


def test_mmap_safetensors_reads_every_dtype(tmp_path):
    from safetensors.torch import save_file

    from draftwise.models.loading import mmap_safetensors

    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(4, 2).bfloat16(), "i8": torch.arange(-5, 5, dtype=torch.int8),
               "u8": torch.arange(7, dtype=torch.uint8), "i64": torch.tensor([1, 2]), "f16": torch.randn(6).half(),
               "empty": torch.empty(0)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    got = mmap_safetensors(tmp_path / "x.safetensors")
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    got["f32"][0, 0] = 123.0  # private mapping: the file is not written
    assert torch.equal(mmap_safetensors(tmp_path / "x.safetensors")["f32"], tensors["f32"])


def test_kv_cache_memory_is_committed_as_it_is_used():
    """A 4k-token cache row costs its reserved size only once written: RSS grows with the positions
    used (the OS commits pages on first write), not with the capacity."""
    from draftwise.models.base import KVCache

    def resident(*tensors) -> int:  # bytes of these tensors' pages in memory (mincore), not the whole
        import ctypes  # process's RSS, which other threads' allocations move

        libc = ctypes.CDLL(None, use_errno=True)
        page = 4096
        total = 0
        for t in tensors:
            lo = t.data_ptr() // page * page
            n = -(-(t.data_ptr() + t.numel() * t.element_size() - lo) // page)
            vec = (ctypes.c_ubyte * n)()
            assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
            total += sum(v & 1 for v in vec) * page
        return total

    cache = KVCache(8, 1, 2, 4096, 64, torch.float32)  # 2 x 16 MiB reserved
    reserved = cache.nbytes()
    after_alloc = resident(cache.k, cache.v)
    cache.k[:, 0, :, :64] = 1.0
    cache.v[:, 0, :, :64] = 1.0
    after_write = resident(cache.k, cache.v)
    assert after_alloc < reserved // 8
    assert after_write < reserved // 8  # 64 of 4096 positions written
    cache.k[:, 0, :, :2048] = 1.0  # the measure sees what is written: half of k
    assert resident(cache.k, cache.v) > reserved // 4


TOKENIZER_TEXTS = ["def quicksort(arr):\n    return arr", "  héllo 你好 <|im_end|> x", "\n\n\t  spaces   ", "",
                   "The quick brown fox, 1234567 ünïcödé 🙂"]


def _lean_equals_transformers(folder) -> None:
    from transformers import AutoTokenizer

    from draftwise.models.tokenizer import Tokenizer

    lean, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(str(folder))
    assert lean._hf is None  # the lean path (no transformers tokenizer built)
    for s in TOKENIZER_TEXTS:
        ids = hf.encode(s)
        assert lean.encode(s) == ids, s
        for skip in (True, False):
            assert lean.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), s
    assert lean.vocab_size == len(hf) and lean.vocab_signature() == hf.get_vocab()
    assert lean.eos_ids == Tokenizer.from_hf(hf).eos_ids
    if lean.has_chat_template:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert lean.apply_chat(msgs) == hf.encode(text, add_special_tokens=False)


def test_lean_tokenizer_equals_transformers(hf_folder):
    _lean_equals_transformers(hf_folder)


def test_chat_tokenizer_loads_once_under_concurrent_first_requests(hf_folder, monkeypatch):
    """A server's first chat requests arrive together: the transformers tokenizer is loaded by one of them
    while the others wait (two threads importing transformers at once can see a half-initialised module)."""
    import threading
    import time

    import transformers

    from draftwise.models.tokenizer import Tokenizer

    lean = Tokenizer.from_folder(hf_folder)
    real, calls = transformers.AutoTokenizer.from_pretrained, []

    def slow_load(*a, **kw):
        calls.append(1)
        time.sleep(0.2)  # a wide window for a second loader
        return real(*a, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", slow_load)
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(lean.hf)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 6 and all(h is got[0] for h in got)


@pytest.mark.slow
def test_lean_tokenizer_equals_transformers_on_real_models(smollm):
    from draftwise.models import load_model

    _lean_equals_transformers(smollm.tokenizer.folder)
    for name in ("qwen2.5-coder-0.5b-instruct",):
        try:
            lm = load_model(name, progress=False)
        except Exception as e:  # not downloadable here
            pytest.skip(f"{name}: {e}")
        _lean_equals_transformers(lm.tokenizer.folder)


def _tree_case():
    # root r (the last token) + 7 nodes:   r -> 0 -> 2 -> 5
    #                                       r -> 0 -> 3
    #                                       r -> 1 -> 4 -> 6
    parents = [-1, -1, 0, 0, 1, 2, 4]
    tokens = [11, 12, 13, 14, 15, 16, 17]
    return parents, tokens


def _paths(parents):
    out = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("kernels", [True, False])
def test_tree_nodes_equal_decoding_their_paths_bit_exact(kernels, monkeypatch):
    """Every node of a verified token tree gets the bits decoding its path token by token gives — through
    the fused kernel attention (keys visited in path order) and through the torch fallback — for each row
    of a batch with ragged prefixes; keep_path then leaves the cache as decoding the accepted path would."""
    from draftwise.decode import tree_inputs
    from draftwise.models import transformer

    if kernels:
        m = through_kernel(random_model(TINY_QWEN, seed=7, dtype=torch.float32))
    else:  # torch ops; bf16, whose CPU matmuls are row-invariant (fp32 nn.Linear is not: see above)
        m = random_model(TINY_QWEN, seed=7, dtype=torch.bfloat16)
        monkeypatch.setattr(transformer, "extension", lambda: None)
    parents, tokens = _tree_case()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 9)]
    lasts = [3, 4]
    cache = m.new_cache(2, 64)
    for b, p in enumerate(prompts):
        m.forward(torch.tensor([p]), cache.view(slice(b, b + 1)))
    x, positions, mask = tree_inputs([[lasts[0]] + tokens, [lasts[1]] + tokens[:5]],
                                     [[-1] + [q + 1 for q in parents], [-1] + [q + 1 for q in parents[:5]]],
                                     cache.lengths[:2].tolist())
    tree = m.forward(x, cache, positions=positions, attn_mask=mask).logits  # (2, 8, V)
    for b, p in enumerate(prompts):
        n_nodes = 7 if b == 0 else 5
        for i, path in enumerate(_paths(parents[:n_nodes])):
            c = m.new_cache(1, 64)
            m.forward(torch.tensor([p]), c)
            seq = [lasts[b]] + [tokens[j] for j in path]
            out = torch.cat([m.forward(torch.tensor([[t]]), c).logits for t in seq], dim=1)[0]  # (len, V)
            assert torch.equal(tree[b, i + 1], out[-1]), (b, i)
            if b == 0 and i == 0:
                assert torch.equal(tree[b, 0], out[0])
    # accept path r -> 1 -> 4 -> 6 in row 0: the cache then equals decoding that path
    start = len(prompts[0])
    cache.keep_path(0, start, [0, 2, 5, 7])
    ref = m.new_cache(1, 64)
    m.forward(torch.tensor([prompts[0] + [lasts[0], 12, 15, 17]]), ref)
    n = start + 4
    assert cache.length(0) == n
    torch.testing.assert_close(cache.k[:, 0, :, :n], ref.k[:, 0, :, :n], atol=1e-2, rtol=1e-2)
    nxt_a = m.forward(torch.tensor([[9]]), cache.view(slice(0, 1))).logits
    c = m.new_cache(1, 64)
    m.forward(torch.tensor([prompts[0]]), c)
    for t in [lasts[0], 12, 15, 17, 9]:
        nxt_b = m.forward(torch.tensor([[t]]), c).logits
    assert torch.equal(nxt_a, nxt_b)


def test_byte_identical_tokenizers_are_read_once(tmp_path):
    """Two folders with the same tokenizer.json share one Rust tokenizer (a draft of the target's family
    skips parsing it again and the vocabulary comparison); a different file gets its own."""
    from draftwise.drafters.draft_model import check_compatible
    from draftwise.errors import IncompatibleModelsError
    from draftwise.models.tokenizer import Tokenizer

    for name, vocab in (("a", 300), ("b", 300), ("c", 301)):
        _copy_tokenizer(tmp_path / name, vocab)
    a, b, c = (Tokenizer.from_folder(tmp_path / n) for n in "abc")
    assert a.fast is b.fast and a.fast is not c.fast and a.folder != b.folder
    cfg = TINY.__class__(**{**TINY.to_dict(), "vocab_size": 300})
    check_compatible(a, b, cfg, cfg)
    with pytest.raises(IncompatibleModelsError):
        check_compatible(a, c, cfg, TINY.__class__(**{**TINY.to_dict(), "vocab_size": 301}))


def test_draft_weights_default_to_int4_for_a_quantized_target(hf_folder, monkeypatch):
    """A draft is read once per drafted token: without --draft-dtype it runs int4 where the target runs
    quantized on the native backend (its precision moves acceptance only), else in the target's format."""
    from draftwise import SpeculativeDecoder
    from draftwise.models import default_draft_weights, load_model

    assert [default_draft_weights(d) for d in ("auto", "gguf", "int8", "int4", "bf16", "fp32")] == \
        ["int4", "int4", "int4", "int4", "bf16", "fp32"]
    assert default_draft_weights("auto", "hf") == "auto"
    monkeypatch.setenv("DRAFTWISE_NO_KERNELS", "1")
    assert default_draft_weights("gguf") == "gguf"  # no kernel: int4 would run de-quantized, in fp32
    monkeypatch.delenv("DRAFTWISE_NO_KERNELS")
    target = load_model(str(hf_folder), "bf16", progress=False)
    assert SpeculativeDecoder(target, "some-draft", progress=False).draft_dtype == "int4"
    assert SpeculativeDecoder(target, "some-draft", dtype="fp32", progress=False).draft_dtype == "fp32"
    assert SpeculativeDecoder(target, "some-draft", draft_dtype="gguf", progress=False).draft_dtype == "gguf"
    dw = SpeculativeDecoder(target, str(hf_folder), dtype="int8", progress=False)  # the draft loads as int4
    assert dw.draft.weights == "int4"


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("kernels", [True, False])
def test_packed_rows_equal_the_padded_pass(kernels, tree):
    """forward(lengths=...) runs each row's real tokens only through the matmuls (Packing): the real
    positions' logits, hidden states and taps are the padded pass's (bit for bit through the batch-invariant
    kernel), the cache holds the same keys for them, padding positions come back zero; bad lengths are
    refused."""
    from draftwise.models.base import ModelConfig

    # wide enough (D 512) that torch's norm and the fused one round differently
    cfg = ModelConfig(**{**TINY_QWEN.to_dict(), "hidden_size": 512, "intermediate_size": 1024, "num_heads": 8,
                         "num_kv_heads": 4, "head_dim": 64})
    m = random_model(cfg, seed=3, dtype=torch.float32)
    if kernels:
        from draftwise.kernels import extension

        if extension() is None:
            pytest.skip("the kernel is not built here")
        m = through_kernel(m)
    same = torch.equal if kernels else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5))
    # more real tokens (36) than a short forward's T limit (32): the packed (N, D) tensors must still take the
    # fused layer ops the padded (B, T, D) ones take (they round differently from torch's)
    B, T, C = 8, 6, 7
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, TINY.vocab_size, (B, C), generator=g)
    x = torch.randint(0, TINY.vocab_size, (B, T), generator=g)
    lengths = [6, 1, 3, 2, 6, 6, 6, 6]
    kw = {}
    if tree:  # row 0 a tree (two branches off the root), the others chains
        mask = torch.tril(torch.ones(B, T, T, dtype=torch.bool))
        mask[0, 3:, 1:3] = False
        kw = {"attn_mask": mask,
              "positions": torch.tensor([[C, C + 1, C + 2, C + 1, C + 2, C + 3]] + [list(range(C, C + T))] * (B - 1))}
    outs, caches = [], []
    for lens in (None, lengths):
        cache = m.new_cache(B, C + T)
        m.forward(ctx, cache, logits_for="last")
        outs.append(m.forward(x, cache, logits_for="all", taps=(1,), lengths=lens, **kw))
        caches.append(cache)
    full, packed = outs
    for b, n in enumerate(lengths):
        assert same(packed.logits[b, :n], full.logits[b, :n])
        assert same(packed.hidden[b, :n], full.hidden[b, :n])
        assert same(packed.taps[b, :n], full.taps[b, :n])
        assert not packed.logits[b, n:].any()
        assert same(caches[1].k[0][b, :, :C + n], caches[0].k[0][b, :, :C + n])
    cache = m.new_cache(B, C + T)
    for bad in ([6, 1, 3], [0] + [1] * 7, [7] + [1] * 7):
        with pytest.raises(ValueError, match="lengths"):
            m.forward(x, cache, logits_for="all", lengths=bad)
    with pytest.raises(ValueError, match="lengths"):
        m.forward(x, cache, logits_for="last", lengths=lengths)


@pytest.mark.parametrize("qtypes", [MIXED, ("Q4_1", "Q4_0", "Q8_0", "Q4_0", "Q4_1", "Q5_0")])
def test_fused_stack_gives_the_module_loop_bits(tmp_path, monkeypatch, qtypes):
    """A K-quant model's short forwards run its decoder layers in one compiled call (``Stack``): logits, taps
    and cache are the module loop's bit for bit — one token, a verification pass of several rows with ragged
    prefixes, a token tree, packed rows (rows feeding fewer tokens than others), a subset of the layers (layer
    skipping), inner layers' outputs (EAGLE-3) — and
    the plan follows the weights: a projection replaced, or the model converted, rebuilds it; a copy builds
    its own. A model with a dense projection keeps the loop."""
    from draftwise.kernels import extension
    from draftwise.models import load_model
    from draftwise.models.transformer import Concat

    if extension() is None:
        pytest.skip("the kernel is not built here")
    cfg, path = _mixed_gguf(tmp_path, monkeypatch, "qwen2", qtypes)
    m = load_model(str(path), "gguf", progress=False).model
    assert m._stack() is not None and m._stack().layers == cfg.num_layers
    assert isinstance(m.layers[0].attn.qkv, Concat) or qtypes != MIXED  # parts concatenated, biases per part
    g = torch.Generator().manual_seed(2)
    V = cfg.vocab_size
    ctx = [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 3)]
    x = torch.randint(0, V, (2, 5), generator=g)
    mask = torch.tril(torch.ones(2, 5, 5, dtype=torch.bool))
    mask[0, 3:, 1:3] = False  # row 0: two branches off the root

    def run(fused: bool, **kw):
        m.fused_layers = fused
        cache = m.new_cache(2, 32)
        for b, p in enumerate(ctx):
            m.forward(torch.tensor([p]), cache.view(slice(b, b + 1)), logits_for="last")
        outs = [m.forward(x[:, :1], cache, logits_for="all", **kw)]
        outs.append(m.forward(x, cache, logits_for="all", **kw))
        cache.set_lengths([len(p) + 1 for p in ctx])
        outs.append(m.forward(x, cache, attn_mask=mask, **kw))
        cache.set_lengths([len(p) + 1 for p in ctx])
        outs.append(m.forward(x, cache, lengths=[5, 2], **kw))  # packed rows: a row drafted fewer tokens
        cache.set_lengths([len(p) + 1 for p in ctx])
        outs.append(m.forward(x, cache, attn_mask=mask, lengths=[4, 5], **kw))  # packed, and a tree
        return [t for o in outs for t in (o.logits, o.taps, o.hidden) if t is not None], cache

    for kw in ({}, {"layers": (0,)}, {"taps": (0, 1)}):  # all layers, one of them, inner layers' outputs too
        (fused, cf), (loop, cl) = run(True, **kw), run(False, **kw)
        for a, b in zip(fused, loop):
            assert torch.equal(a, b)
        written = (slice(None), slice(None), slice(None), slice(0, 13))  # every row's cached and new positions
        assert torch.equal(cf.k[written], cl.k[written]) and torch.equal(cf.v[written], cl.v[written])
    m.fused_layers = True
    before = m._stack()
    down = m.layers[1].mlp.down
    m.layers[1].mlp.down = type(down)(down.q.clone(), down.scale, down.minv, down.group, down.bits)
    m.layers[1].mlp.down.q.zero_()  # a different weight: the rebuilt plan must read it
    assert m._stack() is not before
    (fused, _), (loop, _) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(fused, loop))
    m.fused_layers = True
    twin = copy.deepcopy(m)  # a copy builds its own plan over its own weights
    assert twin._stack() is not None and twin._stack() is not m._stack()
    a, b = m.new_cache(1, 8), twin.new_cache(1, 8)
    assert torch.equal(m.forward(x[:1], a).logits, twin.forward(x[:1], b).logits)
    plan = m._stack()
    m.float()  # a conversion may swap every tensor
    assert m._stack() is not plan
    m.layers[0].mlp.down = nn.Linear(down.in_features, down.out_features, bias=False)  # dense: the loop
    assert m._stack() is None
