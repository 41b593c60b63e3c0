"""The K-quant rule (csrc/core/kquant.h): Q4_K / Q6_K weights computed from the GGUF's own integers, 16 columns
interleaved per tile (the product and partial-tile tests cover its block formats too; their own: test_kblock.py). The layout de-quantizes to exactly the numpy reference's weights (kernels/gguf_quant
.parse); the product matches a float64 reference of the same rounding; every path and every row count
computes the same bits; models made of such matrices load in place, fused, and decode batch-invariantly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import draftwise.kernels as K_
from draftwise.kernels import KQ_BITS, QLinear, available_isas, dequantize, extension, quantize_activations, using_isa
from draftwise.kernels.gguf_quant import kq_format, parse, repack
from tests.conftest import TINY, TINY_QWEN

pytestmark = pytest.mark.skipif(extension() is None, reason="the kernel is not built here")

# every GGML type the rule computes: values and bytes per block, offsets of its fp16 scales (the block formats'
# own tests: test_kblock.py)
BLOCK = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)), "Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)),
         "Q5_0": (32, 22, (0,)), "Q8_0": (32, 34, (0,))}
TID = {"Q4_K": 12, "Q6_K": 14, "Q4_0": 102, "Q4_1": 103, "Q5_0": 106, "Q8_0": 108}


def random_blocks(qtype: str, N: int, K: int, seed: int) -> np.ndarray:
    """(N, K / block values * block bytes) random GGUF blocks with finite fp16 scales (incl. subnormal, negative)."""
    values, bs, halves = BLOCK[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(N * (K // values), bs), dtype=np.uint8)
    for off in halves:
        h = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
        h[::7] = np.float16(3e-6)
        raw[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw.reshape(N, -1)


def quantize_k(w: np.ndarray, qtype: str) -> np.ndarray:
    """Round-to-nearest Q4_K / Q6_K blocks of (N, K) float weights, in GGUF's byte layout (the gguf package
    quantizes neither): enough to write test models that llama.cpp would read."""
    N, K = w.shape
    sb = w.astype(np.float32).reshape(-1, 256)  # (n, 256) super-blocks
    n = sb.shape[0]
    if qtype == "Q4_K":
        sub = sb.reshape(n, 8, 32)
        lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
        scale, mins = (hi - lo) / 15, -lo  # (n, 8)
        d = np.maximum(scale.max(-1), 1e-8) / 63
        dmin = np.maximum(mins.max(-1), 1e-8) / 63
        d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
        sc = np.clip(np.round(scale / d16.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
        mq = np.clip(np.round(mins / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
        eff_s = d16.astype(np.float32)[:, None] * sc
        eff_m = dmin16.astype(np.float32)[:, None] * mq
        q = np.clip(np.round((sub + eff_m[..., None]) / eff_s[..., None]), 0, 15).astype(np.uint8)  # (n, 8, 32)
        s = np.zeros((n, 12), np.uint8)
        s[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
        s[:, 4:8] = (mq[:, 0:4] & 63) | ((mq[:, 4:8] >> 4) << 6)
        s[:, 8:12] = (sc[:, 4:8] & 15) | ((mq[:, 4:8] & 15) << 4)
        qs = q.reshape(n, 4, 2, 32)
        qs = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(n, 128)
        out = np.concatenate([d16.view(np.uint8).reshape(n, 2), dmin16.view(np.uint8).reshape(n, 2), s, qs], 1)
    else:
        sub = sb.reshape(n, 16, 16)
        amax = np.abs(sub).max(-1)  # (n, 16)
        s = amax / 31
        d = np.maximum(s.max(-1), 1e-8) / 127
        d16 = d.astype(np.float16)
        sc = np.clip(np.round(s / d16.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
        eff = d16.astype(np.float32)[:, None] * sc
        u = (np.clip(np.round(sub / eff[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
        ql = np.concatenate([(u[:, :, 0] & 15) | ((u[:, :, 2] & 15) << 4), (u[:, :, 1] & 15) | ((u[:, :, 3] & 15) << 4)],
                            axis=2).reshape(n, 128)
        qh = ((u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4) | ((u[:, :, 3] >> 4) << 6)).reshape(n, 64)
        out = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8).reshape(n, 2)], 1)
    return np.ascontiguousarray(out).reshape(N, -1)


def quantize_like_the_rule(x: torch.Tensor) -> torch.Tensor:
    """The values the rule multiplies by (kquant.h ACTIVATIONS), in float64: per row and super-block of 256
    one scale amax / 127, each block of 32 refined by 2^s (s in 0..3, the most with max|block| * 2^s <= amax);
    codes round_even(x * float32(float32(127 / amax) * 2^s)), computed in float32 as the kernel does."""
    M, K = x.shape
    b = x.float().view(M, K // 256, 8, 32)
    amax = b.abs().amax((-1, -2), keepdim=True)  # (M, K/256, 1, 1) float32
    a = b.abs().amax(-1, keepdim=True)  # (M, K/256, 8, 1)
    s = torch.zeros_like(a)
    for k in (1, 2, 3):
        s = torch.where(a * 2.0 ** k <= amax, torch.full_like(a, k), s)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))  # float32, as the kernel
    q = torch.round(b * (inv * 2.0 ** s))  # one float32 rounding of the product, then to nearest even
    assert q.abs().max() <= 127
    return (q.double() * (amax / 127.0).double() / 2.0 ** s.double()).view(M, K)


def reference_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T in float64 with x rounded exactly as the rule rounds it (``quantize_like_the_rule``)."""
    return quantize_like_the_rule(x) @ w.double().t()


def block_reference_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same for the block formats: x rounded per row and block of 32, round(x * 127 / amax) times
    amax / 127 (``quantize_activations``)."""
    return quantize_activations(x).double() @ w.double().t()


def reference_for(qtype: str):
    return reference_product if BLOCK[qtype][0] == 256 else block_reference_product


def refined_rows(K: int, seed: int = 1) -> torch.Tensor:
    """Rows whose blocks of 32 the rule refines: blocks at 2^-j, and an outlier in a block of ordinary values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, K, generator=g)
    x[0] *= 2.0 ** -(torch.arange(K) // 32 % 6).float()  # shifts 3, 2, 1, 0, 0, 0 ...
    x[1, 17::256] = 60.0  # an outlier per super-block: its other 7 blocks get 3 more bits
    x[2, ::256] = 1e-3  # tiny blocks beside ordinary ones
    x[2, :32] *= 1e-3
    return x


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("N", [32, 48])
def test_layout_dequantizes_to_the_reference_weights(qtype, N):
    K = 512
    raw = random_blocks(qtype, N, K, seed=N + len(qtype))
    code = repack(raw, qtype, (N, K))
    assert code.bits == TID[qtype] and code.q.shape == (N // 16, K // 256 * KQ_BITS[code.bits])
    ref = parse(raw, qtype, (N, K))
    want = dequantize(ref.q, ref.scale, ref.minv, ref.group, ref.bits)
    got = dequantize(code.q, code.scale, None, code.group, code.bits)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    idx = torch.tensor([N - 1, 0, 5, 5])
    rows = extension().kq_rows(code.q.view(-1), code.bits, N, K, idx)
    assert torch.equal(rows, want[idx])
    with pytest.raises(RuntimeError, match="out of range"):
        extension().kq_rows(code.q.view(-1), code.bits, N, K, torch.tensor([N]))


@pytest.mark.parametrize("qtype", list(BLOCK))
def test_product_matches_float64_and_every_path_and_row_count_gives_the_same_bits(qtype):
    N, K = 80, 768 if BLOCK[qtype][0] == 256 else 896  # the block formats: Qwen2.5-0.5B's K, not a multiple of 256
    raw = random_blocks(qtype, N, K, seed=3)
    code = repack(raw, qtype, (N, K))
    w = code.q.view(-1)
    W = dequantize(code.q, code.scale, None, code.group, code.bits)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, K, generator=g) * 2
    x[0, :256] = 0  # an all-zero activation block
    x[1, 300] = 1e4  # a block with one huge value
    x[2:5] = refined_rows(K)  # blocks of 32 the rule refines by powers of two
    ext = extension()
    with using_isa("scalar"):
        ref = ext.qmm_kq(x, w, code.bits, N)
    y = reference_for(qtype)(x, W)
    assert ((ref.double() - y).abs().max() / y.abs().max()).item() < 1e-5
    for isa in available_isas():
        with using_isa(isa):
            for M in (1, 2, 3, 5, 8, 13, 33):
                assert torch.equal(ext.qmm_kq(x[:M].contiguous(), w, code.bits, N), ref[:M]), (isa, M)
            assert torch.equal(ext.qmm_kq(x[7:8].contiguous(), w, code.bits, N), ref[7:8]), isa  # a row alone


def test_a_call_scratch_larger_than_the_kept_buffer_and_the_calls_after_it():
    """A call's scratch (ops.cpp kq_call) comes from a buffer kept per thread up to 16 MB, not zero-filled: a
    call past that (its own buffer), then smaller and growing calls reusing the kept one, give the bits of the
    same rows computed in calls of 64."""
    N, K = 16, 8192
    code = repack(random_blocks("Q4_K", N, K, seed=9), "Q4_K", (N, K))
    w = code.q.view(-1)
    x = torch.randn(2100, K, generator=torch.Generator().manual_seed(4))  # 17.2 MB of activation codes
    ext = extension()
    ref = torch.cat([ext.qmm_kq(x[i:i + 64].contiguous(), w, code.bits, N) for i in range(0, 2100, 64)])
    assert torch.equal(ext.qmm_kq(x, w, code.bits, N), ref)
    for M in (3, 700, 5, 1200):  # the kept buffer grown, then reused for fewer rows
        assert torch.equal(ext.qmm_kq(x[-M:].contiguous(), w, code.bits, N), ref[-M:]), M


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_refined_blocks_bring_the_product_closer_to_exact(qtype):
    """Where a super-block's blocks of 32 differ in size (outlier channels), the power-of-two refinement keeps
    their precision: with an outlier per super-block the kernel's product is over 2x closer to the
    unquantized one than with one scale per 256 (llama.cpp's Q8_K); always equal to the rule's float64
    reference."""
    N, K = 48, 768
    raw = random_blocks(qtype, N, K, seed=5)
    code = repack(raw, qtype, (N, K))
    W = dequantize(code.q, code.scale, None, code.group, code.bits).double()
    x = refined_rows(K)
    got = extension().qmm_kq(x, code.q.view(-1), code.bits, N).double()
    exact = x.double() @ W.t()
    b = x.float().view(3, K // 256, 256)
    amax = b.abs().amax(-1, keepdim=True)
    one_scale = (torch.round(b * (127.0 / amax)).double() * (amax / 127.0).double()).view(3, K) @ W.t()
    assert (got - reference_product(x, W)).abs().max() / exact.abs().max() < 1e-5
    err, err1 = (got[1] - exact[1]).norm(), (one_scale[1] - exact[1]).norm()  # the row with outliers
    assert err < err1 / 2, (err.item(), err1.item())  # ~sqrt(1/8 + 7/8/64): the outliers' own blocks stay coarse


@pytest.mark.parametrize("qtype", list(BLOCK))
def test_a_partial_last_tile(qtype):
    """N not a multiple of 16: the kernel pads the last tile with zero columns and writes only real ones."""
    N, K = 37, 256
    raw = torch.from_numpy(random_blocks(qtype, N, K, seed=11).reshape(-1).copy())
    ext = extension()
    w = ext.kq_pack(raw, TID[qtype], N, K, torch.empty(0, dtype=torch.uint8))
    assert w.numel() == 3 * K // BLOCK[qtype][0] * KQ_BITS[TID[qtype]]  # 3 tiles
    ref = parse(raw.numpy().reshape(N, -1), qtype, (N, K))
    W = dequantize(ref.q, ref.scale, ref.minv, ref.group, ref.bits)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2))
    outs = []
    for isa in available_isas():
        with using_isa(isa):
            outs.append(ext.qmm_kq(x, w, TID[qtype], N))
    assert all(torch.equal(o, outs[0]) for o in outs) and outs[0].shape == (5, N)
    y = reference_for(qtype)(x, W)
    assert ((outs[0].double() - y).abs().max() / y.abs().max()).item() < 1e-5


@pytest.mark.parametrize("fmt,block", [(12, 256), (108, 32)])  # Q4_K, Q8_0 (a block format)
def test_bad_calls_are_refused(fmt, block):
    ext = extension()
    w = torch.zeros(KQ_BITS[fmt], dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"multiple of {block}"):
        ext.qmm_kq(torch.zeros(1, block * 3 // 2), w, fmt, 16)
    with pytest.raises(RuntimeError, match="does not hold"):
        ext.qmm_kq(torch.zeros(1, block), w, fmt, 32)
    with pytest.raises(RuntimeError, match="format"):
        ext.qmm_kq(torch.zeros(1, block), w, fmt - 1, 16)
    with pytest.raises(RuntimeError, match="src size"):
        ext.kq_pack(torch.zeros(1, dtype=torch.uint8), fmt, 1, block, torch.empty(0, dtype=torch.uint8))


def test_which_tensors_take_the_rule(monkeypatch):
    assert kq_format("Q4_K", (32, 512)) == (12, 256, 12, False)
    assert kq_format("Q6_K", (48, 256)) == (14, 256, 14, False)
    assert kq_format("Q4_K", (37, 512)) is None  # rows not whole tiles: the groups-of-32 code
    assert kq_format("Q5_K", (32, 512)) is None and kq_format("Q8_0", (32, 512)) == (108, 32, 108, False)
    monkeypatch.setenv("DRAFTWISE_EXACT_ACTIVATIONS", "1")  # fp32 activations: the groups-of-32 code
    assert kq_format("Q4_K", (32, 512)) is None
    assert repack(random_blocks("Q4_K", 32, 256, 1), "Q4_K", (32, 256)).bits == 4


def test_qlinear_with_bias_on_every_kind_of_call():
    from draftwise.kernels import bulk, fp32_gemm
    from draftwise.kernels.gguf_quant import QCode

    N, K = 48, 512
    code = repack(random_blocks("Q4_K", N, K, 5), "Q4_K", (N, K))
    assert isinstance(code, QCode)
    g = torch.Generator().manual_seed(1)
    b = torch.randn(N, generator=g)
    lin = QLinear(code.q, code.scale, None, code.group, code.bits, b)
    assert (lin.in_features, lin.out_features) == (K, N) and "Q4_K" in repr(lin)
    x = torch.randn(70, K, generator=g)  # more rows than BULK_MIN_ROWS
    y = lin(x)
    W = dequantize(code.q, code.scale, None, code.group, code.bits)
    ref = (reference_product(x, W) + b.double())
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    with fp32_gemm(), bulk():  # prompts and feature generation run on the rule too (no de-quantized GEMM)
        assert torch.equal(lin(x), y)


def _kq_gguf(tmp_path, monkeypatch, arch: str):
    """A tiny model whose matrices are Q4_K and Q6_K (hidden 256: whole super-blocks), read in place."""
    import gguf.quants

    from tests.test_models import _copy_tokenizer, _write_gguf
    from draftwise.models import loading
    from draftwise.models.transformer import random_model

    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    base = TINY_QWEN if arch == "qwen2" else TINY
    cfg = base.__class__(**{**base.to_dict(), "hidden_size": 256, "head_dim": 64, "intermediate_size": 512})
    m = random_model(cfg, seed=4)
    real = gguf.quants.quantize

    def quantize(arr, qt):
        name = gguf.GGMLQuantizationType(qt).name
        return quantize_k(arr, name) if name in ("Q4_K", "Q6_K") else real(arr, qt)

    monkeypatch.setattr(gguf.quants, "quantize", quantize)
    path = tmp_path / "kq.gguf"
    # per tensor in order: embedding, output norm (F32), output, then per layer q, k, v, o, gate, up, down
    _write_gguf(path, m, arch, ("Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K"))
    monkeypatch.setattr(gguf.quants, "quantize", real)
    monkeypatch.setattr(loading, "_save_gguf_tokenizer", lambda p, dest: _copy_tokenizer(dest, cfg.vocab_size))
    return cfg, path


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_k_quant_model_loads_in_place_and_decodes_batch_invariantly(tmp_path, monkeypatch, arch):
    from gguf import GGUFReader

    from draftwise.models import load_model
    from draftwise.models.loading import gguf_config
    from draftwise.models.transformer import from_state_dict
    from tests.conftest import reference_state_dict

    cfg, path = _kq_gguf(tmp_path, monkeypatch, arch)
    lm = load_model(str(path), "gguf", progress=False)
    model = lm.model
    kinds = {m.bits for m in model.modules() if isinstance(m, QLinear)}
    assert kinds <= set(KQ_BITS) and kinds, kinds  # every matrix on the K-quant rule
    # against the model built from the unfused tensors by the numpy reference (groups of 32, other rounding)
    ref = from_state_dict(gguf_config(GGUFReader(str(path))), reference_state_dict(GGUFReader(str(path))),
                          torch.float32)
    ids = torch.tensor([[3, 17, 42, 8, 91, 5, 60, 33]])
    c1, c2 = model.new_cache(1, 64), ref.new_cache(1, 64)
    got, want = model.forward(ids, c1).logits, ref.forward(ids, c2).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 5e-2  # int8 activations per 256 vs per 32
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75
    # a chunk of 8 new tokens gives the same bits as 8 one-token forwards, on every path
    for isa in available_isas():
        with using_isa(isa):
            cache = model.new_cache(1, 64)
            chunk = model.forward(ids, cache).logits
            cache.set_lengths(0)
            steps = torch.cat([model.forward(ids[:, t:t + 1], cache).logits for t in range(ids.shape[1])], 1)
            assert torch.equal(chunk, steps), isa
            assert torch.equal(chunk, got), isa


def test_a_kept_converted_copy_holds_the_k_quant_code(tmp_path, monkeypatch):
    """keep_converted: the x16 code is saved once (safetensors, fused) and memory-mapped by later loads."""
    from draftwise.models import load_model
    from draftwise.models.loading import converted_dir

    cfg, path = _kq_gguf(tmp_path, monkeypatch, "qwen2")
    fresh = load_model(str(path), "gguf", progress=False)
    kept = load_model(str(path), "gguf", progress=False, keep_converted=True)
    assert list(converted_dir(path).glob("model-gguf.safetensors"))
    again = load_model(str(path), "gguf", progress=False, keep_converted=True)  # mapped
    ids = torch.tensor([[5, 9, 77, 3]])
    logits = [m.model.forward(ids, m.model.new_cache(1, 16)).logits for m in (fresh, kept, again)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    assert {m.bits for m in again.model.modules() if isinstance(m, QLinear)} <= set(KQ_BITS)


@pytest.mark.parametrize("qtype", list(BLOCK))
def test_prefetch_level_changes_no_bit(qtype):
    """Prefetching a format's codes into L2 instead of L1 (kernels._tune_prefetch) moves speed only: every
    path and row count (one pass, several passes over a tile) gives the same bits either way."""
    N, K = 48, 512
    raw = torch.from_numpy(random_blocks(qtype, N, K, seed=5).reshape(-1).copy())
    ext, fmt = extension(), TID[qtype]
    w = ext.kq_pack(raw, fmt, N, K, torch.empty(0, dtype=torch.uint8))
    before = ext.kq_prefetch_l2(fmt)
    try:
        for rows in (1, 3, 9, 17):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
            outs = []
            for l2 in (False, True):
                ext.set_kq_prefetch_l2(fmt, l2)
                assert ext.kq_prefetch_l2(fmt) is l2
                for isa in available_isas():
                    with using_isa(isa):
                        outs.append(ext.qmm_kq(x, w, fmt, N))
            assert all(torch.equal(o, outs[0]) for o in outs), rows
    finally:
        ext.set_kq_prefetch_l2(fmt, before)
    with pytest.raises(RuntimeError, match="format"):
        ext.set_kq_prefetch_l2(13, True)


def test_prefetch_tuning_takes_l2_only_where_measured_faster(tmp_path, monkeypatch):
    """_tune_prefetch: a format prefetches into L2 only when that timed PREFETCH_MARGIN faster; the verdict
    is cached per build and CPU and applied from the cache by the next process (no timing then)."""
    import draftwise.kernels as K

    ext = extension()
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    # Q4_K 5 % faster into L2: not enough; Q6_K and Q8_0 clearly; Q4_1 slower; the rest alike
    l2 = {12: 0.95, 14: 0.8, 102: 1.0, 103: 1.1, 106: 0.99, 108: 0.85}
    calls = []

    def fake(ext_, fmt):
        calls.append(fmt)
        return {"l1": 1.0, "l2": l2[fmt]}

    monkeypatch.setattr(K, "_time_prefetch", fake)
    before = {f: ext.kq_prefetch_l2(f) for f in l2}
    try:
        K._tune_prefetch(ext)
        assert {f for f in l2 if ext.kq_prefetch_l2(f)} == {14, 108} and sorted(calls) == sorted(l2)
        assert K.kernel_info()["prefetch_l2"] == ["Q6_K", "Q8_0"]
        ext.set_kq_prefetch_l2(14, False)
        K._tune_prefetch(ext)  # from the cache
        assert ext.kq_prefetch_l2(14) is True and len(calls) == len(l2)
    finally:
        for f, v in before.items():
            ext.set_kq_prefetch_l2(f, v)


@pytest.mark.parametrize("K", [768, 4352])  # rows of both shape classes (kquant.h kKq6LongK: 4096)
def test_q6k_loop_changes_no_bit(K):
    """Q6_K's two loops for calls of several rows (kernels._tune_kq6: the many-rows one, or the few-rows one in
    passes of 4), and any mix of them over the call shapes, give the same bits on every path and at every row count,
    one pass or several, and a partial tile."""
    N = 40
    raw = torch.from_numpy(random_blocks("Q6_K", N, K, seed=11).reshape(-1).copy())
    ext = extension()
    w = ext.kq_pack(raw, 14, N, K, torch.empty(0, dtype=torch.uint8))
    before = ext.kq6_many_mask()
    try:
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17):
            x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))  # (rows, K)
            outs = []
            for mask in (K_.KQ6_ALL_MANY, 0, 0b010101, 0b101010):
                ext.set_kq6_many_mask(mask)
                assert ext.kq6_many_mask() == mask and ext.kq6_many() is (mask == K_.KQ6_ALL_MANY)
                for isa in available_isas():
                    with using_isa(isa):
                        outs.append(ext.qmm_kq(x, w, 14, N))
            assert all(torch.equal(o, outs[0]) for o in outs), rows
            assert torch.equal(ext.qmm_kq(x[-1:], w, 14, N), outs[0][-1:])  # a row alone: the same bits
    finally:
        ext.set_kq6_many_mask(before)


def test_q6k_loop_mask_is_checked():
    ext = extension()
    before = ext.kq6_many_mask()
    try:
        for bad in (-1, K_.KQ6_ALL_MANY + 1):
            with pytest.raises(RuntimeError, match="mask of 6 bits"):
                ext.set_kq6_many_mask(bad)
        ext.set_kq6_many(False)
        assert ext.kq6_many_mask() == 0 and K_.kernel_info()["q6k_loop"] == "few-rows"
        ext.set_kq6_many(True)
        assert ext.kq6_many_mask() == K_.KQ6_ALL_MANY and K_.kernel_info()["q6k_loop"] == "many-rows"
    finally:
        ext.set_kq6_many_mask(before)


def test_q6k_loop_tuning_takes_few_rows_only_where_measured_faster(tmp_path, monkeypatch):
    """_tune_kq6: the few-rows loop only for the call shapes where it timed KQ6_MARGIN faster (each shape of
    KQ6_SHAPES timed; the long rows as a model's matrices of 1536 outputs); the verdict cached per build and CPU,
    applied from the cache by the next process (no timing then), and shown by kernel_info."""
    import draftwise.kernels as K

    ext = extension()
    before = ext.kq6_many_mask()
    calls = []
    few = {"t": 0.97, "faster": set()}  # the few-rows loop's time against 1.0; the shapes where it is 0.8

    def fake(ext_, fmt, rows, choices, K=1536, N=None, matrix=None):
        assert matrix is not None and matrix[2] == K  # each K's matrix packed once, by _tune_kq6
        calls.append((fmt, rows, K, N, sorted(choices)))
        for choose in choices.values():  # the choices set the kernel's loop
            choose()
        return {"many": 1.0, "few": 0.8 if (rows, K) in few["faster"] else few["t"]}

    monkeypatch.setattr(K, "_time_choices", fake)
    try:
        monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "a"))
        K._tune_kq6(ext)  # 3 % faster: not enough
        assert ext.kq6_many() is True and ext.kq6_many_mask() == K.KQ6_ALL_MANY
        assert calls == [(14, r, k, None if k <= K.KQ6_LONG_K else 1536, ["few", "many"])
                         for r, k in sorted(K.KQ6_SHAPES, key=lambda shape: shape[1])]  # grouped by K, each once
        few["t"] = 0.8
        monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "b"))
        K._tune_kq6(ext)
        assert ext.kq6_many_mask() == 0 and len(calls) == 12
        assert K.kernel_info()["q6k_loop"] == "few-rows"
        ext.set_kq6_many(True)
        K._tune_kq6(ext)  # from the cache
        assert ext.kq6_many_mask() == 0 and len(calls) == 12
        few["t"], few["faster"] = 1.0, {(6, 1536), (8, 1536)}  # as AMD Zen 5: the head's shape up to 8 rows
        monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "c"))
        K._tune_kq6(ext)
        assert ext.kq6_many_mask() == 0b111010
        assert K.kernel_info()["q6k_loop"] == "few-rows at <=6 rows, K<=4096; 7-8 rows, K<=4096, many-rows elsewhere"
    finally:
        ext.set_kq6_many_mask(before)


def test_time_choices_times_each_choice_from_memory():
    """The timing itself on a small last-level cache (quick calls): each choice set and timed; with N, the matrix
    as matrices of N outputs, each called in turn."""
    import draftwise.kernels as K

    ext = extension()
    before = ext.kq6_many_mask()
    seen = []
    try:
        got = K._time_choices(ext, 14, 8, {"many": lambda: seen.append(True) or ext.set_kq6_many(True),
                                           "few": lambda: seen.append(False) or ext.set_kq6_many(False)})
        split = K._time_choices(ext, 14, 2, {"one": lambda: None}, 8960, 1536)
    finally:
        ext.set_kq6_many_mask(before)
    assert set(got) == {"many", "few"} and all(0 < t < 10 for t in got.values())
    assert seen[:4] == [True, False, True, False] and len(seen) == 12
    assert set(split) == {"one"} and 0 < split["one"] < 10


def test_time_prefetch_measures_both_levels_and_restores():
    """The timing itself on a small last-level cache (a quick call): both levels timed, the setting restored."""
    import draftwise.kernels as K

    ext = extension()
    before = ext.kq_prefetch_l2(14)
    got = K._time_prefetch(ext, 14)
    assert set(got) == {"l1", "l2"} and all(0 < t < 10 for t in got.values())
    assert ext.kq_prefetch_l2(14) is before
