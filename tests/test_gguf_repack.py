"""The kernel's C++ GGUF re-packer (csrc/gguf/repack.h) against the numpy reference (kernels/gguf_quant.parse):
the same bytes for every block format, on random blocks and row ranges split over threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.kernels import extension
from draftwise.kernels.gguf_quant import parse, repack

# (type, bytes per block, values per block, byte offsets of fp16 fields)
FORMATS = [("Q4_0", 18, 32, (0,)), ("Q4_1", 20, 32, (0, 2)), ("Q5_0", 22, 32, (0,)), ("Q8_0", 34, 32, (0,)),
           ("Q4_K", 144, 256, (0, 2)), ("Q5_K", 176, 256, (0, 2)), ("Q6_K", 210, 256, (208,))]


def _blocks(qtype, bs, nv, halves, N, K, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(N * (K // nv), bs), dtype=np.uint8)
    for off in halves:  # finite scales, incl. subnormal and negative ones
        h = (rng.standard_normal(raw.shape[0]) * 0.02).astype(np.float16)
        h[::7] = np.float16(3e-6)  # a subnormal fp16
        raw[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw.reshape(N, -1)


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


@pytest.mark.parametrize("qtype,bs,nv,halves", FORMATS)
def test_repack_equals_the_reference(qtype, bs, nv, halves):
    if extension() is None:
        pytest.skip("the kernel is not built here: repack is parse")
    assert extension().repack_format(__import__("gguf").GGMLQuantizationType[qtype].value) is not None
    N, K = 37, 2 * 256  # rows not a multiple of the chunk grain
    raw = _blocks(qtype, bs, nv, halves, N, K, seed=len(qtype) + bs)
    ref, got = parse(raw, qtype, (N, K)), repack(raw, qtype, (N, K))
    assert (got.group, got.bits) == (ref.group, ref.bits)
    for a, b in ((ref.q, got.q), (ref.scale, got.scale), (ref.minv, got.minv)):
        if a is None:
            assert b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b)), qtype
    # into rows of a larger matrix (a fused projection), leaving the other rows alone
    big = type(got)(torch.zeros(N + 5, got.q.shape[1], dtype=got.q.dtype), torch.zeros(N + 5, got.scale.shape[1]),
                    None if got.minv is None else torch.zeros(N + 5, got.scale.shape[1]), got.group, got.bits)
    view = type(got)(big.q[3:3 + N], big.scale[3:3 + N], None if big.minv is None else big.minv[3:3 + N],
                     got.group, got.bits)
    repack(raw, qtype, (N, K), out=view)
    assert torch.equal(_bits(big.q[3:3 + N]), _bits(ref.q)) and not big.q[:3].any() and not big.q[3 + N:].any()
    assert torch.equal(_bits(big.scale[3:3 + N]), _bits(ref.scale))


def test_repack_rejects_wrong_sizes():
    ext = extension()
    if ext is None:
        pytest.skip("the kernel is not built here")
    src = torch.zeros(2 * 18, dtype=torch.uint8)
    q, s, m = torch.empty(2, 16, dtype=torch.uint8), torch.empty(2, 1), torch.empty(2, 1)
    ext.repack_gguf(src, 2, 2, 32, q, s, m)  # Q4_0, (2, 32): fine
    with pytest.raises(RuntimeError, match="src size"):
        ext.repack_gguf(src[:-1], 2, 2, 32, q, s, m)
    with pytest.raises(RuntimeError, match="not re-packed"):
        ext.repack_gguf(src, 1, 2, 32, q, s, m)  # F16
    with pytest.raises(RuntimeError, match="minv size"):
        ext.repack_gguf(torch.zeros(34 * 2, dtype=torch.uint8), 8, 2, 32, torch.empty(2, 32, dtype=torch.int8), s, m)
