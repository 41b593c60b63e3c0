"""The K-quant rule's block formats (csrc/core/kquant.h BLOCK FORMATS): Q4_0 / Q4_1 / Q5_0 / Q8_0 weights
computed from the GGUF's own bytes, 16 columns interleaved per tile, one integer dot product and one float
step per block of 32. The layout de-quantizes to exactly the numpy reference's weights (and to the gguf
package's); (the product against a float64 reference of the same rounding, on every path and row count, and
partial tiles: test_kquant.py, over every format); models made of such matrices (e.g. Qwen2.5-0.5B's Q5_0 / Q8_0, K = 896) load in place,
fused, and decode batch-invariantly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.kernels import KQ_BITS, QLinear, available_isas, dequantize, extension, using_isa
from draftwise.kernels.gguf_quant import kq_format, parse, repack
from tests.conftest import TINY_QWEN
from tests.test_kquant import BLOCK, TID, random_blocks
from tests.test_kquant import block_reference_product as reference_product

pytestmark = pytest.mark.skipif(extension() is None, reason="the kernel is not built here")

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q8_0"]


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("N", [32, 48])
def test_layout_dequantizes_to_the_file_weights(qtype, N):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    K = 96  # three blocks: not a multiple of 64 (or 256)
    raw = random_blocks(qtype, N, K, seed=N + len(qtype))
    code = repack(raw, qtype, (N, K))
    assert code.bits == TID[qtype] and code.q.shape == (N // 16, K // 32 * KQ_BITS[code.bits])
    assert KQ_BITS[code.bits] == 16 * BLOCK[qtype][1]  # the file's bytes, no more
    ref = parse(raw, qtype, (N, K))
    want = dequantize(ref.q, ref.scale, ref.minv, ref.group, ref.bits)
    got = dequantize(code.q, code.scale, None, code.group, code.bits)
    assert torch.equal(got, want)  # (Q4_0: d * (u - 8) is -0.0 where d < 0 and u = 8, the reference's +0.0)
    theirs = torch.from_numpy(gguf_dequantize(raw, getattr(GGMLQuantizationType, qtype)).astype(np.float32))
    assert torch.allclose(got, theirs.view(N, K), rtol=1e-6, atol=1e-9)
    idx = torch.tensor([N - 1, 0, 5, 5])
    assert torch.equal(extension().kq_rows(code.q.view(-1), code.bits, N, K, idx), want[idx])


def test_the_block_rule_is_closer_to_exact_than_the_groups_of_32_code_on_its_own_weights():
    """Same weights, same activations: the block rule's one float step per block of 32 is at least as
    accurate as the groups-of-32 code's per-lane float steps (both quantize activations per 32)."""
    N, K = 64, 896
    raw = random_blocks("Q5_0", N, K, seed=9)
    code, old = repack(raw, "Q5_0", (N, K)), parse(raw, "Q5_0", (N, K))
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(4))
    W = dequantize(old.q, old.scale, old.minv, old.group, old.bits)
    y = reference_product(x, W)
    new = extension().qmm_kq(x, code.q.view(-1), code.bits, N).double()
    grp = QLinear(old.q, old.scale, old.minv, old.group, old.bits)(x).double()
    assert (new - y).abs().max() <= (grp - y).abs().max() * 1.5 + 1e-6


def test_which_tensors_take_the_block_rule(monkeypatch):
    for qtype in FORMATS:
        assert kq_format(qtype, (32, 896)) == (TID[qtype], 32, TID[qtype], False)
        assert kq_format(qtype, (37, 896)) is None  # rows not whole tiles: the groups-of-32 code
    assert kq_format("Q5_1", (32, 896)) is None
    monkeypatch.setenv("DRAFTWISE_EXACT_ACTIVATIONS", "1")  # fp32 activations: the groups-of-32 code
    assert kq_format("Q8_0", (32, 896)) is None
    assert repack(random_blocks("Q8_0", 32, 64, 1), "Q8_0", (32, 64)).bits == 8


def _block_gguf(tmp_path, monkeypatch, qtypes):
    """A tiny Qwen2 model (hidden 96: blocks of 32, no super-block of 256) with block-format matrices."""
    from draftwise.models import loading
    from draftwise.models.transformer import random_model
    from tests.test_models import _copy_tokenizer, _write_gguf

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    cfg = TINY_QWEN.__class__(**{**TINY_QWEN.to_dict(), "hidden_size": 96, "head_dim": 24, "num_heads": 4,
                                 "num_kv_heads": 2, "intermediate_size": 160})
    m = random_model(cfg, seed=4)
    path = tmp_path / "kb.gguf"
    _write_gguf(path, m, "qwen2", qtypes)
    monkeypatch.setattr(loading, "_save_gguf_tokenizer", lambda p, dest: _copy_tokenizer(dest, cfg.vocab_size))
    return cfg, path


def test_a_block_format_model_loads_in_place_and_decodes_batch_invariantly(tmp_path, monkeypatch):
    from gguf import GGUFReader

    from draftwise.models import load_model
    from draftwise.models.loading import gguf_config
    from draftwise.models.transformer import from_state_dict
    from tests.conftest import reference_state_dict

    # per tensor in order: embedding, output norm (F32), output, then per layer q, k, v, o, gate, up, down
    cfg, path = _block_gguf(tmp_path, monkeypatch, ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q5_0"))
    lm = load_model(str(path), "gguf", progress=False)
    model = lm.model
    kinds = {m.bits for m in model.modules() if isinstance(m, QLinear)}
    assert kinds <= set(KQ_BITS) and {102, 103, 106, 108} <= kinds, kinds  # every matrix on the block rule
    ref = from_state_dict(gguf_config(GGUFReader(str(path))), reference_state_dict(GGUFReader(str(path))),
                          torch.float32)
    ids = torch.tensor([[3, 17, 42, 8, 91, 5, 60, 33]])
    got = model.forward(ids, model.new_cache(1, 64)).logits
    want = ref.forward(ids, ref.new_cache(1, 64)).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 5e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75
    for isa in available_isas():  # a chunk of 8 new tokens = 8 one-token forwards, on every path
        with using_isa(isa):
            cache = model.new_cache(1, 64)
            chunk = model.forward(ids, cache).logits
            cache.set_lengths(0)
            steps = torch.cat([model.forward(ids[:, t:t + 1], cache).logits for t in range(ids.shape[1])], 1)
            assert torch.equal(chunk, steps), isa
            assert torch.equal(chunk, got), isa
    kept = load_model(str(path), "gguf", progress=False, keep_converted=True)  # the code saved and mapped back
    again = load_model(str(path), "gguf", progress=False, keep_converted=True)
    for other in (kept, again):
        assert torch.equal(other.model.forward(ids, other.model.new_cache(1, 64)).logits, got)


@pytest.mark.parametrize("bits,tag", [(4, 103), (8, 108)])
def test_int4_and_int8_weights_run_on_the_block_rule(monkeypatch, bits, tag):
    """``--dtype int4 / int8`` (e.g. the default draft model) re-quantize to GGUF Q4_1 / Q8_0 blocks (gguf's own
    quantizer) in the x16 layout where the rule takes the matrix (5 / 8.5 bits a weight, one float step per
    block); other shapes, and fp32 activations, keep the groups-of-32 code."""
    from draftwise.models.loading import quantize_linears

    g = torch.Generator().manual_seed(6)
    w = torch.randn(48, 96, generator=g)
    sd = {"model.layers.0.mlp.down_proj.weight": w, "model.layers.0.mlp.up_proj.weight": torch.randn(37, 96, generator=g)}
    out = quantize_linears(sd, bits)
    key = "model.layers.0.mlp.down_proj.weight"
    assert out[key + ".qmeta"].tolist() == [32, tag]
    assert out[key + ".q"].shape == (3, 3 * KQ_BITS[tag]) and out[key + ".scale"].shape == (48, 0)
    assert out["model.layers.0.mlp.up_proj.weight.qmeta"].tolist() == [32, bits]  # 37 rows: not whole tiles
    W = dequantize(out[key + ".q"], out[key + ".scale"], None, 32, tag)
    step = (w.view(48, 3, 32).amax(-1) - w.view(48, 3, 32).amin(-1)) / (15 if bits == 4 else 127)
    assert ((W - w).abs().view(48, 3, 32).amax(-1) <= step * 0.51 + 1e-3).all()  # round to nearest
    lin = QLinear(out[key + ".q"], out[key + ".scale"], None, 32, tag)
    x = torch.randn(5, 96, generator=g)
    y = reference_product(x, W)
    assert ((lin(x).double() - y).abs().max() / y.abs().max()).item() < 1e-5
    monkeypatch.setenv("DRAFTWISE_EXACT_ACTIVATIONS", "1")
    assert quantize_linears(sd, bits)[key + ".qmeta"].tolist() == [32, bits]


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_tied_embedding_is_quantized_as_the_head_it_is(tmp_path, weights):
    """With no ``lm_head.weight`` the embedding table is the output head, read whole for every token: int4 / int8
    quantize it like any head (kept fp32, SmolLM2-135M's head was 12 ms of a 16 ms token) and the input
    embedding reads its rows from that very code; an untied table stays as it was."""
    from draftwise.models import load_model
    from draftwise.models.loading import quantize_linears
    from draftwise.models.transformer import QEmbedding
    from tests.conftest import make_hf_folder

    g = torch.Generator().manual_seed(7)
    table, head = torch.randn(64, 96, generator=g), torch.randn(64, 96, generator=g)
    bits = 8 if weights == "int8" else 4
    assert "model.embed_tokens.weight.q" in quantize_linears({"model.embed_tokens.weight": table}, bits)
    untied = quantize_linears({"model.embed_tokens.weight": table, "lm_head.weight": head}, bits)
    assert torch.equal(untied["model.embed_tokens.weight"], table) and "lm_head.weight.q" in untied

    folder = make_hf_folder(tmp_path / "tied", tied=True, hidden_size=64)  # rows of whole blocks of 32
    dense = load_model(str(folder), "fp32", progress=False).model
    m = load_model(str(folder), weights, progress=False).model
    assert isinstance(m.lm_head, QLinear) and isinstance(m.embed, QEmbedding)
    assert m.embed.q.data_ptr() == m.lm_head.q.data_ptr()  # one code, shared
    ids = torch.arange(m.config.vocab_size)
    W = dequantize(m.lm_head.q, m.lm_head.scale, m.lm_head.minv if m.lm_head.minv.numel() else None, m.lm_head.group,
                   m.lm_head.bits)
    assert torch.equal(m.embed(ids), W)  # the rows the head multiplies by
    err = (W - dense.embed.weight).abs().max() / dense.embed.weight.abs().max()
    assert 0 < err < (0.01 if bits == 8 else 0.1)
    prompt = torch.tensor([[5, 17, 42, 99, 3]])
    want = dense.forward(prompt, dense.new_cache(1, 16)).logits
    got = m.forward(prompt, m.new_cache(1, 16)).logits
    assert torch.corrcoef(torch.stack([want.flatten(), got.flatten()]))[0, 1] > (0.99 if bits == 8 else 0.9)
