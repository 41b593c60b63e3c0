// GGUF blocks -> the kernel's code (qmm.h), at load time: the file's own integers and scales, re-laid out,
// never re-quantized, so that the GGUF is the only copy of a model on disk (llama.cpp re-packs its
// interleaved CPU formats at load in the same way). The reference is kernels/gguf_quant.py parse(): the
// tests check that both give the same bytes for every format handled here.
//
// (With int8 activations, Q4_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q8_0 tensors of whole 16-row tiles take the
// K-quant rule's layout instead, kq_pack_rows below; this code serves the rest and fp32 activations.)
//   GGML  block  -> kernel code                       scale (per group)   minv (per group)
//   Q4_0  32 B18 -> int4, G 32 (bytes as stored)      d                   8 d
//   Q4_1  32 B20 -> int4, G 32 (bytes as stored)      d                   -m
//   Q5_0  32 B22 -> int8 q - 16, G 32                 d                   -
//   Q8_0  32 B34 -> int8, G 32                        d                   -
//   Q4_K  256 B144 -> int4, G 32 (nibbles regrouped)  d * sc (exact)      dmin * m (exact)
//   Q5_K  256 B176 -> int8, G 32                      d * sc (exact)      dmin * m (exact)
//   Q6_K  256 B210 -> int8 q - 32, G 16               d * sc (exact)      -
// (fp16 -> fp32 is exact, and an 11-bit mantissa times a 6- or 8-bit integer fits fp32's 24 bits, so the
// scales equal what the reference computes in numpy, bit for bit.)
// No torch here (like qmm.h): the core stays testable on its own.
#pragma once
#include <cstdint>

namespace dw {

// ggml type ids (ggml.h enum ggml_type) of the formats re-packed here
enum GgmlType : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct RepackFormat {
  int64_t block_values, block_bytes;  // one GGUF block: values and bytes
  int64_t group, bits;                // the kernel code it becomes
  bool has_min;
};

// false for a type not handled here (then the caller uses the reference)
bool repack_format(int type, RepackFormat* f);

// Rows n0..n1 of an (N, K) tensor of `type` whose rows lie one after the other at src (K / block_values
// blocks each) -> q (N, K * bits / 8), scale (N, K / G), minv (N, K / G; null when the format has none).
void repack_rows(int type, const uint8_t* src, int64_t K, uint8_t* q, float* scale, float* minv, int64_t n0,
                 int64_t n1);

// GGUF Q4_K / Q6_K / Q4_0 / Q4_1 / Q5_0 / Q8_0 rows (n0..n1 of an (N, K) tensor whose rows lie one after the
// other at src) -> their columns of the K-quant rule's x16 layout (core/kquant.h) at dst (kq_bytes(fmt, N, K)
// bytes; padding columns are written by the tile that holds column N - 1: zero). fmt: a KqFormat (kquant_pack.cpp)
void kq_pack_rows(int fmt, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst, int64_t n0, int64_t n1);

}  // namespace dw
