// Paged attention on CPU for deterministic inference: every query token, decode or
// extend, computed on its own from K/V read in place from the token-indexed KV pool.
//
// q:         [T, Hq, D]        k_buf, v_buf: [slots, Hkv, D] (contiguous; q's dtype,
//                              or bfloat16/float16 under a float32 q: a narrower KV
//                              cache halves the bytes read)
// kv_idx:    [R, max_len] int64 slot of each position of request row r
// token_req: [T] int64         the kv_idx row query t reads
// lens:      [T] int64         query t attends to positions [0, lens[t])
// out:       [T, Hq, D] (q's dtype)
//
// A decode step is the case T = R, token_req = arange(R): one new token per request.
// An extend (prefill) is T queries of one request, query j attending to the cached
// prefix and the new tokens up to itself (lens = prefix + j + 1).
//
// Batch invariance (what --enable-deterministic-inference relies on): query t's
// output is a function of q[t], its lens[t] K/V rows and nothing else, computed by
// attention_span.h's arithmetic whatever T, the other queries or the thread count. So a
// token computed in a decode step, in a prefill, alone, in a batch of 200 or in a chunk
// after a cached prefix gets the same bits (and paged_decode.cpp gives a sequence it
// does not split the same bits too).
//
// Work items are blocks of up to kQueries consecutive queries of one request (a
// decode step: one query per block), each with all kv heads, or each kv head of a block on
// its own in a decode step and where there are fewer blocks than threads: the per-query
// arithmetic is the same either way, only which thread does it changes.
// A block of one query (AVX-512 or AVX2) reads its K and V rows in place (attend_span). A longer
// block goes in tiles of 16 positions: the tile's K rows (the item's kv heads) are
// widened and transposed once ([heads][D][16]) and serve every query and head of the
// item, a score's 16 channel lanes being 16 vectors over the tile's positions.
#include "attention_span.h"
#include "cpu_common.h"
#include "spin_pool.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kTile = 16;     // positions per K tile (and lanes of a partial sum)
constexpr int64_t kQueries = 8;  // queries of one request per work item (16: their scores left L2 from ~1k positions)
constexpr int64_t kAhead = 8;     // positions ahead whose K / V rows are prefetched

using sluice::exp_and_sum;
using sluice::max_of;
using sluice::to_float;

// A float KV row is read in place; a narrower one is widened into `scratch`.
template <typename KT>
inline const float* row_as_float(const KT* src, float* scratch, int64_t n) {
  to_float(src, scratch, n);
  return scratch;
}

template <>
inline const float* row_as_float<float>(const float* src, float*, int64_t) {
  return src;
}

constexpr int64_t kAccVecs = 16;  // output vectors accumulated in registers at once

#if defined(CPU_CAPABILITY_AVX512)
// dst[c * 16 + p] = the K row of slot idx[p] at channel c, widened, for p < width (zeros
// after), channels c < len of rows `row` apart (len % 16 == 0): 16 x 16 blocks transposed in
// registers (unpack 32-bit, unpack 64-bit, two 128-bit lane shuffles) instead of 16 * row
// scalar stores. Data movement only: the same floats as the scalar path.
template <typename KT>
void transpose_rows(const KT* kp, const int64_t* idx, int64_t width, int64_t row, int64_t len, float* dst) {
  for (int64_t c0 = 0; c0 < len; c0 += 16) {
    __m512 r[16];
    for (int64_t p = 0; p < 16; ++p) r[p] = p < width ? sluice::load16(kp + idx[p] * row + c0) : _mm512_setzero_ps();
    // s[4 g + c]: 128-bit lane L holds channel 4 L + c of positions 4 g .. 4 g + 3.
    __m512 s[16];
    for (int64_t g = 0; g < 4; ++g) {
      const __m512d lo01 = _mm512_castps_pd(_mm512_unpacklo_ps(r[4 * g], r[4 * g + 1]));
      const __m512d hi01 = _mm512_castps_pd(_mm512_unpackhi_ps(r[4 * g], r[4 * g + 1]));
      const __m512d lo23 = _mm512_castps_pd(_mm512_unpacklo_ps(r[4 * g + 2], r[4 * g + 3]));
      const __m512d hi23 = _mm512_castps_pd(_mm512_unpackhi_ps(r[4 * g + 2], r[4 * g + 3]));
      s[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo01, lo23));
      s[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo01, lo23));
      s[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi01, hi23));
      s[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi01, hi23));
    }
    for (int64_t c = 0; c < 4; ++c) {
      // u: lanes 0, 2 of each (channels c, 8 + c); v: lanes 1, 3 (4 + c, 12 + c).
      const __m512 u01 = _mm512_shuffle_f32x4(s[c], s[4 + c], 0x88), v01 = _mm512_shuffle_f32x4(s[c], s[4 + c], 0xdd);
      const __m512 u23 = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0x88), v23 = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0xdd);
      _mm512_storeu_ps(dst + (c0 + c) * 16, _mm512_shuffle_f32x4(u01, u23, 0x88));
      _mm512_storeu_ps(dst + (c0 + 8 + c) * 16, _mm512_shuffle_f32x4(u01, u23, 0xdd));
      _mm512_storeu_ps(dst + (c0 + 4 + c) * 16, _mm512_shuffle_f32x4(v01, v23, 0x88));
      _mm512_storeu_ps(dst + (c0 + 12 + c) * 16, _mm512_shuffle_f32x4(v01, v23, 0xdd));
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// acc + q * k with q, the float at `q`, broadcast by the FMA itself ({1to16}): GCC emits a
// separate vbroadcastss per FMA for _mm512_set1_ps of a load, and with it reloaded each K
// vector once per head. The same single rounding as _mm512_fmadd_ps(set1(q), k, acc).
inline __m512 fma_q(__m512 acc, __m512 k, const float* q) {
  asm("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(k), "m"(*q));
  return acc;
}
#endif

// The V sums of `heads` query heads over positions [0, len): out[g * dv * W + c] = the fma
// chain over p, in order, of e[g * span + p] * V_p[off + c] (W = Vec::size()). kH, kDV > 0:
// counts fixed at compile time, so the sums stay in registers (with runtime counts GCC
// keeps them in memory, a load and a store around every FMA); the same operations.
template <int64_t kH = 0, int64_t kDV = 0>
void v_sums(const float* e, int64_t span, const float* const* vrows, int64_t off, int64_t len, int64_t heads_,
            int64_t dv_, float* out) {
  const int64_t heads = kH > 0 ? kH : heads_, dv = kDV > 0 ? kDV : dv_;
  Vec acc[kAccVecs];
  for (int64_t a = 0; a < heads * dv; ++a) acc[a] = Vec(0.f);
  for (int64_t p = 0; p < len; ++p) {
    const float* vh = vrows[p] + off;
    for (int64_t g = 0; g < heads; ++g) {
      const Vec ep(e[g * span + p]);
      for (int64_t v = 0; v < dv; ++v) acc[g * dv + v] = at::vec::fmadd(ep, Vec::loadu(vh + v * Vec::size()), acc[g * dv + v]);
    }
  }
  for (int64_t a = 0; a < heads * dv; ++a) acc[a].store(out + a * Vec::size());
}

// One (query, head)'s scores over a K tile of 16 positions (kh: [D][16], transposed):
// lane r's fma chain over channel groups j = 0 .. D/16 - 1 of q[16 j + r] * k[16 j + r]
// (positions across the vector), added to lane r + 8's as both finish (the tree's first
// level, 8 sums live instead of 16), then the tree's last three levels (sum8_lanes). AVX2
// builds and head groups other than tile_scores_heads' take this.
inline void tile_scores(const float* qd, const float* kh, float* dst, int64_t width, int64_t D) {
  constexpr int64_t kVecs = kTile / Vec::size();
  constexpr int64_t kHalf = sluice::kScoreLanes / 2;
  for (int64_t v = 0; v < kVecs; ++v) {
    Vec lane[kHalf];
    for (int64_t r = 0; r < kHalf; ++r) {
      Vec lo(0.f), hi(0.f);
      for (int64_t c0 = 0; c0 < D; c0 += sluice::kScoreLanes) {
        const float* kc = kh + (c0 + r) * kTile + v * Vec::size();
        lo = at::vec::fmadd(Vec(qd[c0 + r]), Vec::loadu(kc), lo);
        hi = at::vec::fmadd(Vec(qd[c0 + r + kHalf]), Vec::loadu(kc + kHalf * kTile), hi);
      }
      lane[r] = lo + hi;
    }
    sluice::sum8_lanes(lane);
    const int64_t p = v * Vec::size();  // (a masked store: std::copy of a few floats became `rep movs`)
    if (p < width) lane[0].store(dst + p, std::min<int64_t>(Vec::size(), width - p));
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// For lanes R0 and R0 + 4 of the kG heads (query head g's q at qd + g * 16 kDV): y[g] =
// x_R0 + x_{R0+4}, each x_r = lo_r + hi_r from tile_scores' chains, each K vector loaded
// once for the kG heads.
template <int64_t kG, int64_t kDV, int64_t R0>
inline void tile_pair(const float* qd, const float* kh, __m512* y) {
  constexpr int64_t kHalf = sluice::kScoreLanes / 2, kD = sluice::kScoreLanes * kDV;
  __m512 lo[2][kG], hi[2][kG];
  for (int64_t e = 0; e < 2; ++e)
    for (int64_t g = 0; g < kG; ++g) lo[e][g] = hi[e][g] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t j = 0; j < kDV; ++j) {
    for (int64_t e = 0; e < 2; ++e) {
      const int64_t c = sluice::kScoreLanes * j + R0 + 4 * e;
      const __m512 k_lo = _mm512_loadu_ps(kh + c * kTile), k_hi = _mm512_loadu_ps(kh + (c + kHalf) * kTile);
      for (int64_t g = 0; g < kG; ++g) {
        lo[e][g] = fma_q(lo[e][g], k_lo, qd + g * kD + c);
        hi[e][g] = fma_q(hi[e][g], k_hi, qd + g * kD + c + kHalf);
      }
    }
  }
  for (int64_t g = 0; g < kG; ++g)
    y[g] = _mm512_add_ps(_mm512_add_ps(lo[0][g], hi[0][g]), _mm512_add_ps(lo[1][g], hi[1][g]));
}

// tile_scores for the kG query heads that share a kv head at once (kh: that head's tile),
// query head g's scores at dst + g * stride. The tree's additions in sum8_lanes' order:
// y_r = x_r + x_{r+4}, then (y_0 + y_2) + (y_1 + y_3).
template <int64_t kG, int64_t kDV>
inline void tile_scores_heads(const float* qd, const float* kh, float* dst, int64_t stride, int64_t width) {
  __m512 y0[kG], y2[kG], y1[kG], y3[kG];
  tile_pair<kG, kDV, 0>(qd, kh, y0);
  tile_pair<kG, kDV, 2>(qd, kh, y2);
  tile_pair<kG, kDV, 1>(qd, kh, y1);
  tile_pair<kG, kDV, 3>(qd, kh, y3);
  const __mmask16 keep = static_cast<__mmask16>(width >= kTile ? 0xFFFF : (1u << width) - 1);
  for (int64_t g = 0; g < kG; ++g)
    _mm512_mask_storeu_ps(dst + g * stride, keep, _mm512_add_ps(_mm512_add_ps(y0[g], y2[g]), _mm512_add_ps(y1[g], y3[g])));
}
#endif

template <typename T, typename KT>
void attention_kernel(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& kv_idx,
                      const at::Tensor& token_req, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_buf.size(1);
  const int64_t G = Hq / Hkv, max_len = kv_idx.size(1), row = Hkv * D;
  const int64_t dvecs = D / Vec::size();  // D % Vec::size() == 0: checked by the caller
  const int64_t heads_per_pass = std::max<int64_t>(1, std::min(G, kAccVecs / dvecs));
  const T* qp = q.data_ptr<T>();
  const KT* kp = k_buf.data_ptr<KT>();
  const KT* vp = v_buf.data_ptr<KT>();
  const int64_t* ip = kv_idx.data_ptr<int64_t>();
  const int64_t* rp = token_req.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  // Work items: runs of up to kQueries consecutive queries reading the same request.
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || rp[i] != rp[i - 1] || i - starts.back() == kQueries) starts.push_back(i);
  starts.push_back(n);
  const int64_t blocks = static_cast<int64_t>(starts.size()) - 1;
  // Block order 0, last, 1, last-1, ...: each thread's contiguous range then mixes an
  // extend's short (early) and long (late) queries.
  auto order = [blocks](int64_t b) { return (b % 2 == 0) ? b / 2 : blocks - 1 - b / 2; };
  // kv heads an item takes: all of them (more (query, head) fma chains in flight), but one
  // where that would leave threads idle, and in a decode step (every block one query, each
  // kv head its own attend_span pass anyway): three times the items to share between the
  // threads, each prefetching the next's rows for one head (a 16-row SmolLM2 step -1.5 to
  // -1.8%, in-process A/B on a Zen 4; bench/RESULTS.md item 44).
  const int64_t hn = blocks < sluice::SpinPool::get().threads() || blocks == n ? 1 : Hkv, hgn = hn * G;

  // A request read by several blocks (an extend of more than kQueries tokens) has its
  // K tiles transposed once, up front, into `shared`; others transpose as they go.
  const int64_t tile_size = Hkv * D * kTile;  // [Hkv][D][16]: kv head h's part at h * D * 16
  std::vector<int64_t> shared_at(blocks, -1);  // block -> first tile of its request in `shared`
  std::vector<std::array<int64_t, 3>> shared_tiles;  // (request row, tile start, request's span)
  for (int64_t w = 0; w < blocks;) {
    int64_t last = w, span = 0;
    while (last + 1 < blocks && rp[starts[last + 1]] == rp[starts[w]]) ++last;
    if (last > w) {
      for (int64_t i = starts[w]; i < starts[last + 1]; ++i) span = std::max(span, lp[i]);
      for (int64_t x = w; x <= last; ++x) shared_at[x] = static_cast<int64_t>(shared_tiles.size());
      for (int64_t t0 = 0; t0 < span; t0 += kTile) shared_tiles.push_back({rp[starts[w]], t0, span});
    }
    w = last + 1;
  }
  std::vector<float> shared(shared_tiles.size() * tile_size);
  // Channels [off, off + len) of a tile's K rows -> dst [len][16] (dst[(h * D + d) * 16 + p]).
  auto transpose_tile = [&](int64_t req, int64_t t0, int64_t span, int64_t off, int64_t len, float* dst,
                            float* scratch) {
    const int64_t* idx = ip + req * max_len;
    const int64_t width = std::min(kTile, span - t0);
    const KT* kh = kp + off;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (!std::is_same_v<KT, double>) {
      if (len % 16 == 0) {
        for (int64_t p = t0 + kTile; p < std::min(span, t0 + 2 * kTile); ++p)  // the next tile's rows
          sluice::prefetch_row(kh + idx[p] * row, len * sizeof(KT));
        transpose_rows(kh, idx + t0, width, row, len, dst);
        return;
      }
    }
#endif
    if (width < kTile) std::fill(dst, dst + len * kTile, 0.f);  // lanes past the end: finite
    for (int64_t p = 0; p < width; ++p) {
      if (t0 + p + kAhead < span) sluice::prefetch_row(kh + idx[t0 + p + kAhead] * row, len * sizeof(KT));
      const float* kr = row_as_float(kh + idx[t0 + p] * row, scratch, len);
      for (int64_t c = 0; c < len; ++c) dst[c * kTile + p] = kr[c];
    }
  };
  sluice::parallel_for(static_cast<int64_t>(shared_tiles.size()), 4, [&](int64_t begin, int64_t end) {
    std::vector<float> rf(row);
    for (int64_t t = begin; t < end; ++t) {
      const auto [req, t0, span] = shared_tiles[t];
      transpose_tile(req, t0, span, 0, row, shared.data() + t * tile_size, rf.data());
    }
  });

  // Item i: block order(i / (Hkv / hn)), kv heads h0 .. h0 + hn - 1 with h0 = i % (Hkv / hn) * hn;
  // below, "head" hl is the item's query head h0 G + hl and kv head hl / G its kv head h0 + hl / G.
  sluice::parallel_for(blocks * (Hkv / hn), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(kQueries * hgn * D), kt(hn * D * kTile), rf(row), scores, vf, part(G * (D + 2));
    std::vector<float> inv_sum(kQueries * hgn), o(kAccVecs * Vec::size());
    std::vector<const float*> vrows;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t w = order(item / (Hkv / hn)), h0 = item % (Hkv / hn) * hn;
      const int64_t first = starts[w], nq = starts[w + 1] - first;
      const int64_t* idx = ip + rp[first] * max_len;
      int64_t span = 0;  // positions the block reads: the longest query's
      for (int64_t j = 0; j < nq; ++j) span = std::max(span, lp[first + j]);
      for (int64_t j = 0; j < nq; ++j)
        for (int64_t c = 0; c < hgn * D; ++c)
          qf[j * hgn * D + c] = static_cast<float>(qp[((first + j) * Hq + h0 * G) * D + c]) * fscale;
#if defined(SLUICE_V16)
      // One query (a decode): its K and V rows read once each, as rows, no tile.
      if constexpr (!std::is_same_v<KT, double>) {
        if (nq == 1 && shared_at[w] < 0 && G * (D / 16) <= sluice::kSpanVecs) {
          const auto attend = sluice::pick_attend_span<KT>(G, D);
          // At a thread's first item its own rows into L2, all asked for at once; then, while an
          // item computes, the next item's (a decode's), spread over its heads' pass 1: a burst of
          // ~2000 prefetches at the item's start overflows the miss queues and most are dropped
          // (30 layers of a 16 x 192 decode as serving lays it out: 4.1-4.5 ms burst, 3.1-3.5
          // spread over the three heads, 4.1-5.1 over the first head's pass 1 alone, 3.8-4.6 over
          // pass 1 and 2; bench/RESULTS.md item 39).
          const int64_t bytes = hn * D * static_cast<int64_t>(sizeof(KT));
          if (item == begin) sluice::prefetch_span_l2(kp, vp, idx, 0, span, row, h0 * D, bytes);
          sluice::SpreadRows spread;
          if (item + 1 < end) {
            const int64_t nw = order((item + 1) / (Hkv / hn)), nfirst = starts[nw];
            if (starts[nw + 1] - nfirst == 1)
              spread = {ip + rp[nfirst] * max_len, 0, lp[nfirst], (item + 1) % (Hkv / hn) * hn * D, bytes};
          }
          for (int64_t h = 0; h < hn; ++h) {
            sluice::SpreadRows part_h = spread;  // head h's pass 1 fetches its share of the next item's rows
            part_h.t0 = spread.t1 * h / hn;
            part_h.t1 = spread.t1 * (h + 1) / hn;
            attend(qf.data() + h * G * D, kp, vp, idx, 0, span, row, h0 + h, G, D, scores, part.data(), part_h);
            for (int64_t g = 0; g < G; ++g) {
              const float* pg = part.data() + g * (D + 2);
              const float inv = 1.f / pg[1];
              T* dst = op + (first * Hq + (h0 + h) * G + g) * D;
              for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(pg[2 + d] * inv);
            }
          }
          continue;
        }
      }
#endif
      // scores[(j * hgn + hl) * span + p], written for every p < the query's length before it is read
      if (static_cast<int64_t>(scores.size()) < nq * hgn * span) scores.resize(nq * hgn * span);

      // Pass 1: scores, one tile of 16 positions at a time: for each (query, head), 16
      // channel-lane vectors over the tile's positions, then attention_span.h's tree.
      for (int64_t t0 = 0; t0 < span; t0 += kTile) {
        const int64_t width = std::min(kTile, span - t0);
        const float* ktile = kt.data();  // [hn][D][16]
        if (shared_at[w] >= 0) {
          ktile = shared.data() + (shared_at[w] + t0 / kTile) * tile_size + h0 * D * kTile;
        } else {
          transpose_tile(rp[first], t0, span, h0 * D, hn * D, kt.data(), rf.data());
        }
        for (int64_t j = 0; j < nq; ++j) {
          if (lp[first + j] <= t0) continue;
#if defined(CPU_CAPABILITY_AVX512)
          if (D == 64 && (G == 3 || G == 4)) {  // SmolLM2, Llama 3.2 1B
            const auto heads = G == 3 ? tile_scores_heads<3, 4> : tile_scores_heads<4, 4>;
            for (int64_t h = 0; h < hn; ++h)
              heads(qf.data() + (j * hgn + h * G) * D, ktile + h * D * kTile, scores.data() + (j * hgn + h * G) * span + t0,
                    span, width);
            continue;
          }
#endif
          for (int64_t hl = 0; hl < hgn; ++hl) {
            const float* qd = qf.data() + (j * hgn + hl) * D;
            const float* kh = ktile + (hl / G) * D * kTile;
            float* dst = scores.data() + (j * hgn + hl) * span + t0;
            tile_scores(qd, kh, dst, width, D);
          }
        }
      }
      // Softmax per query and head, over that query's own positions only.
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t len = lp[first + j];
        for (int64_t hl = 0; hl < hgn; ++hl) {
          float* sh = scores.data() + (j * hgn + hl) * span;
          inv_sum[j * hgn + hl] = 1.f / exp_and_sum(sh, len, max_of(sh, len));
        }
      }
      // Pass 2: out = sum over p, in order, of e[p] * v_p: the query heads sharing a kv
      // head accumulate together, in registers, over that kv head's V rows.
      vrows.resize(span);  // the item's kv heads' part of each V row
      const KT* vh0 = vp + h0 * D;
      if constexpr (std::is_same_v<KT, float>) {
        for (int64_t p = 0; p < span; ++p) vrows[p] = vh0 + idx[p] * row;
      } else {
        vf.resize(span * hn * D);
        for (int64_t p = 0; p < span; ++p) {
          if (p + kAhead < span) sluice::prefetch_row(vh0 + idx[p + kAhead] * row, hn * D * sizeof(KT));
          to_float(vh0 + idx[p] * row, vf.data() + p * hn * D, hn * D);
          vrows[p] = vf.data() + p * hn * D;
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t len = lp[first + j];
        for (int64_t h = 0; h < hn; ++h) {
          for (int64_t g0 = 0; g0 < G; g0 += heads_per_pass) {
            const int64_t heads = std::min(heads_per_pass, G - g0), hq0 = h * G + g0;  // (item-local)
            const auto sums = heads == 3 && dvecs == 4   ? v_sums<3, 4>
                              : heads == 4 && dvecs == 4 ? v_sums<4, 4>
                                                         : v_sums<>;
            sums(scores.data() + (j * hgn + hq0) * span, span, vrows.data(), h * D, len, heads, dvecs, o.data());
            for (int64_t g = 0; g < heads; ++g) {
              const float inv = inv_sum[j * hgn + hq0 + g];
              T* dst = op + ((first + j) * Hq + h0 * G + hq0 + g) * D;
              for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[g * D + d] * inv);
            }
          }
        }
      }
    }
  });
}

}  // namespace

at::Tensor paged_attention(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_idx, at::Tensor token_req,
                           at::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q, k_buf, v_buf must be 3-D");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "K and V buffers differ in dtype");
  const bool narrow_kv = q.scalar_type() == at::kFloat &&
                         (k_buf.scalar_type() == at::kBFloat16 || k_buf.scalar_type() == at::kHalf);
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() || narrow_kv, "unsupported q/KV dtype pair");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "KV buffers must be contiguous");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(token_req.numel() == q.size(0) && lens.numel() == q.size(0), "token_req and lens need one entry per query");
  TORCH_CHECK(q.size(2) % sluice::kScoreLanes == 0 && q.size(2) <= kAccVecs * at::vec::Vectorized<float>::size(),
              "head_dim must be a multiple of 16, at most 16 vectors");
  q = q.contiguous();
  kv_idx = kv_idx.to(at::kLong).contiguous();
  token_req = token_req.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  auto out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  if (k_buf.scalar_type() == at::kBFloat16 && narrow_kv) {
    attention_kernel<float, at::BFloat16>(q, k_buf, v_buf, kv_idx, token_req, lens, scale, out);
  } else if (k_buf.scalar_type() == at::kHalf && narrow_kv) {
    attention_kernel<float, at::Half>(q, k_buf, v_buf, kv_idx, token_req, lens, scale, out);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
      attention_kernel<scalar_t, scalar_t>(q, k_buf, v_buf, kv_idx, token_req, lens, scale, out);
    });
  }
  return out;
}
