// The arithmetic of one query's attention, shared by both attention kernels, so that
// a token gets the same bits whichever computes it (paged_attention.cpp, deterministic
// inference: decode and extend; paged_decode.cpp, the default decode, when it does not
// split a sequence into spans).
//
// For a query q (pre-scaled by 1/sqrt(D)) against positions p = 0 .. len-1:
//   score[p] = tree(lane), lane[r] = the fma chain over j = 0 .. D/16-1, in order, of
//              q[16 j + r] * k_p[16 j + r] (its first term an fma onto +0), and the fixed
//              tree over lanes r: (r + r+8), then (+4), (+2), (+1)
//   m        = max over p; e[p] = exp(score[p] - m) (at::vec's vector exp)
//   sum      = 16 lane sums (lane j: positions p = j mod 16, in order), then lanes 0..15
//   out[d]   = (the fma chain over p, in order, of e[p] * v_p[d]) * (1 / sum)
// Where the keys are rows (a decode: one query reads each K row once), a score is 4 fmas
// and the tree, 16 positions' trees side by side (tree16: no horizontal sum per score);
// where K is a transposed tile of 16 positions (an extend: 16 queries share it), it is 16
// lane vectors of positions and the same tree between them.
#pragma once
#include "cpu_common.h"
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace sluice {

using Vecf = at::vec::Vectorized<float>;
constexpr int64_t kScoreLanes = 16;  // channel lanes of a score (D % 16 == 0)

// e[p] = exp(s[p] - m) in place over n scores; returns their sum in the fixed order above
// (16 lane sums, then lanes 0..15). Lanes past n add nothing: a masked load reads +0.0,
// and e >= 0 is unchanged by adding it.
inline float exp_and_sum(float* s, int64_t n, float m) {
  constexpr int64_t kVecs = 16 / Vecf::size();
  Vecf lanes[kVecs];
  for (int64_t v = 0; v < kVecs; ++v) lanes[v] = Vecf(0.f);
  for (int64_t p0 = 0; p0 < n; p0 += 16) {
    for (int64_t v = 0; v < kVecs; ++v) {
      const int64_t p = p0 + v * Vecf::size();
      if (p >= n) break;
      const int64_t count = std::min<int64_t>(Vecf::size(), n - p);
      const Vecf e = (Vecf::loadu(s + p, count) - Vecf(m)).exp();  // the same vector exp for every element
      e.store(s + p, count);
      lanes[v] = lanes[v] + Vecf::loadu(s + p, count);
    }
  }
  float sums[16];
  for (int64_t v = 0; v < kVecs; ++v) lanes[v].store(sums + v * Vecf::size());
  float sum = 0.f;
  for (int64_t j = 0; j < 16; ++j) sum += sums[j];
  return sum;
}

inline float max_of(const float* s, int64_t n) {  // exact in any order
  Vecf m(-std::numeric_limits<float>::infinity());
  int64_t p = 0;
  for (; p + Vecf::size() <= n; p += Vecf::size()) m = at::vec::maximum(m, Vecf::loadu(s + p));
  float lanes[Vecf::size()];
  m.store(lanes);
  float out = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < Vecf::size(); ++j) out = std::max(out, lanes[j]);
  for (; p < n; ++p) out = std::max(out, s[p]);
  return out;
}

// a[0] = the tree's last three levels over a[0..7] (each a vector of positions, a[r] being
// lanes r + r+8 already): a[r] + a[r+4], then +2, +1.
template <typename V>
inline void sum8_lanes(V* a) {
  for (int64_t w = 4; w >= 1; w /= 2)
    for (int64_t r = 0; r < w; ++r) a[r] = a[r] + a[r + w];
}

#if defined(SLUICE_V16)
// The score tree for 16 positions at once: the additions above, of the same operands
// (so the same bits: IEEE addition is commutative), done across vectors. `a_p` is
// position p's 16 channel lanes; the three steps below, composed as
//   tree16(quad4(pair2(a_p0, a_p1), pair2(a_p2, a_p3)), ... for p = 0..15)
// give the 16 scores in position order.
#if defined(CPU_CAPABILITY_AVX512)
//   pair2:  [a_p0 | a_p1] halves        -> x[r] = a_p0[r] + a_p0[r+8], x[8+r] = a_p1[r] + a_p1[r+8]
//   quad4:  two pair2 results (p0..p3)  -> 128-bit lane i = position p_i's four (+4) sums
//   tree16: four quad4 results          -> lane i (position i) = its score, in position order
using Pair = __m512;
using Quad = __m512;

inline Pair pair2(V16 a0, V16 a1) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xee));
}

inline Quad quad4(Pair x01, Pair x23) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xdd));
}

inline V16 tree16(const Quad* z) {
  // (+2): within each 128-bit lane, [z0 c0, z0 c1, z1 c0, z1 c1] of z0[r] + z0[r+2] ...
  const __m512 v01 = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x44), _mm512_shuffle_ps(z[0], z[1], 0xee));
  const __m512 v23 = _mm512_add_ps(_mm512_shuffle_ps(z[2], z[3], 0x44), _mm512_shuffle_ps(z[2], z[3], 0xee));
  // (+1): 128-bit lane i holds the scores of positions i, 4 + i, 8 + i, 12 + i.
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(v01, v23, 0x88), _mm512_shuffle_ps(v01, v23, 0xdd));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}
#else  // AVX2: a position's lanes are two ymm, lo = lanes 0..7, hi = 8..15
//   pair2:  (+8) lo + hi, then (+4) across 128-bit lanes -> 128-bit lane i = position p_i's four sums
//   quad4:  (+2) within 128-bit lanes -> lane 0: p0's two sums, p2's two; lane 1: p1's, p3's
//   tree16: (+1) -> positions 0, 2, 4, 6 | 1, 3, 5, 7 of each 8, put in order
using Pair = __m256;
using Quad = __m256;

inline Pair pair2(V16 a0, V16 a1) {
  const __m256 x0 = _mm256_add_ps(a0.lo, a0.hi), x1 = _mm256_add_ps(a1.lo, a1.hi);
  return _mm256_add_ps(_mm256_permute2f128_ps(x0, x1, 0x20), _mm256_permute2f128_ps(x0, x1, 0x31));
}

inline Quad quad4(Pair x01, Pair x23) {
  return _mm256_add_ps(_mm256_shuffle_ps(x01, x23, 0x44), _mm256_shuffle_ps(x01, x23, 0xee));
}

inline V16 tree16(const Quad* z) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto eight = [&](Quad a, Quad b) {  // positions 0..3 in a, 4..7 in b
    return _mm256_permutevar8x32_ps(_mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xdd)), order);
  };
  return {eight(z[0], z[1]), eight(z[2], z[3])};
}
#endif

constexpr int64_t kSpanVecs = 16;  // G * D / 16 sums in registers (SmolLM2: 3 * 4)
// Positions ahead whose K / V rows are prefetched into L2; pass 1 fetches V's too, so pass 2
// reads them from cache. (With 8 and K only, SmolLM2's 30 layers of a 16 x 192 decode laid out
// as serving lays it out took 5.3 ms; with 24, V in pass 1 and the next item's rows below, 4.2-4.7
// on a Zen 4, against 1.8 with every row in L3: bench/RESULTS.md item 36. Into L1 at 48 no
// faster than at 24; into L2 at 48 another 5-15%, at 24 or 96 less: item 37.)
constexpr int64_t kSpanAhead = 48;

// K and V rows of positions [t0, t1) of a sequence (slots idx), `bytes` of each from channel
// `off`, into L2 at once: a thread's first work item's, before it starts (a decode item reads a
// few hundred scattered rows; later items' rows come spread over the previous item, SpreadRows).
template <typename KT>
inline void prefetch_span_l2(const KT* kp, const KT* vp, const int64_t* idx, int64_t t0, int64_t t1, int64_t row,
                             int64_t off, int64_t bytes) {
  for (int64_t t = t0; t < t1; ++t) {
    prefetch_row_l2(kp + idx[t] * row + off, bytes);
    prefetch_row_l2(vp + idx[t] * row + off, bytes);
  }
}

// Rows of the next work item to bring into L2 while this span computes: positions [t0, t1)
// of slots idx, `bytes` of each K and V row from channel `off`, a few at each position of
// pass 1 rather than all at once (paged_attention.cpp has the measurements). idx null: none.
struct SpreadRows {
  const int64_t* idx = nullptr;
  int64_t t0 = 0, t1 = 0, off = 0, bytes = 0;
};

// out = the dv vectors at `off` of the row of slot idx[t], widened; prefetches the row
// kSpanAhead positions on (a sequence's slots are anywhere in the pool).
template <typename KT>
__attribute__((always_inline)) inline void load_row(const KT* buf, const int64_t* idx, int64_t t, int64_t len, int64_t row,
                                                    int64_t off, int64_t dv, V16* out) {
  if (t + kSpanAhead < len) prefetch_row_l2(buf + idx[t + kSpanAhead] * row + off, dv * 16 * sizeof(KT));
  const KT* r = buf + idx[t] * row + off;
  for (int64_t j = 0; j < dv; ++j) out[j] = load16(r + 16 * j);
}

// Positions [t0, t1) of one sequence (slots idx) against kv head h, for the G query heads
// that share it (qf: G x D, pre-scaled), K and V read as rows straight from the pool:
// part[g * (D + 2)] = the max score, [+1] = the exp-sum, [+2 ..] = the e-weighted V sums.
// Over a whole sequence (t0 = 0, t1 = len), sums * (1 / exp-sum) is the order above.
// G * D / 16 <= kSpanVecs, D % 16 == 0 (the callers check). kG, kDV > 0: G and D / 16 fixed
// at compile time, so the loops over them unroll and q and the V sums stay in registers
// (with runtime counts GCC keeps the sums in memory, a load and a store around every FMA).
template <typename KT, int64_t kG = 0, int64_t kDV = 0>
void attend_span(const float* qf, const KT* kp, const KT* vp, const int64_t* idx, int64_t t0, int64_t t1, int64_t row,
                 int64_t h, int64_t G_, int64_t D, std::vector<float>& scores, float* part, const SpreadRows& spread) {
  const int64_t G = kG > 0 ? kG : G_, dv = kDV > 0 ? kDV : D / 16, len = t1 - t0;
  if (static_cast<int64_t>(scores.size()) < G * len) scores.resize(G * len);
  V16 qv[kSpanVecs];
  for (int64_t j = 0; j < G * dv; ++j) qv[j] = v16_loadu(qf + 16 * j);
  // Pass 1: scores[g * len + t] = q_g . k_t, 16 positions at a time: each position's
  // lane vectors as before, their trees side by side (pair2, quad4, tree16). Positions
  // past len score a zero row; their lanes are not stored.
  constexpr int64_t kZ = kG > 0 ? kG : kSpanVecs;
  int64_t next_u = spread.t0;  // spread's rows asked for so far: those before t0 + n (t + 1) / len by position t
  auto lanes = [&](int64_t t, V16* acc) {  // acc[g] = q_g's fma chains against k_t
    V16 kv[kSpanVecs];
    if (t < len) {
      if (spread.idx != nullptr) {
        for (const int64_t u1 = spread.t0 + (spread.t1 - spread.t0) * (t + 1) / len; next_u < u1; ++next_u) {
          prefetch_row_l2(kp + spread.idx[next_u] * row + spread.off, spread.bytes);
          prefetch_row_l2(vp + spread.idx[next_u] * row + spread.off, spread.bytes);
        }
      }
      load_row(kp, idx + t0, t, len, row, h * D, dv, kv);
      if (t + kSpanAhead < len) prefetch_row_l2(vp + idx[t0 + t + kSpanAhead] * row + h * D, dv * 16 * sizeof(KT));
    } else {
      for (int64_t j = 0; j < dv; ++j) kv[j] = v16_zero();
    }
    for (int64_t g = 0; g < G; ++g) {
      acc[g] = v16_zero();
      for (int64_t j = 0; j < dv; ++j) acc[g] = v16_fma(qv[g * dv + j], kv[j], acc[g]);
    }
  };
  for (int64_t p0 = 0; p0 < len; p0 += 16) {
    Quad z[kZ][4];
    for (int64_t s = 0; s < 4; ++s) {
      Pair x01[kZ];
      V16 a0[kZ], a1[kZ];
      const int64_t t = p0 + 4 * s;
      lanes(t, a0);
      lanes(t + 1, a1);
      for (int64_t g = 0; g < G; ++g) x01[g] = pair2(a0[g], a1[g]);
      lanes(t + 2, a0);
      lanes(t + 3, a1);
      for (int64_t g = 0; g < G; ++g) z[g][s] = quad4(x01[g], pair2(a0[g], a1[g]));
    }
    for (int64_t g = 0; g < G; ++g) v16_store_first(scores.data() + g * len + p0, tree16(z[g]), len - p0);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * len;
    const float m = max_of(sg, len);
    part[g * (D + 2)] = m;
    part[g * (D + 2) + 1] = exp_and_sum(sg, len, m);
  }
  // Pass 2: the e-weighted sum of V rows, every head's sums in registers.
  V16 acc[kSpanVecs];
  for (int64_t j = 0; j < G * dv; ++j) acc[j] = v16_zero();
  for (int64_t t = 0; t < len; ++t) {
    V16 vv[kSpanVecs];
    load_row(vp, idx + t0, t, len, row, h * D, dv, vv);
    for (int64_t g = 0; g < G; ++g) {
      const V16 e = v16_set1(scores[g * len + t]);
      for (int64_t j = 0; j < dv; ++j) acc[g * dv + j] = v16_fma(e, vv[j], acc[g * dv + j]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < dv; ++j) v16_storeu(part + g * (D + 2) + 2 + 16 * j, acc[g * dv + j]);
}

// attend_span with G and D / 16 fixed at compile time where a known model's heads allow:
// SmolLM2 (3 query heads a kv head) and Llama 3.2 1B (4), head_dim 64.
template <typename KT>
inline auto pick_attend_span(int64_t G, int64_t D) {
  return G == 3 && D == 64 ? attend_span<KT, 3, 4> : G == 4 && D == 64 ? attend_span<KT, 4, 4> : attend_span<KT>;
}
#endif

}  // namespace sluice
