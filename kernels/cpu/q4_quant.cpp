// x quantized for the Q4/Q8 block kernels: per row and group of 32 columns, two int8
// planes a, b and the scale u (q4_linear.cpp's header comment has the arithmetic,
// q4_rows.h the layout). Its own file so that q4_linear's quantization of a row and a
// row op's (fused_ops.cpp: rms_norm_q4, silu_mul_q4) run one compiled copy of it.
#include <ATen/ATen.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "q4_rows.h"  // Q4_VNNI
#include "spin_pool.h"

namespace sluice {

namespace {

constexpr int64_t kGroup = kQuantGroup;

// One group of 32 values -> its two planes a, b (32 codes each); returns u and sets usum.
// The vector and the scalar forms perform the same float operations, so they give the same bits.
inline float quantize_group(const float* v, int8_t* a, int8_t* b, float& usum) {
#if defined(Q4_VNNI)
  const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // half to even, as nearbyint
  __m512i sum = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512 scaled = _mm512_mul_ps(h ? v1 : v0, inv);
    const __m512 hi = _mm512_roundscale_ps(scaled, kNearest);
    const __m512 lo = _mm512_min_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(_mm512_set1_ps(256.f), _mm512_sub_ps(scaled, hi)), kNearest),
        _mm512_set1_ps(127.f));
    const __m512i hi_i = _mm512_cvtps_epi32(hi), lo_i = _mm512_cvtps_epi32(lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + 16 * h), _mm512_cvtepi32_epi8(hi_i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b + 16 * h), _mm512_cvtepi32_epi8(lo_i));
    sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_slli_epi32(hi_i, 8), lo_i));
  }
  const int32_t total = _mm512_reduce_add_epi32(sum);
#else
  float amax = 0.f;
  for (int64_t t = 0; t < kGroup; ++t) amax = std::max(amax, std::fabs(v[t]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int64_t t = 0; t < kGroup; ++t) {
    const float scaled = v[t] * inv;
    const float hi = std::nearbyint(scaled);  // round half to even
    // scaled - hi is exact and in [-1/2, 1/2]: b in [-128, 128], 128 clamped
    const float lo = std::min(std::nearbyint(256.f * (scaled - hi)), 127.f);
    a[t] = static_cast<int8_t>(hi);
    b[t] = static_cast<int8_t>(lo);
    total += 256 * static_cast<int32_t>(hi) + static_cast<int32_t>(lo);
  }
#endif
  const float u = amax / 127.f / 256.f;
  usum = u * static_cast<float>(total);
  return u;
}

// Group g of row `row` from its 32 values v. One compiled copy (noinline) for quantize_rows
// and quantize_row, so a row quantized by either has the same bits.
__attribute__((noinline)) void store_group(QuantRows& q, int64_t row, int64_t g, const float* v) {
  int8_t a[kGroup], b[kGroup];
  const int64_t at = q.at(row, g), K = q.G * kGroup;
  q.u[at] = quantize_group(v, a, b, q.usum[at]);
  int8_t* dst = q.x.get() + q.quads(row, g);
  const int64_t h = q.height(row);
  for (int c = 0; c < 8; ++c) {
    std::memcpy(dst + 8 * h * c, a + 4 * c, 4);
    std::memcpy(dst + 8 * h * c + 4, b + 4 * c, 4);
  }
  for (int64_t t = 0; q.x16 && t < kGroup; ++t) q.x16[row * K + g * kGroup + t] = static_cast<int16_t>(256 * a[t] + b[t]);
}

}  // namespace

QuantRows quantize_rows(const float* x, int64_t M, int64_t K, bool wide) {
  QuantRows q = alloc_quant_rows(M, K, wide);
  const int64_t G = q.G;
  sluice::parallel_for(M * G, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) store_group(q, i / G, i % G, x + i * kGroup);
  });
  return q;
}

QuantRows alloc_quant_rows(int64_t M, int64_t K, bool wide) {
  const int64_t G = K / kGroup;
  return QuantRows{std::unique_ptr<int8_t[]>(new int8_t[M * G * 64]), std::unique_ptr<float[]>(new float[M * G]),
                   std::unique_ptr<float[]>(new float[M * G]), M, G,
                   std::unique_ptr<int16_t[]>(wide ? new int16_t[M * K] : nullptr)};
}

void quantize_row(QuantRows& q, int64_t row, const float* x) {
  for (int64_t g = 0; g < q.G; ++g) store_group(q, row, g, x + g * kGroup);
}

}  // namespace sluice
