// Paged decode attention on CPU: one query token per sequence, keys and values
// read in place from the token-indexed KV pool (no gather copy, no padding).
//
// q:      [n, Hq, D]          k_buf, v_buf: [slots, Hkv, D] (contiguous; q's dtype,
//                             or bfloat16/float16 under a float32 q: a narrower KV
//                             cache halves the bytes read, which bound this kernel)
// kv_idx: [n, max_len] int64  slot of each position (only the first lens[i] are read)
// lens:   [n] int64           out: [n, Hq, D] (q's dtype)
//
// Vector path (AVX-512 or AVX2, D a multiple of 16): one work item is one sequence, one kv
// head and one span of its positions; the G = Hq / Hkv query heads that share the kv head are
// scored together, so each K and V row is read once, as D / 16 vectors, straight from the pool.
// A sequence's positions are split into spans only when there are fewer (sequence, kv
// head) pairs than threads (a single stream's step would otherwise leave cores idle);
// each span keeps its own max, exp-sum and weighted V sum, merged at the end as
// flash-decoding does. A span is attention_span.h's attend_span: a sequence not split
// gets the bits paged_attention.cpp gives it, a split one (the merge) does not, so
// deterministic inference uses paged_attention.cpp. Elsewhere a plain loop with the same
// formula.
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

using sluice::to_float;

// One call's shapes and pointers (q [n, Hq, D], the pool's [slots, Hkv, D] rows of `row`
// values, kv_idx [n, max_len], lens [n], out like q), for either kernel below.
template <typename T, typename KT>
struct Decode {
  int64_t n, Hq, D, Hkv, G, max_len, row;
  const T* qp;
  const KT *kp, *vp;
  const int64_t *ip, *lp;
  T* op;
  float fscale;

  Decode(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& kv_idx,
         const at::Tensor& lens, double scale, at::Tensor& out)
      : n(q.size(0)), Hq(q.size(1)), D(q.size(2)), Hkv(k_buf.size(1)), G(Hq / Hkv), max_len(kv_idx.size(1)),
        row(Hkv * D), qp(q.data_ptr<T>()), kp(k_buf.data_ptr<KT>()), vp(v_buf.data_ptr<KT>()),
        ip(kv_idx.data_ptr<int64_t>()), lp(lens.data_ptr<int64_t>()), op(out.data_ptr<T>()),
        fscale(static_cast<float>(scale)) {}
};

template <typename T, typename KT>
static void decode_kernel(const Decode<T, KT>& a) {
  const auto [n, Hq, D, Hkv, G, max_len, row, qp, kp, vp, ip, lp, op, fscale] = a;

  sluice::parallel_for(n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), acc(Hq * D), scores, rf(row), inv_sum(Hq);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t len = lp[i];
      const int64_t* idx = ip + i * max_len;
      for (int64_t j = 0; j < Hq * D; ++j) qf[j] = static_cast<float>(qp[i * Hq * D + j]) * fscale;
      scores.assign(Hq * len, 0.f);  // scores[hq * len + t]
      // Pass 1: q.k for every head and position.
      for (int64_t t = 0; t < len; ++t) {
        to_float(kp + idx[t] * row, rf.data(), row);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* kh = rf.data() + (hq / G) * D;
          const float* qh = qf.data() + hq * D;
          float s = 0.f;
          // Without the simd reduction the compiler keeps one serial FMA chain.
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[hq * len + t] = s;
        }
      }
      // Softmax per query head.
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float* sh = scores.data() + hq * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sh[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sh[t] = std::exp(sh[t] - m); sum += sh[t]; }
        inv_sum[hq] = 1.f / sum;
      }
      // Pass 2: probability-weighted sum of V rows.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        to_float(vp + idx[t] * row, rf.data(), row);
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float p = scores[hq * len + t];
          const float* vh = rf.data() + (hq / G) * D;
          float* ah = acc.data() + hq * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq)
        for (int64_t d = 0; d < D; ++d)
          op[(i * Hq + hq) * D + d] = static_cast<T>(acc[hq * D + d] * inv_sum[hq]);
    }
  });
}

#if defined(SLUICE_V16)
namespace {

constexpr int64_t kMinSpan = 32;  // positions a span is worth splitting for

template <typename T, typename KT>
void decode_spans(const Decode<T, KT>& a) {
  const auto [n, Hq, D, Hkv, G, max_len, row, qp, kp, vp, ip, lp, op, fscale] = a;
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) longest = std::max(longest, lp[i]);
  // Spans per (sequence, kv head): enough items for every thread, none under kMinSpan.
  const int64_t threads = sluice::SpinPool::get().threads();
  const int64_t spans = std::max<int64_t>(1, std::min((threads + n * Hkv - 1) / (n * Hkv), longest / kMinSpan));
  const int64_t stride = G * (D + 2);  // one span's partial result
  std::vector<float> parts(n * Hkv * spans * stride);
  sluice::parallel_for(n * Hkv * spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores;
    // Item w: sequence i, kv head h, positions [t0, t1) of its len.
    auto item = [&](int64_t w) {
      const int64_t i = w / (Hkv * spans), h = (w / spans) % Hkv, s = w % spans, len = lp[i];
      return std::array<int64_t, 4>{i, h, len * s / spans, len * (s + 1) / spans};
    };
    for (int64_t w = begin; w < end; ++w) {
      const auto [i, h, t0, t1] = item(w);
      const int64_t bytes = D * static_cast<int64_t>(sizeof(KT));
      if (w == begin) sluice::prefetch_span_l2(kp, vp, ip + i * max_len, t0, t1, row, h * D, bytes);
      sluice::SpreadRows spread;  // the next item's rows, fetched across this one's pass 1 (as paged_attention's)
      if (w + 1 < end) {
        const auto [ni, nh, n0, n1] = item(w + 1);
        spread = {ip + ni * max_len, n0, n1, nh * D, bytes};
      }
      float* part = parts.data() + w * stride;
      if (t0 == t1) {  // an empty span: adds nothing to the merge
        for (int64_t g = 0; g < G; ++g) part[g * (D + 2)] = -std::numeric_limits<float>::infinity();
        continue;
      }
      for (int64_t j = 0; j < G * D; ++j) qf[j] = static_cast<float>(qp[(i * Hq + h * G) * D + j]) * fscale;
      sluice::pick_attend_span<KT>(G, D)(qf.data(), kp, vp, ip + i * max_len, t0, t1, row, h, G, D, scores, part, spread);
    }
  });
  // Merge the spans of each (sequence, query head): rescale to the common max.
  std::vector<float> o(D);
  for (int64_t ih = 0; ih < n * Hkv; ++ih) {
    const float* first = parts.data() + ih * spans * stride;
    for (int64_t g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < spans; ++s) m = std::max(m, first[s * stride + g * (D + 2)]);
      float sum = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t s = 0; s < spans; ++s) {
        const float* p = first + s * stride + g * (D + 2);
        if (p[0] == -std::numeric_limits<float>::infinity()) continue;
        const float w = spans == 1 ? 1.f : std::exp(p[0] - m);
        sum += w * p[1];
        for (int64_t d = 0; d < D; ++d) o[d] += w * p[2 + d];
      }
      const float inv = 1.f / sum;
      T* dst = op + (ih * G + g) * D;  // (i, h * G + g) = ih * G + g: q heads of kv head h are consecutive
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
    }
  }
}

}  // namespace
#endif

// The vector kernel (AVX-512 or AVX2) where its registers fit the heads (and the values
// are not float64), else the plain loop.
template <typename T, typename KT>
void decode(const Decode<T, KT>& a) {
#if defined(SLUICE_V16)
  if constexpr (!std::is_same_v<KT, double>) {
    if (a.D % 16 == 0 && a.G * (a.D / 16) <= sluice::kSpanVecs) return decode_spans(a);
  }
#endif
  decode_kernel(a);
}

at::Tensor paged_decode(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_idx, at::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q, k_buf, v_buf must be 3-D");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "K and V buffers differ in dtype");
  const bool narrow_kv = q.scalar_type() == at::kFloat &&
                         (k_buf.scalar_type() == at::kBFloat16 || k_buf.scalar_type() == at::kHalf);
  if (q.scalar_type() != k_buf.scalar_type() && !narrow_kv)  // e.g. a bfloat16 model over a float16 cache
    return paged_decode(q.to(at::kFloat), k_buf, v_buf, kv_idx, lens, scale).to(q.scalar_type());
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "KV buffers must be contiguous");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "Hq must be a multiple of Hkv");
  q = q.contiguous();
  kv_idx = kv_idx.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  TORCH_CHECK(kv_idx.dim() == 2 && kv_idx.size(0) == q.size(0) && lens.numel() == q.size(0), "one kv_idx row and len per query");
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < q.size(0); ++i)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= kv_idx.size(1), "lens[", i, "] = ", lp[i], " outside [1, ", kv_idx.size(1), "]");
  auto out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  if (k_buf.scalar_type() == at::kBFloat16 && narrow_kv) {
    decode(Decode<float, at::BFloat16>(q, k_buf, v_buf, kv_idx, lens, scale, out));
  } else if (k_buf.scalar_type() == at::kHalf && narrow_kv) {
    decode(Decode<float, at::Half>(q, k_buf, v_buf, kv_idx, lens, scale, out));
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
      decode(Decode<scalar_t, scalar_t>(q, k_buf, v_buf, kv_idx, lens, scale, out));
    });
  }
  return out;
}
