// y = x @ W.T with W in 4-bit blocks (llama.cpp's Q4_0/Q4_1: per row, per 32 input
// columns, w = d * q + m with q in [0, 15]) and x quantized on the fly (q4_quant.cpp), per row and the
// same 32 columns, to two int8 planes: with s = max|x| / 127, t = x / s,
//
//   a = round(t),  b = round(256 * (t - a))   (both int8),   x ~= u * (256 a + b),  u = s / 256
//
// (a 16-bit fixed point; a single int8 plane, llama.cpp's Q8_1, lost 2.3 points of top-1
// agreement with float32 on SmolLM2, bench/RESULTS.md item 17). Then
//
//   y[r, n] = sum over groups g of  d[n, g] * u[r, g] * c  +  m[n, g] * u[r, g] * (256 sum a + sum b)
//   with c = 256 (q . a) + (q . b)
//
// where each dot product is exact in int32: one AVX512-VNNI `vpdpbusd` multiplies 64
// unsigned codes by 64 signed int8 values and adds each 4 products into one of 16 int32
// lanes. c < 2^24, so it converts to float exactly. (AVX2 without VNNI computes the same
// integers with other instructions: block_tile's second form below.) Two planes cost twice
// the integer work, which a memory-bound step at a few rows does not notice.
//
// Packed layout (runtime/layers/quantization/q4q8.py `pack_q4`, once at load): 16 output rows per block, so one vector lane is
// one output row and no horizontal sum is ever needed. Block b, group g is a record of
// 320 bytes, read front to back:
//   [64c, 64c + 64), c = 0..3   codes of columns 8c .. 8c + 7 of the group: byte 4j + t holds
//                               q[j, 8c + t] (low nibble) and q[j, 8c + 4 + t] (high nibble),
//                               so masking gives lane j its 4 codes for one vpdpbusd each
//   [256, 288)                  d of the 16 rows, fp16 (GGUF stores fp16: exact)
//   [288, 320)                  m of the 16 rows, fp16
// i.e. llama.cpp's 20 bytes per 32 weights, in one forward stream per block.
//
// Q8 blocks (the LM head, w = d * q, q in [-127, 127]; q8_linear_vnni) use the same
// arithmetic on 8-bit codes q + 128 with m = -128 d, in records of 576 bytes: quad c's
// 64 bytes at [64c, 64c + 64) (byte 4j + t = row j, column 4c + t), then d as float32; m is
// derived in the kernel (a power-of-two multiple, exact), which keeps the 49152 x 576 head
// at 31.9 MB a step instead of 35.4 (the step's weights are about this machine's L3 share).
// There c can exceed 2^24, so its conversion to float rounds (relative 2^-24).
//
// Software prefetch, kPrefetchAhead bytes ahead of the record being read (first tile of a
// block only). A decode step streams ~98 MB of records (SmolLM2: 66 MB of Q4 linears, 32 MB
// of Q8 head), about what this machine's share of L3 holds; the hardware streamer stops at
// every 4 KB page and restarts its ramp on each of a step's 121 linears, so without the hint a
// bs 1 forward took 4.2-4.5 ms, with it 3.0-3.6 (bench/RESULTS.md item 20).
//
// Batch invariance by construction: a row's quantization, integer dot products and float
// accumulation (one fma for the d term, one for the m term, group by group in order) are
// the same whatever M, the row's position in the tile, or the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "q4_rows.h"  // Q4_VNNI / Q4_AVX2
#include "spin_pool.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGroup = sluice::kQuantGroup;
constexpr int64_t kRecord = 320;  // bytes per (block, group): 256 of codes, 32 of d, 32 of m
constexpr int64_t kRecord8 = 576;  // Q8: 512 of codes (q + 128), 64 of d (float32); m = -128 d is not stored
constexpr int64_t kPrefetchAhead = 4096;  // one page: past where the hardware streamer stops

constexpr int64_t kTileRows = sluice::kQuantTileRows;  // (VNNI: 24 of 32 zmm hold a tile's sums)
#if defined(Q4_AVX2)
constexpr bool kWideQ8 = true;  // the Q8 records' AVX2 path reads x16 (q8_dots)
#else
constexpr bool kWideQ8 = false;
#endif

using sluice::QuantRows;
using sluice::quantize_rows;

#if defined(Q4_VNNI)
// acc += codes (64 unsigned bytes) . the 4 signed bytes at x4, broadcast to every lane. An
// embedded broadcast ({1to16}): GCC 12 emits a separate vpbroadcastd for
// _mm512_set1_epi32 of a load, one extra instruction per vpdpbusd in the inner loop.
inline __m512i dpbusd_bcast(__m512i acc, __m512i codes, const int8_t* x4) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*reinterpret_cast<const int32_t*>(x4)));
  return acc;
}

// Tile `tile` of x (its R rows: R is the tile's height h) against one block of 16 output rows.
// (prefetch: this is the block's first tile, which streams its records in)
template <int R, bool Q8>
inline void block_tile(const QuantRows& q, int64_t tile, const uint8_t* rec, float* y, int64_t N, bool prefetch) {
  constexpr int64_t record = Q8 ? kRecord8 : kRecord;
  const int64_t G = q.G;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int8_t* xg = q.x.get() + q.quads(tile * kTileRows, 0);  // group g's quads: xg + 64 R g
  const float* ug = q.u.get() + q.at(tile * kTileRows, 0);
  const float* sg = q.usum.get() + q.at(tile * kTileRows, 0);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, rec += record, xg += 64 * R, ug += R, sg += R) {
    // (past the tensor's end on the last records: a prefetch never faults)
    for (int64_t l = 0; prefetch && l < record; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchAhead + l), _MM_HINT_T0);
    __m512i dot_a[R], dot_b[R];
    for (int r = 0; r < R; ++r) dot_a[r] = dot_b[r] = _mm512_setzero_si512();
    for (int c = 0; c < (Q8 ? 8 : 0); ++c) {  // Q8: quad c's 64 code bytes as they are
      const __m512i codes = _mm512_loadu_si512(rec + 64 * c);
      for (int r = 0; r < R; ++r) {
        dot_a[r] = dpbusd_bcast(dot_a[r], codes, xg + 8 * (R * c + r));
        dot_b[r] = dpbusd_bcast(dot_b[r], codes, xg + 8 * (R * c + r) + 4);
      }
    }
    for (int c = 0; c < (Q8 ? 0 : 4); ++c) {  // Q4: low nibbles are quad 2c, high nibbles quad 2c + 1
      const __m512i raw = _mm512_loadu_si512(rec + 64 * c);
      const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xg + 8 * (2 * R * c + r);  // quad 2c; quad 2c + 1 is 8 R bytes on
        dot_a[r] = dpbusd_bcast(dot_a[r], lo, x);
        dot_b[r] = dpbusd_bcast(dot_b[r], lo, x + 4);
        dot_a[r] = dpbusd_bcast(dot_a[r], hi, x + 8 * R);
        dot_b[r] = dpbusd_bcast(dot_b[r], hi, x + 8 * R + 4);
      }
    }
    const __m512 d = Q8 ? _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 512))
                        : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
    const __m512 m = Q8 ? _mm512_mul_ps(d, _mm512_set1_ps(-128.f))  // exact: a power of two
                        : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288)));
    for (int r = 0; r < R; ++r) {
      const __m512i c = _mm512_add_epi32(_mm512_slli_epi32(dot_a[r], 8), dot_b[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(d, _mm512_set1_ps(ug[r])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sg[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (tile * kTileRows + r) * N, acc[r]);
}
#elif defined(Q4_AVX2)
// AVX2 without VNNI (e.g. AMD Zen 2): the same integer dot products from vpmaddubsw, which
// multiplies 32 unsigned codes by 32 signed int8 values and adds each 2 products into an
// int16 lane. With 4-bit codes a lane holds at most 2 * 15 * 128 = 3840 in size, so a
// group's 8 column quads sum in int16 without saturating (30720 < 32767); one vpmaddwd by
// ones then adds a row's two int16 lanes into its int32 lane: vpdpbusd's exact sum. Q8
// codes: q8_dots below.
// The float steps are the VNNI path's, 8 lanes at a time, so the output has the same bits.
// A record's 16 output rows are two halves of 8 (bytes [32h, 32h + 32) of each 64).

inline __m256i bcast4(const int8_t* x4) {
  int32_t v;
  std::memcpy(&v, x4, 4);
  return _mm256_set1_epi32(v);
}

// One half's 8 rows against one x row, over a group: da, db (int32 lanes) = nib . a, nib . b
// where nib[k] holds the 8 rows' 4 codes (0..15) of column quad k, and the row's quad k
// sits at x + 8 R k (a's 4 codes, then b's).
template <int R>
inline void dots8(const __m256i* nib, const int8_t* x, __m256i& da, __m256i& db) {
  __m256i sa = _mm256_setzero_si256(), sb = _mm256_setzero_si256();
  for (int k = 0; k < 8; ++k) {
    sa = _mm256_add_epi16(sa, _mm256_maddubs_epi16(nib[k], bcast4(x + 8 * R * k)));
    sb = _mm256_add_epi16(sb, _mm256_maddubs_epi16(nib[k], bcast4(x + 8 * R * k + 4)));
  }
  const __m256i ones = _mm256_set1_epi16(1);
  da = _mm256_madd_epi16(sa, ones);
  db = _mm256_madd_epi16(sb, ones);
}

// Q8 records: codes u = q + 128 (up to 255) would saturate vpmaddubsw's int16 sums, so they
// are widened to int16 and multiplied by the row's 16-bit fixed point x16 = 256 a + b
// (|x16| <= 32640) with vpmaddwd: 32-bit lane 2i + e of a vector holds row i's products
// with columns 4k + 2e, 4k + 2e + 1 (4 rows a vector). A group's 8 quads sum in int32
// (16 products of at most 255 * 32640 a lane), and the two lanes of a row add up to
// c = u . (256 a + b) = 256 (u . a) + u . b, vpdpbusd's c exactly.
// c[r] = row (row0 + r)'s c with the half's 8 rows (codes: the group's record + 32 h), rows
// taken 4 at a time: 2 sums a row, 2 code vectors and a broadcast stay in registers.
template <int R>
inline void q8_dots(const QuantRows& q, int64_t row0, int64_t g, const uint8_t* codes, __m256i* c) {
  if constexpr (R > 4) {
    q8_dots<4>(q, row0, g, codes, c);
    q8_dots<R - 4>(q, row0 + 4, g, codes, c + 4);
  } else {
    const int64_t K = q.G * kGroup;
    const int16_t* xg = q.x16.get() + row0 * K + g * kGroup;
    __m256i lanes[R][2];
    for (int r = 0; r < R; ++r) lanes[r][0] = lanes[r][1] = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k, codes += 64) {
      const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
      const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
      for (int r = 0; r < R; ++r) {
        int64_t x4;
        std::memcpy(&x4, xg + r * K + 4 * k, 8);
        const __m256i xb = _mm256_set1_epi64x(x4);
        lanes[r][0] = _mm256_add_epi32(lanes[r][0], _mm256_madd_epi16(w0, xb));
        lanes[r][1] = _mm256_add_epi32(lanes[r][1], _mm256_madd_epi16(w1, xb));
      }
    }
    // hadd: [r0 r1 r4 r5 | r2 r3 r6 r7] of the half's rows -> in order
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int r = 0; r < R; ++r) c[r] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lanes[r][0], lanes[r][1]), order);
  }
}

template <int R, bool Q8>
inline void block_tile(const QuantRows& q, int64_t tile, const uint8_t* rec, float* y, int64_t N, bool prefetch) {
  constexpr int64_t record = Q8 ? kRecord8 : kRecord;
  const int64_t G = q.G;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int8_t* xg = q.x.get() + q.quads(tile * kTileRows, 0);
  const float* ug = q.u.get() + q.at(tile * kTileRows, 0);
  const float* sg = q.usum.get() + q.at(tile * kTileRows, 0);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g, rec += record, xg += 64 * R, ug += R, sg += R) {
    for (int64_t l = 0; prefetch && l < record; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchAhead + l), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i c[R];  // c = 256 (codes . a) + codes . b, each row's 8 lanes
      if constexpr (Q8) {
        q8_dots<R>(q, tile * kTileRows, g, rec + 32 * h, c);
      } else {
        __m256i nib[8];
        for (int c = 0; c < 4; ++c) {  // low nibbles are quad 2c, high nibbles quad 2c + 1
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * c + 32 * h));
          nib[2 * c] = _mm256_and_si256(raw, low);
          nib[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          __m256i dot_a, dot_b;
          dots8<R>(nib, xg + 8 * r, dot_a, dot_b);
          c[r] = _mm256_add_epi32(_mm256_slli_epi32(dot_a, 8), dot_b);
        }
      }
      const __m256 d = Q8 ? _mm256_loadu_ps(reinterpret_cast<const float*>(rec + 512) + 8 * h)
                          : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 256) + h));
      const __m256 m = Q8 ? _mm256_mul_ps(d, _mm256_set1_ps(-128.f))  // exact: a power of two
                          : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 288) + h));
      for (int r = 0; r < R; ++r) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[r]), _mm256_mul_ps(d, _mm256_set1_ps(ug[r])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(sg[r]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (tile * kTileRows + r) * N + 8 * h, acc[r][h]);
}
#else
// The same arithmetic lane by lane (a build without AVX2 or AVX512-VNNI; callers prefer
// torch's int4 kernel there, see q4_linear_isa).
template <int R, bool Q8>
inline void block_tile(const QuantRows& q, int64_t tile, const uint8_t* rec, float* y, int64_t N, bool) {
  const int64_t G = q.G;
  float acc[R][kLanes] = {};
  for (int64_t g = 0; g < G; ++g, rec += Q8 ? kRecord8 : kRecord) {
    float d[kLanes], m[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      if constexpr (Q8) {
        std::memcpy(&d[j], rec + 512 + 4 * j, 4);
        m[j] = -128.f * d[j];
      } else {
        d[j] = static_cast<float>(reinterpret_cast<const at::Half*>(rec + 256)[j]);
        m[j] = static_cast<float>(reinterpret_cast<const at::Half*>(rec + 288)[j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = tile * kTileRows + r, i = q.at(row, g);
      const int8_t* x = q.x.get() + q.quads(row, g);  // column t: a at x[64 (t / 4) + t % 4], b 4 bytes on
      for (int64_t j = 0; j < kLanes; ++j) {
        int32_t dot_a = 0, dot_b = 0;
        for (int t = 0; Q8 && t < kGroup; ++t) {
          const int32_t code = rec[64 * (t / 4) + 4 * j + t % 4];
          dot_a += code * x[8 * R * (t / 4) + t % 4];
          dot_b += code * x[8 * R * (t / 4) + 4 + t % 4];
        }
        for (int c = 0; c < (Q8 ? 0 : 4); ++c)
          for (int t = 0; t < 4; ++t) {
            const int32_t q0 = rec[64 * c + 4 * j + t] & 0x0F, q1 = rec[64 * c + 4 * j + t] >> 4;
            dot_a += q0 * x[16 * R * c + t] + q1 * x[8 * R * (2 * c + 1) + t];
            dot_b += q0 * x[16 * R * c + 4 + t] + q1 * x[8 * R * (2 * c + 1) + 4 + t];
          }
        const float c = static_cast<float>(256 * dot_a + dot_b);
        acc[r][j] = std::fma(c, d[j] * q.u[i], acc[r][j]);
        acc[r][j] = std::fma(m[j], q.usum[i], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kLanes; ++j) y[(tile * kTileRows + r) * N + j] = acc[r][j];
}
#endif

}  // namespace

std::string q4_linear_isa() {
#if defined(Q4_VNNI)
  return "avx512-vnni";
#elif defined(Q4_AVX2)
  return "avx2";
#else
  return "";
#endif
}

namespace {

template <bool Q8>
void check_packed(const at::Tensor& packed, int64_t K) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == (Q8 ? kRecord8 : kRecord) &&
                  packed.is_contiguous(),
              Q8 ? "packed: uint8 [N / 16, K / 32, 576] (q8.pack_q8_vnni)" : "packed: uint8 [N / 16, K / 32, 320] (pack_q4)");
  TORCH_CHECK(packed.size(1) * kGroup == K, "packed's K must be x's");
}

// y = x @ W.T from x's quantized rows.
template <bool Q8>
at::Tensor block_linear_rows(const QuantRows& q, const at::Tensor& packed, const at::TensorOptions& options) {
  const int64_t record = Q8 ? kRecord8 : kRecord;
  const int64_t M = q.M, K = q.G * kGroup, blocks = packed.size(0), N = blocks * kLanes;
  auto y = at::empty({M, N}, options);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Each thread takes whole 16-row blocks; within one, tiles of 8 rows re-read its records
  // from L1/L2 (K = 1536: 15 KB). The LM head (Q8) in 32 pieces a thread: SpinPool::run.
  sluice::parallel_for(blocks, 2, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* rec = pp + b * (K / kGroup) * record;
      float* yb = yp + b * kLanes;
      int64_t t = 0;
      for (; (t + 1) * kTileRows <= M; ++t) block_tile<kTileRows, Q8>(q, t, rec, yb, N, t == 0);
      const bool first = t == 0;
      switch (M - t * kTileRows) {
        case 7: block_tile<7, Q8>(q, t, rec, yb, N, first); break;
        case 6: block_tile<6, Q8>(q, t, rec, yb, N, first); break;
        case 5: block_tile<5, Q8>(q, t, rec, yb, N, first); break;
        case 4: block_tile<4, Q8>(q, t, rec, yb, N, first); break;
        case 3: block_tile<3, Q8>(q, t, rec, yb, N, first); break;
        case 2: block_tile<2, Q8>(q, t, rec, yb, N, first); break;
        case 1: block_tile<1, Q8>(q, t, rec, yb, N, first); break;
        default: break;
      }
    }
  }, Q8 ? 32 : 1);
  return y;
}

template <bool Q8>
at::Tensor block_linear(at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  check_packed<Q8>(packed, x.size(1));
  x = x.contiguous();
  const QuantRows q = quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), Q8 && kWideQ8);
  return block_linear_rows<Q8>(q, packed, x.options());
}

}  // namespace

at::Tensor q4_linear(at::Tensor x, at::Tensor packed) { return block_linear<false>(x, packed); }

at::Tensor q4_linear_rows(const sluice::QuantRows& x, const at::Tensor& packed) {
  check_packed<false>(packed, x.G * kGroup);
  return block_linear_rows<false>(x, packed, at::TensorOptions().dtype(at::kFloat));
}

at::Tensor q8_linear_vnni(at::Tensor x, at::Tensor packed) { return block_linear<true>(x, packed); }
