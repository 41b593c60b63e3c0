"""GGUF quantized tensors → the (q, scale, minv, group, bits) code of ``QLinear``, exactly.

``parse`` is the reference (numpy); ``repack`` computes the same bytes with the kernel's C++ re-packer
(csrc/gguf/repack.h) at every load, which lets the GGUF be the only copy of a model on disk.

Every supported GGML block format is an affine code per group of weights,
``w = scale * q - minv``, so its integers and scales are re-laid out, never re-quantized:

| GGML  | group | q range   | kernel |  | GGML | group | q range   | kernel |
|-------|-------|-----------|--------|--|------|-------|-----------|--------|
| Q4_0  | 32    | 0..15 (-8)| int4   |  | Q8_0 | 32    | -127..127 | int8   |
| Q4_1  | 32    | 0..15     | int4   |  | Q5_0 | 32    | -16..15   | int8   |
| Q4_K  | 32    | 0..15     | int4   |  | Q5_K | 32    | 0..31     | int8   |
|       |       |           |        |  | Q6_K | 16    | -32..31   | int8   |
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from . import KQ_BITS as KQ_TILE, KQ_BLOCK, pack4

QK_K = 256


@dataclass
class QCode:
    q: torch.Tensor  # (N, K) int8 or (N, K/2) uint8 (int4 packed)
    scale: torch.Tensor  # (N, K/G) float32
    minv: torch.Tensor | None  # (N, K/G) float32
    group: int
    bits: int


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12-byte packed 6-bit scales and mins of Q4_K / Q5_K super-blocks → (n, 8) each."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _low_high(qs: np.ndarray, width: int) -> np.ndarray:
    """(n, c*width) bytes → (n, c, 2, width) nibbles: per chunk, low nibbles then high nibbles."""
    n = qs.shape[0]
    b = qs.reshape(n, -1, 1, width)
    return (b >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)


def parse(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> QCode | None:
    """Decode raw GGUF block bytes (rows, bytes_per_row) of an (N, K) tensor. None = not a block format
    handled here (F32/F16/BF16 and others are de-quantized to dense instead)."""
    N, K = shape
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if qtype in ("Q4_0", "Q4_1"):
        bs = 18 if qtype == "Q4_0" else 20
        blk = raw.reshape(-1, bs)
        d = _f16(blk[:, 0:2])[:, 0]
        if qtype == "Q4_0":
            minv, qs = 8.0 * d, blk[:, 2:]
        else:
            minv, qs = -_f16(blk[:, 2:4])[:, 0], blk[:, 4:]
        # a block's 16 bytes already hold q[j] (low) and q[j+16] (high): the kernel's int4 layout
        return QCode(torch.from_numpy(qs.reshape(N, K // 2).copy()), torch.from_numpy(d.reshape(N, K // 32)),
                     torch.from_numpy(minv.reshape(N, K // 32).copy()), 32, 4)
    if qtype == "Q8_0":
        blk = raw.reshape(-1, 34)
        d = _f16(blk[:, 0:2])[:, 0]
        q = blk[:, 2:].view(np.int8)
        return QCode(torch.from_numpy(q.reshape(N, K).copy()), torch.from_numpy(d.reshape(N, K // 32)), None, 32, 8)
    if qtype == "Q5_0":
        blk = raw.reshape(-1, 22)
        d = _f16(blk[:, 0:2])[:, 0]
        qh = np.ascontiguousarray(blk[:, 2:6]).view(np.uint32).reshape(-1, 1)
        hi = ((qh >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1).astype(np.uint8)  # (n, 32)
        lo = _low_high(blk[:, 6:], 16).reshape(-1, 32)
        q = (lo | (hi << 4)).astype(np.int8) - np.int8(16)
        return QCode(torch.from_numpy(q.reshape(N, K)), torch.from_numpy(d.reshape(N, K // 32)), None, 32, 8)
    if qtype in ("Q4_K", "Q5_K"):
        bs = 144 if qtype == "Q4_K" else 176
        blk = raw.reshape(-1, bs)
        d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])  # (n, 1)
        sc, mn = _k_scale_min(blk[:, 4:16])
        scale, minv = d * sc, dmin * mn  # (n, 8): exact in fp32 (11-bit × 6-bit)
        if qtype == "Q4_K":
            q = _low_high(blk[:, 16:], 32).reshape(-1, 8, 32)  # sub-block 2c = low nibbles of chunk c
            qv = torch.from_numpy(q.reshape(N, K).copy())
            return QCode(pack4(qv), torch.from_numpy(scale.reshape(N, K // 32)),
                         torch.from_numpy(minv.reshape(N, K // 32)), 32, 4)
        qh = blk[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        ql = _low_high(blk[:, 48:], 32).reshape(-1, 8, 32)
        q = (ql | ((qh & 1) << 4)).astype(np.int8)
        return QCode(torch.from_numpy(q.reshape(N, K)), torch.from_numpy(scale.reshape(N, K // 32)),
                     torch.from_numpy(minv.reshape(N, K // 32)), 32, 8)
    if qtype == "Q6_K":
        blk = raw.reshape(-1, 210)
        ql, qh = blk[:, 0:128], blk[:, 128:192]
        scales = blk[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blk[:, 208:210])
        lo = _low_high(ql, 64).reshape(-1, 4, 32)  # (n, 4, 32) per 64-byte half: [lo, hi] nibbles
        lo = lo.reshape(-1, 2, 2, 2, 32)  # (n, half, nibble, part, 32)
        hi = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        # value index within a 128-half: 32*j + l, j = 0..3 ; low 4 bits from ql, high 2 from qh
        low = np.stack([lo[:, :, 0, 0], lo[:, :, 0, 1], lo[:, :, 1, 0], lo[:, :, 1, 1]], axis=2)  # (n,2,4,32)
        q = ((low | (hi << 4)).astype(np.int8) - np.int8(32)).reshape(-1, QK_K)
        scale = d * scales  # (n, 16)
        return QCode(torch.from_numpy(q.reshape(N, K)), torch.from_numpy(scale.reshape(N, K // 16)), None, 16, 8)
    return None


# GGML type ids (ggml.h's ``enum ggml_type``; fixed, files depend on them) of the block formats a load meets
# most: looked up here so that reading a GGUF in place does not import the gguf package (~0.1 s).
GGML_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
            "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}


def ggml_type_id(qtype: str) -> int | None:
    """The GGML type id of the type named ``qtype`` (as gguf's ``GGMLQuantizationType``), None if unknown."""
    if qtype in GGML_IDS:
        return GGML_IDS[qtype]
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[qtype]) if qtype in GGMLQuantizationType.__members__ else None


def repack_format(qtype: str) -> tuple[int, int, int, bool] | None:
    """(ggml type id, group, bits, has_min) of the code the kernel's re-packer makes of GGML type ``qtype``
    (csrc/gguf/repack.h), or None when it does not handle it or the kernel is not built."""
    from . import extension

    ext = extension()
    tid = ggml_type_id(qtype)
    if ext is None or tid is None:
        return None
    fmt = ext.repack_format(tid)
    return None if fmt is None else (tid, *fmt)


# GGML types computed by the K-quant rule (csrc/core/kquant.h) -> its format id (QLinear ``bits``): the ggml id
# for Q4_K / Q6_K, 100 + the ggml id for the block formats (one float step per block of 32)
KQ_TYPES = {"Q4_K": 12, "Q6_K": 14, "Q4_0": 102, "Q4_1": 103, "Q5_0": 106, "Q8_0": 108}


def kq_format(qtype: str, shape: tuple[int, int]) -> tuple[int, int, int, bool] | None:
    """(format id, block, format id, has_min) = (id, 256 | 32, id, False) when an (N, K) tensor of GGML type
    ``qtype`` runs on the K-quant rule (csrc/core/kquant.h: the file's own integers, 16 columns interleaved;
    ``QLinear`` with ``bits`` in ``KQ_BITS``): Q4_K / Q6_K (K a multiple of 256) and Q4_0 / Q4_1 / Q5_0 / Q8_0
    (K a multiple of 32), with N a multiple of 16, the kernel built and int8 activations
    (``DRAFTWISE_EXACT_ACTIVATIONS=1`` keeps the groups-of-32 code, which has an fp32-activation path). Else None."""
    from . import activation_bits, extension

    tid = KQ_TYPES.get(qtype)
    N, K = shape
    if tid is None or N % 16 or K % KQ_BLOCK[tid] or activation_bits() != 8 or extension() is None:
        return None
    return tid, KQ_BLOCK[tid], tid, False


def kq_code(N: int, K: int, tid: int) -> QCode:
    """An empty K-quant code for an (N, K) tensor: q (N / 16 tiles, K / block * tile bytes) uint8; scale
    (N, 0) so that slicing rows (of 16) works as for the other codes."""
    return QCode(torch.empty(N // 16, K // KQ_BLOCK[tid] * KQ_TILE[tid], dtype=torch.uint8), torch.empty(N, 0), None,
                 KQ_BLOCK[tid], tid)


def code_rows(code: QCode, row: int, n: int) -> QCode:
    """Rows row..row+n of a code, as views (a K-quant code's rows come in tiles of 16)."""
    if code.bits in KQ_TILE:
        assert row % 16 == 0 and n % 16 == 0, "K-quant codes are sliced in tiles of 16 rows"
        return QCode(code.q[row // 16:(row + n) // 16], code.scale[row:row + n], None, code.group, code.bits)
    return QCode(code.q[row:row + n], code.scale[row:row + n], None if code.minv is None else code.minv[row:row + n],
                 code.group, code.bits)


def code_tiles(code: QCode, tiles: torch.Tensor, rows: int) -> QCode:
    """The rows of the 16-row tiles ``tiles`` (sorted indices, (n,) int64) of a code with ``rows`` rows, copied
    into one code (a K-quant code's rows come in tiles of 16; a last tile past ``rows`` keeps its padding)."""
    r = (tiles[:, None] * 16 + torch.arange(16)).reshape(-1)  # (16 n,) row ids
    if code.bits in KQ_TILE:
        return QCode(code.q.index_select(0, tiles), code.scale[:0].new_empty(len(r), 0), None, code.group, code.bits)
    r = r[r < rows]
    return QCode(code.q.index_select(0, r), code.scale.index_select(0, r),
                 None if code.minv is None else code.minv.index_select(0, r), code.group, code.bits)


def repack(data: np.ndarray, qtype: str, shape: tuple[int, int], out: QCode | None = None) -> QCode | None:
    """``parse`` through the kernel's C++ re-packer (csrc/gguf/repack.h) where it handles the format: the same
    bytes, written in place into ``out`` when given (e.g. rows of a fused matrix), on the kernel's threads.
    Q4_K / Q6_K tensors that ``kq_format`` accepts become the K-quant code instead. Falls back to ``parse``
    (None for formats neither handles)."""
    from . import extension

    N, K = shape
    kq = kq_format(qtype, shape)
    if kq is not None:
        tid = kq[0]
        if out is None:
            out = kq_code(N, K, tid)
        with warnings.catch_warnings():  # a read-only map of the file: read, never written
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        extension().kq_pack(src, tid, N, K, out.q.view(-1))
        return out
    fmt = repack_format(qtype)
    if fmt is None or K % (256 if qtype.endswith("_K") else 32):
        code = parse(data, qtype, shape)
        if code is not None and out is not None:
            for dst, val in ((out.q, code.q), (out.scale, code.scale), (out.minv, code.minv)):
                if val is not None:
                    dst.copy_(val)
            return out
        return code
    tid, group, bits, has_min = fmt
    if out is None:
        out = QCode(torch.empty(N, K * bits // 8, dtype=torch.uint8 if bits == 4 else torch.int8),
                    torch.empty(N, K // group), torch.empty(N, K // group) if has_min else None, group, bits)
    with warnings.catch_warnings():  # a read-only map of the file: read, never written
        warnings.simplefilter("ignore", UserWarning)
        src = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    extension().repack_gguf(src, tid, N, K, out.q, out.scale, out.minv if has_min else torch.empty(0))
    return out
