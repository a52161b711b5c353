// Paged decode attention on CPU: one query token per sequence, keys and values
// read in place from the token-indexed KV pool (no gather copy, no padding).
//
// q:      [n, Hq, D]          k_buf, v_buf: [slots, Hkv, D] (contiguous)
// kv_idx: [n, max_len] int64  slot of each position (only the first lens[i] are read)
// lens:   [n] int64           out: [n, Hq, D] (q's dtype)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode_kernel(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                          const at::Tensor& kv_idx, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_buf.size(1);
  const int64_t G = Hq / Hkv, max_len = kv_idx.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_buf.data_ptr<T>();
  const T* vp = v_buf.data_ptr<T>();
  const int64_t* ip = kv_idx.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, n * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, kf(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / Hkv, h = item % Hkv, len = lp[i];
      const int64_t* idx = ip + i * max_len;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(qp[(i * Hq + h * G + g) * D + d]) * fscale;
      scores.assign(G * len, 0.f);
      // Pass 1: scores q.k for every position (each K row read once).
      for (int64_t t = 0; t < len; ++t) {
        const T* krow = kp + (idx[t] * Hkv + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(krow[d]);
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          const float* qg = qf.data() + g * D;
          // Without the simd reduction the compiler keeps one serial FMA chain.
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * len + t] = s;
        }
      }
      // Softmax per query head.
      std::vector<float> inv_sum(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        inv_sum[g] = 1.f / sum;
      }
      // Pass 2: weighted sum of V rows (each V row read once).
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* vrow = vp + (idx[t] * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(vrow[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * kf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(i * Hq + h * G + g) * D + d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
    }
  });
}

at::Tensor paged_decode(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_idx, at::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3, "q, k_buf, v_buf must be 3-D");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && k_buf.scalar_type() == v_buf.scalar_type(), "dtype mismatch");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "KV buffers must be contiguous");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "Hq must be a multiple of Hkv");
  q = q.contiguous();
  kv_idx = kv_idx.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q, k_buf, v_buf, kv_idx, lens, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
}
