"""The int8/int4 weight-only kernel and the exact GGUF block decoding feeding it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.kernels import QLinear, dequantize, extension, quantize_activations, quantize_rtn
from draftwise.kernels.gguf_quant import parse

CASES = [(8, 16), (8, 32), (4, 32)]


@pytest.mark.parametrize("bits,group", CASES)
@pytest.mark.parametrize("with_min", [False, True])
@pytest.mark.parametrize("act_bits", [32, 8])
def test_kernel_matches_dequantized_matmul(bits, group, with_min, act_bits):
    g = torch.Generator().manual_seed(bits * 100 + group)
    w = torch.randn(72, 256, generator=g)
    q, scale, minv = quantize_rtn(w, bits, group)
    if with_min and minv is None:
        minv = torch.randn(scale.shape, generator=g) * 0.01
    if not with_min:
        minv = None
    lin = QLinear(q, scale, minv, group, bits, bias=torch.randn(72, generator=g))
    lin.act_bits = act_bits
    x = torch.randn(11, 256, generator=g)
    xr = quantize_activations(x) if act_bits == 8 else x  # int8 activations: the values the kernel multiplies
    ref = xr @ dequantize(q, scale, minv, group, bits).t() + lin.bias
    torch.testing.assert_close(lin(x), ref, atol=2e-4, rtol=2e-4)
    if act_bits == 8:  # and they are not the fp32 result (the int8 path really ran)
        assert not torch.allclose(lin(x), x @ dequantize(q, scale, minv, group, bits).t() + lin.bias, atol=1e-3)


@pytest.mark.parametrize("bits,group", CASES)
@pytest.mark.parametrize("act_bits", [32, 8])
def test_kernel_is_batch_invariant(bits, group, act_bits):
    """A row's result does not depend on how many rows share the call (incl. >8-row chunking)."""
    g = torch.Generator().manual_seed(7)
    lin = QLinear(*quantize_rtn(torch.randn(40, 128, generator=g), bits, group), group, bits)
    lin.act_bits = act_bits
    x = torch.randn(13, 128, generator=g)
    full = lin(x)
    for i in range(13):
        assert torch.equal(lin(x[i:i + 1]), full[i:i + 1])
    assert torch.equal(lin(x[3:9]), full[3:9])


def test_kernel_builds_here():
    assert extension() is not None, "the C++ kernel should compile on these machines"


def test_int4_rtn_error_is_small():
    w = torch.randn(64, 512)
    q, s, m = quantize_rtn(w, 4, 32)
    err = (dequantize(q, s, m, 32, 4) - w).abs().max() / w.abs().max()
    assert err < 0.1


def _random_blocks(qtype, n_blocks, block_bytes, d_offsets, rng):
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in d_offsets:  # fp16 scale fields: small finite values, not random NaN/inf bit patterns
        raw[:, off:off + 2] = np.frombuffer(
            rng.uniform(-0.05, 0.05, n_blocks).astype(np.float16).tobytes(), dtype=np.uint8).reshape(n_blocks, 2)
    return raw


@pytest.mark.parametrize("qtype,block_bytes,per_block,d_offsets", [
    ("Q4_0", 18, 32, [0]), ("Q4_1", 20, 32, [0, 2]), ("Q5_0", 22, 32, [0]), ("Q8_0", 34, 32, [0]),
    ("Q4_K", 144, 256, [0, 2]), ("Q5_K", 176, 256, [0, 2]), ("Q6_K", 210, 256, [208]),
])
def test_gguf_blocks_decode_exactly(qtype, block_bytes, per_block, d_offsets):
    """Our integer codes de-quantize to exactly what the gguf package de-quantizes (bit for bit)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(0)
    N, K = 6, 512
    raw = _random_blocks(qtype, N * K // per_block, block_bytes, d_offsets, rng).reshape(N, -1)
    ref = gguf_dequantize(raw, getattr(GGMLQuantizationType, qtype)).reshape(N, K)
    code = parse(raw, qtype, (N, K))
    mine = dequantize(code.q, code.scale, code.minv, code.group, code.bits).numpy()
    np.testing.assert_array_equal(mine, ref)


def test_unsupported_format_returns_none():
    assert parse(np.zeros((2, 8), dtype=np.uint8), "F16", (2, 4)) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_weights_through_kernel_are_exact_and_invariant(dtype):
    """Dense bf16/fp32 weights: fp32 accumulation of the exact weights, row-invariant (torch's own bf16
    matmul is not, for some shapes: K = 8960 on this CPU)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 8960, generator=g).to(dtype)
    lin = QLinear.dense(w, bias=torch.randn(48, generator=g))
    x = torch.randn(6, 8960, generator=g)
    full = lin(x)
    torch.testing.assert_close(full, x.double().matmul(w.double().t()).float() + lin.bias, atol=2e-3, rtol=1e-4)
    assert all(torch.equal(full[i:i + 1], lin(x[i:i + 1])) for i in range(6))


@pytest.mark.parametrize("K", [128, 384, 576])  # 128 | K: the shuffle-free int4 step; 576: the generic one
@pytest.mark.parametrize("act_bits", [32, 8])
def test_int4_paths_match_reference_and_are_invariant(K, act_bits):
    g = torch.Generator().manual_seed(K)
    lin = QLinear(*quantize_rtn(torch.randn(37, K, generator=g), 4, 32), 32, 4)
    lin.act_bits = act_bits
    x = torch.randn(10, K, generator=g)
    full = lin(x)
    xr = quantize_activations(x) if act_bits == 8 and K % 128 == 0 else x  # 576: no VNNI step, fp32
    ref = xr.double() @ dequantize(lin.q, lin.scale, lin.minv, 32, 4).double().t()
    torch.testing.assert_close(full.double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)
    assert all(torch.equal(lin(x[i:i + 1]), full[i:i + 1]) for i in range(10))
    assert torch.equal(lin(x[2:7]), full[2:7])


@pytest.mark.parametrize("act_bits", [32, 8])
def test_int4_without_min_offsets(act_bits):
    """Q4_0-style codes (scale only, no min): the +16·scale offset of the fp32 step alone, no offset at all
    on the int8 one."""
    g = torch.Generator().manual_seed(1)
    q, scale, _ = quantize_rtn(torch.randn(20, 256, generator=g), 4, 32)
    lin = QLinear(q, scale, None, 32, 4)
    lin.act_bits = act_bits
    x = torch.randn(3, 256, generator=g)
    xr = quantize_activations(x) if act_bits == 8 else x
    ref = xr.double() @ dequantize(q, scale, None, 32, 4).double().t()
    torch.testing.assert_close(lin(x).double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)


def test_int8_activations_edge_cases():
    """All-zero blocks (scale 0), a block with one huge value, and int8 codes at both ends of their range."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-128, 128, (24, 128), generator=g, dtype=torch.int8)
    q[0], q[1] = -128, 127
    scale, minv = torch.rand(24, 8, generator=g), torch.randn(24, 8, generator=g)
    lin = QLinear(q, scale, minv, 16, 8)
    lin.act_bits = 8
    x = torch.randn(4, 128, generator=g)
    x[0, :32] = 0.0
    x[1, 40] = 1e4
    ref = quantize_activations(x).double() @ dequantize(q, scale, minv, 16, 8).double().t()
    torch.testing.assert_close(lin(x).double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


def test_quantize_activations_error_is_bounded():
    x = torch.randn(5, 256)
    err = (quantize_activations(x) - x).abs().view(5, 8, 32)
    bound = x.abs().view(5, 8, 32).amax(-1, keepdim=True) / 254 * (1 + 1e-6)  # half a step of max|x| / 127
    assert (err <= bound).all()


@pytest.mark.parametrize("bits,group", CASES)
def test_bf16_dequantize_for_long_prefills_matches_reference(bits, group):
    """The C++ de-quantization the bulk (long prefill) path uses equals the torch reference, bit for bit."""
    g = torch.Generator().manual_seed(11)
    q, scale, minv = quantize_rtn(torch.randn(40, 256, generator=g), bits, group)
    minv = minv if minv is not None else torch.randn(scale.shape, generator=g) * 0.1
    ref = dequantize(q, scale, minv, group, bits).to(torch.bfloat16)
    assert torch.equal(extension().dequantize_bf16(q, scale, minv, group, bits), ref)
    assert torch.equal(extension().dequantize_bf16(q, scale, torch.empty(0), group, bits),
                       dequantize(q, scale, None, group, bits).to(torch.bfloat16))
