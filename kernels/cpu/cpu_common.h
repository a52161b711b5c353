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
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace sluice {

#if defined(CPU_CAPABILITY_AVX512)
// 16 K/V values widened to float in one vector.
template <typename KT>
inline __m512 load16(const KT* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {  // the high half of a float
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
template <>
inline __m512 load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// Widen one K/V row to float. bfloat16 is the high half of a float: a shift the
// compiler vectorizes (c10's conversion operator it does not).
template <typename KT>
inline void to_float(const KT* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

#if defined(CPU_CAPABILITY_AVX512)
// float16: GCC leaves the loop above scalar (one vcvtph2ps a value: half of the
// deterministic attention's time on an AMD EPYC at 16 x 512 positions).
template <>
inline void to_float<at::Half>(const at::Half* src, float* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(dst + j, load16(src + j));
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

}  // namespace sluice
