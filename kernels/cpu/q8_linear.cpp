// y = x @ W.T with W held as int8 blocks (llama.cpp's Q8_0: one float scale per
// 32 consecutive input columns of a row), x and y float32. Used for the LM head,
// whose GGUF weight is Q8_0: the packed form is exact (q * d is a float32 value
// exactly) at a quarter of the float32 bytes a decode step has to read.
//
// Packed layout, 16 output rows per block so one vector holds 16 outputs:
//   qw:     int8  [N / 16, K, 16]       qw[b, k, j]     = q of row 16b + j, column k
//   scales: float [N / 16, K / 32, 16]  scales[b, g, j] = d of row 16b + j, group g
//
// Batch invariance by construction: y[m, n] = sum over k = 0..K-1, in that order, of
// x[m, k] * (q[n, k] * d[n, k / 32]), one fused multiply-add per k into one float
// accumulator. Rows are tiled R at a time only to share the weight load; a row's
// operations are the same whatever R, M, its position or the thread count.
#include "spin_pool.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGroup = 32;

#if defined(__AVX512F__)
template <int R>
inline void q8_tile(const float* x, int64_t K, const int8_t* qw, const float* scales, float* y, int64_t N) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const __m512 d = _mm512_loadu_ps(scales + g * kLanes);
    for (int64_t kk = 0; kk < kGroup; ++kk) {
      const int64_t k = g * kGroup + kk;
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qw + k * kLanes));
      const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}
#else
template <int R>
inline void q8_tile(const float* x, int64_t K, const int8_t* qw, const float* scales, float* y, int64_t N) {
  float acc[R][kLanes] = {};
  float w[kLanes];
  for (int64_t k = 0; k < K; ++k) {
    const float* d = scales + (k / kGroup) * kLanes;
    for (int64_t j = 0; j < kLanes; ++j) w[j] = static_cast<float>(qw[k * kLanes + j]) * d[j];
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kLanes; ++j) acc[r][j] = std::fma(x[r * K + k], w[j], acc[r][j]);
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kLanes; ++j) y[r * N + j] = acc[r][j];
}
#endif

}  // namespace

at::Tensor q8_linear(at::Tensor x, at::Tensor qw, at::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(qw.dim() == 3 && qw.scalar_type() == at::kChar && qw.size(2) == kLanes && qw.is_contiguous(),
              "qw: int8 [N / 16, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), blocks = qw.size(0), N = blocks * kLanes;
  TORCH_CHECK(qw.size(1) == K && K % kGroup == 0, "qw's K must be x's and a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(1) == K / kGroup && scales.size(2) == kLanes,
              "scales: float32 [N / 16, K / 32, 16]");
  x = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qw.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t R = 4;
  sluice::parallel_for(blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* qb = qp + b * K * kLanes;
      const float* sb = sp + b * (K / kGroup) * kLanes;
      int64_t m = 0;
      for (; m + R <= M; m += R) q8_tile<R>(xp + m * K, K, qb, sb, yp + m * N + b * kLanes, N);
      switch (M - m) {
        case 3: q8_tile<3>(xp + m * K, K, qb, sb, yp + m * N + b * kLanes, N); break;
        case 2: q8_tile<2>(xp + m * K, K, qb, sb, yp + m * N + b * kLanes, N); break;
        case 1: q8_tile<1>(xp + m * K, K, qb, sb, yp + m * N + b * kLanes, N); break;
        default: break;
      }
    }
  });
  return y;
}
