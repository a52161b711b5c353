// Paged decode attention on CPU: one query token per sequence, keys and values
// read in place from the token-indexed KV pool (no gather copy, no padding).
//
// q:      [n, Hq, D]          k_buf, v_buf: [slots, Hkv, D] (contiguous; q's dtype,
//                             or bfloat16/float16 under a float32 q: a narrower KV
//                             cache halves the bytes read, which bound this kernel)
// kv_idx: [n, max_len] int64  slot of each position (only the first lens[i] are read)
// lens:   [n] int64           out: [n, Hq, D] (q's dtype)
//
// One work item is one sequence, all heads: a slot's K (then V) row, Hkv*D
// contiguous values, is read once and in full, so consecutive slots stream
// through memory instead of being visited head by head at a stride.
//
// The fastest decode; its sums are not the per-query order of paged_attention.cpp,
// which deterministic inference uses for decodes too (a token decoded here and the
// same token recomputed by an extend would differ in the last bits).
#include "spin_pool.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// Widen one K/V row to float. bfloat16 is the high half of a float: a shift the
// compiler vectorizes (c10's conversion operator it does not).
template <typename KT>
static inline void to_float(const KT* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

template <>
inline void to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<uint32_t>(bits[j]) << 16;
}

template <typename T, typename KT>
static void decode_kernel(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                          const at::Tensor& kv_idx, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_buf.size(1);
  const int64_t G = Hq / Hkv, max_len = kv_idx.size(1), row = Hkv * D;
  const T* qp = q.data_ptr<T>();
  const KT* kp = k_buf.data_ptr<KT>();
  const KT* vp = v_buf.data_ptr<KT>();
  const int64_t* ip = kv_idx.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

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

at::Tensor paged_decode(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_idx, at::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q, k_buf, v_buf must be 3-D");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "K and V buffers differ in dtype");
  const bool narrow_kv = q.scalar_type() == at::kFloat &&
                         (k_buf.scalar_type() == at::kBFloat16 || k_buf.scalar_type() == at::kHalf);
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() || narrow_kv, "unsupported q/KV dtype pair");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "KV buffers must be contiguous");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "Hq must be a multiple of Hkv");
  q = q.contiguous();
  kv_idx = kv_idx.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  auto out = at::empty_like(q);
  if (k_buf.scalar_type() == at::kBFloat16 && narrow_kv) {
    decode_kernel<float, at::BFloat16>(q, k_buf, v_buf, kv_idx, lens, scale, out);
  } else if (k_buf.scalar_type() == at::kHalf && narrow_kv) {
    decode_kernel<float, at::Half>(q, k_buf, v_buf, kv_idx, lens, scale, out);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
      decode_kernel<scalar_t, scalar_t>(q, k_buf, v_buf, kv_idx, lens, scale, out);
    });
  }
  return out;
}
