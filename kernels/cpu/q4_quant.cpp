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

// Group g of row `row` from its 32 values v (the AVX2 and scalar forms, and rows with x16;
// quantize_row_vnni below elsewhere). quantize_rows quantizes each row by quantize_row, so a
// row quantized by either has the same bits.
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

#if defined(Q4_VNNI)
// 16 vectors -> one whose lane i is op over v[i]'s 16 lanes: four levels of shuffles, three
// instructions a pair, where a horizontal reduction of each vector took eight. (op: max, or +
// of integers below 2^24 in float: exact in any order.)
template <typename Op>
inline __m512 reduce16(const __m512 (&v)[16], Op op) {
  __m512 a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j)  // 256-bit half 0: v[2j]'s 8 partial results, half 1: v[2j + 1]'s
    a[j] = op(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44), _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // 128-bit lane L: v[4j + L]'s 4
    b[j] = op(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88), _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)  // lane L: v[8j + L]'s 2, then v[8j + 4 + L]'s 2
    c[j] = op(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], 0x44), _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], 0xEE));
  // element 4L + k: v[L + 4k]'s
  const __m512 d = op(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
}

// quantize_group's arithmetic for a whole row, 16 groups at a time: the groups' maxima and
// sums reduced together (reduce16), the divisions as vectors, each group's codes packed in
// registers into the layout's 8-byte quads (a's 4 codes, then b's) and stored from there.
// The same float operations per value as quantize_group, so the same bits.
void quantize_row_vnni(QuantRows& q, int64_t row, const float* x) {
  const int64_t G = q.G, h = q.height(row);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 zero = _mm512_setzero_ps();
  const auto max = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto add = [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); };
  for (int64_t g0 = 0; g0 < G; g0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, G - g0));
    const float* xg = x + g0 * kGroup;
    __m512 part[16];
    for (int i = 0; i < 16; ++i)
      part[i] = i < n ? _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xg + kGroup * i)),
                                      _mm512_abs_ps(_mm512_loadu_ps(xg + kGroup * i + 16)))
                      : zero;
    const __m512 amax = reduce16(part, max);
    // 127 / amax where amax > 0 (else 0) and amax / 127 / 256: quantize_group's divisions
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, zero, _CMP_GT_OQ), _mm512_set1_ps(127.f), amax);
    const __m512 u = _mm512_div_ps(_mm512_div_ps(amax, _mm512_set1_ps(127.f)), _mm512_set1_ps(256.f));
    alignas(64) float invs[16];
    _mm512_store_ps(invs, inv);
    for (int i = 0; i < n; ++i) {
      const __m512 s = _mm512_set1_ps(invs[i]);
      __m512i codes[2][2];  // [half][a, b]
      __m512 total = zero;  // 256 a + b, summed: integers below 2^24, exact
      for (int half = 0; half < 2; ++half) {
        const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(xg + kGroup * i + 16 * half), s);
        const __m512 hi = _mm512_roundscale_ps(scaled, kNearest);
        const __m512 lo = _mm512_min_ps(
            _mm512_roundscale_ps(_mm512_mul_ps(_mm512_set1_ps(256.f), _mm512_sub_ps(scaled, hi)), kNearest),
            _mm512_set1_ps(127.f));
        codes[half][0] = _mm512_cvtps_epi32(hi);
        codes[half][1] = _mm512_cvtps_epi32(lo);
        total = _mm512_add_ps(total, _mm512_fmadd_ps(hi, _mm512_set1_ps(256.f), lo));
      }
      part[i] = total;
      // 128-bit lane L of the packs: quad L (a's 4 codes, b's 4), then quad 4 + L (no value saturates)
      const __m512i packed = _mm512_packs_epi16(_mm512_packs_epi32(codes[0][0], codes[0][1]),
                                                _mm512_packs_epi32(codes[1][0], codes[1][1]));
      int8_t* dst = q.x.get() + q.quads(row, g0 + i);
      const auto put = [&](__m128i lane, int L) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + 8 * h * L), lane);
        _mm_storeh_pd(reinterpret_cast<double*>(dst + 8 * h * (4 + L)), _mm_castsi128_pd(lane));
      };
      put(_mm512_castsi512_si128(packed), 0);
      put(_mm512_extracti32x4_epi32(packed, 1), 1);
      put(_mm512_extracti32x4_epi32(packed, 2), 2);
      put(_mm512_extracti32x4_epi32(packed, 3), 3);
    }
    for (int i = n; i < 16; ++i) part[i] = zero;
    alignas(64) float us[16], sums[16];
    _mm512_store_ps(us, u);
    _mm512_store_ps(sums, _mm512_mul_ps(u, reduce16(part, add)));
    for (int i = 0; i < n; ++i) {
      const int64_t at = q.at(row, g0 + i);
      q.u[at] = us[i];
      q.usum[at] = sums[i];
    }
  }
}
#endif

}  // namespace

QuantRows quantize_rows(const float* x, int64_t M, int64_t K, bool wide) {
  QuantRows q = alloc_quant_rows(M, K, wide);
  sluice::parallel_for(M, 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(q, r, x + r * K);
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
#if defined(Q4_VNNI)
  if (!q.x16) return quantize_row_vnni(q, row, x);
#endif
  for (int64_t g = 0; g < q.G; ++g) store_group(q, row, g, x + g * kGroup);
}

}  // namespace sluice
