// What the kernel files include first: the vector ISA at::vec is compiled for (the build
// is -march=native, so the compiler's own macros say what this CPU has; at::vec reads
// CPU_CAPABILITY_* when its headers are included), and the K/V row widening that both
// attention kernels use.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#define SLUICE_V16 1  // V16 below: the attention kernels' fast paths
#endif

namespace sluice {

// V16: 16 floats, the attention kernels' unit (a score's 16 channel lanes, 16 positions'
// scores): one zmm with AVX-512, two ymm with AVX2 (lanes 0..7 and 8..15), and the few
// operations those kernels need, lane for lane the same arithmetic on either ISA.
#if defined(CPU_CAPABILITY_AVX512)
using V16 = __m512;
inline V16 v16_zero() { return _mm512_setzero_ps(); }
inline V16 v16_set1(float x) { return _mm512_set1_ps(x); }
inline V16 v16_loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void v16_storeu(float* p, V16 v) { _mm512_storeu_ps(p, v); }
inline V16 v16_fma(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
inline void v16_store_first(float* p, V16 v, int64_t n) {  // lanes [0, min(n, 16))
  _mm512_mask_storeu_ps(p, n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1), v);
}

// 16 K/V values widened to float in one vector.
template <typename KT>
inline V16 load16(const KT* p);
template <>
inline V16 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline V16 load16<at::BFloat16>(const at::BFloat16* p) {  // the high half of a float
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
template <>
inline V16 load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#elif defined(CPU_CAPABILITY_AVX2)
struct V16 {
  __m256 lo, hi;  // lanes 0..7, 8..15
};
inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v16_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 v16_loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void v16_storeu(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline V16 v16_fma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline void v16_store_first(float* p, V16 v, int64_t n) {
  if (n >= 16) return v16_storeu(p, v);
  float lanes[16];
  v16_storeu(lanes, v);
  for (int64_t j = 0; j < n; ++j) p[j] = lanes[j];
}

inline __m256 widen8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 widen8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
template <typename KT>
inline V16 load16(const KT* p) {
  return {widen8(p), widen8(p + 8)};
}
#endif

// Widen one K/V row to float. bfloat16 is the high half of a float: a shift the
// compiler vectorizes (c10's conversion operator it does not).
template <typename KT>
inline void to_float(const KT* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

#if defined(SLUICE_V16)
// float16: GCC leaves the loop above scalar (one vcvtph2ps a value: half of the
// deterministic attention's time on an AMD EPYC at 16 x 512 positions).
template <>
inline void to_float<at::Half>(const at::Half* src, float* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) v16_storeu(dst + j, load16(src + j));
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}
#endif

template <>
inline void to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<uint32_t>(bits[j]) << 16;
}

// The `bytes` of a K/V row slice starting at p into L1, ahead of its use: a sequence's
// slots are anywhere in the pool (streams decoding together interleave), so the hardware
// prefetcher cannot follow them.
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(static_cast<const char*>(p) + l, 0, 3);
}

// The same into L2 only (prefetcht1): for rows fetched far ahead, where more misses can be in
// flight at once than L1's fill buffers hold (attention_span.h's decode rows).
inline void prefetch_row_l2(const void* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(static_cast<const char*>(p) + l, 0, 2);
}

}  // namespace sluice
