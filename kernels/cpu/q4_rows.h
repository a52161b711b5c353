// QuantRows: x quantized for the Q4/Q8 block kernels (q4_linear.cpp has the arithmetic),
// here so that a row op that produces a linear's input (a norm, silu * up: fused_ops.cpp)
// can quantize each row as it finishes it, in its own pass over the rows, instead of
// writing x for q4_linear to quantize in another: decode_stack.cpp's fused layer.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <memory>

// Which vector form the Q4/Q8 block kernels (q4_linear.cpp) and the activations'
// quantization (q4_quant.cpp) are built in: the -march=native compiler's own macros.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define Q4_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define Q4_AVX2 1
#endif

namespace sluice {

constexpr int64_t kQuantGroup = 32;     // columns of x per scale (a Q4/Q8 block's)
constexpr int64_t kQuantTileRows = 8;   // rows of x a block tile takes at most

// x as two int8 planes a, b, laid out for the tiles. Tile t holds rows 8t .. 8t + h - 1
// (h = 8, or what is left of M in the last tile); its group g, column quad c (columns
// 4c .. 4c + 3 of the group) and row r hold 8 bytes, a's 4 codes then b's, at
//   64 * (8t * G + g * h) + 8 * (h * c + r),
// and its u, u * (256 sum a + sum b) at 8t * G + g * h + r. So every activation a tile's
// inner loop broadcasts sits at a compile-time offset (h is the tile's R) from one pointer
// per group; the row-major planes needed a pointer per row, which spilled registers. A
// one-row tile reads one cache line of activations per group.
struct QuantRows {
  std::unique_ptr<int8_t[]> x;
  std::unique_ptr<float[]> u, usum;
  int64_t M, G;
  // The same values as int16 256 a + b, row-major [M, K] (the Q8 records' AVX2 form only).
  std::unique_ptr<int16_t[]> x16;
  int64_t height(int64_t row) const { return std::min(kQuantTileRows, M - row / kQuantTileRows * kQuantTileRows); }
  int64_t at(int64_t row, int64_t g) const {  // u[at], usum[at]
    return row / kQuantTileRows * kQuantTileRows * G + g * height(row) + row % kQuantTileRows;
  }
  int64_t quads(int64_t row, int64_t g) const {  // x[quads + 8 h c]: row's a codes of quad c, then its b codes
    return 64 * (at(row, g) - row % kQuantTileRows) + 8 * (row % kQuantTileRows);
  }
};

// Room for M rows of K columns (K % 32 == 0); `wide`: with x16 too.
QuantRows alloc_quant_rows(int64_t M, int64_t K, bool wide = false);

// x [M, K] row-major, quantized over the kernels' threads (q4_linear's first half).
QuantRows quantize_rows(const float* x, int64_t M, int64_t K, bool wide);

// Row `row` of q from its K float values: the same bits as quantize_rows gives that row
// (one compiled copy of the group's arithmetic, q4_quant.cpp).
void quantize_row(QuantRows& q, int64_t row, const float* x);

}  // namespace sluice

// y = x @ W.T for x already quantized (q4_linear's second half): W in pack_q4 records.
at::Tensor q4_linear_rows(const sluice::QuantRows& x, const at::Tensor& packed);
