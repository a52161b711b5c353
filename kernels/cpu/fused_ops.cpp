// Row-wise ops of a decoder layer fused into one pass each: what a decode step of
// a small model spends its time dispatching, not computing.
//
//   add_rms_norm_  residual += x; out = weight * norm(residual)      (both layer norms)
//   rms_norm       out = weight * norm(x)                            (the first layer's)
//   rotary_        RoPE on the q and k heads of the fused qkv output, in place
//   silu_mul       out = silu(gate) * up over the fused gate|up output
//
// Numerics follow the torch code they replace (runtime/layers/): math in float32,
// each intermediate the torch version rounds to the model dtype rounded here too
// (residual sum, normalized value, silu). Every op is per row: a row's result
// depends on that row only (no cross-row reduction, no M-dependent path), so these
// are batch-invariant by construction.
#include "cpu_common.h"
#include "q4_rows.h"
#include "spin_pool.h"
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// Rows per parallel chunk: enough elements that a thread's share beats its wake-up.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

template <typename T>
inline float rounded(float v) { return static_cast<float>(static_cast<T>(v)); }

// One row of rms_norm_kernel: residual += x (if any); out = weight * norm. buf: H floats.
// One compiled copy (noinline) for the row op and the fused norm-and-quantize below, so
// both give a row the same bits.
template <typename T>
__attribute__((noinline)) void norm_row(const T* xr, T* res, const T* weight, T* o, int64_t H, float eps, float* buf) {
  if (res != nullptr) {
    for (int64_t j = 0; j < H; ++j) {
      const T sum = static_cast<T>(static_cast<float>(xr[j]) + static_cast<float>(res[j]));
      res[j] = sum;
      buf[j] = static_cast<float>(sum);
    }
  } else {
    for (int64_t j = 0; j < H; ++j) buf[j] = static_cast<float>(xr[j]);
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < H; ++j) ss += buf[j] * buf[j];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; ++j) o[j] = static_cast<T>(static_cast<float>(weight[j]) * rounded<T>(buf[j] * inv));
}

template <typename T>
void rms_norm_kernel(const T* x, int64_t x_stride, T* residual, const T* weight, T* out, int64_t rows, int64_t H,
                     float eps) {
  sluice::parallel_for(rows, grain(H), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(H);
    for (int64_t r = begin; r < end; ++r)
      norm_row<T>(x + r * x_stride, residual == nullptr ? nullptr : residual + r * H, weight, out + r * H, H, eps, buf.data());
  });
}

// RoPE on the first `heads` heads of one row at position pos, in place. One compiled copy
// (noinline) for rotary_ and rope_store_kv: a*cos - b*sin may contract to an fma, the
// same way in both.
template <typename T>
__attribute__((noinline)) void rotate_row(T* row, int64_t pos, const float* cache, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  const float* cos = cache + pos * D;  // the cache row is [cos | sin]
  const float* sin = cos + half;
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = row + h * D;
    T* x2 = x1 + half;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float a = static_cast<float>(x1[j]), b = static_cast<float>(x2[j]);
      x1[j] = static_cast<T>(a * cos[j] - b * sin[j]);
      x2[j] = static_cast<T>(b * cos[j] + a * sin[j]);
    }
  }
}

template <typename T>
void rotary_kernel(T* x, int64_t stride, const int64_t* pos, const float* cache, int64_t rows, int64_t heads, int64_t D) {
  sluice::parallel_for(rows, grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rotate_row<T>(x + t * stride, pos[t], cache, heads, D);
  });
}

// One row of silu_mul_kernel: o = silu(gate) * up. g: I floats. One compiled copy, as norm_row.
template <typename T>
__attribute__((noinline)) void silu_row(const T* gr, T* o, int64_t I, float* g) {
  const T* ur = gr + I;
  for (int64_t j = 0; j < I; ++j) g[j] = static_cast<float>(gr[j]);
  // torch's silu: x / (1 + exp(-x)), the same vectorized exp.
  int64_t j = 0;
  for (; j + Vec::size() <= I; j += Vec::size()) {
    const Vec v = Vec::loadu(g + j);
    (v / (Vec(1.f) + v.neg().exp())).store(g + j);
  }
  for (; j < I; ++j) g[j] = g[j] / (1.f + std::exp(-g[j]));
  for (int64_t k = 0; k < I; ++k) o[k] = static_cast<T>(rounded<T>(g[k]) * static_cast<float>(ur[k]));
}

template <typename T>
void silu_mul_kernel(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t I) {
  sluice::parallel_for(rows, grain(I), [&](int64_t begin, int64_t end) {
    std::vector<float> g(I);
    for (int64_t r = begin; r < end; ++r) silu_row<T>(gate_up + r * stride, out + r * I, I, g.data());
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(), "weight: x's dtype, contiguous");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), nullptr, weight.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes(), "residual: contiguous, x's shape");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "one dtype");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), residual.data_ptr<scalar_t>(),
                              weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                              static_cast<float>(eps));
  });
  return out;
}

void rotary_(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin_cache, int64_t heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(heads * head_dim <= qkv.size(1) && head_dim % 2 == 0, "rotated heads must fit the row");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) == head_dim, "cos_sin_cache: float32 [positions, head_dim]");
  auto pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == qkv.size(0), "one position per row");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_", [&] {
    rotary_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.stride(0), pos.data_ptr<int64_t>(),
                            cos_sin_cache.data_ptr<float>(), qkv.size(0), heads, head_dim);
  });
}

at::Tensor silu_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t I = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), gate_up.stride(0), out.data_ptr<scalar_t>(),
                              gate_up.size(0), I);
  });
  return out;
}

// The decode stack's fused layer (decode_stack.cpp): a row op whose output is a Q4 linear's
// input hands each row to that linear's quantization as it finishes it, in one parallel
// pass over the rows (a job per thread, not two, and no [n, K] float32 round trip). Float
// values and quantization are norm_row's / silu_row's and q4_linear's own: the same bits as
// the row op followed by q4_linear.
namespace {

// rows x K values quantized for q4_linear_rows, row r made by fill(r, out, scratch) (K floats
// each) and quantized at once, in one parallel pass over the rows.
template <typename Fill>
sluice::QuantRows quantized_rows(int64_t rows, int64_t K, const Fill& fill) {
  sluice::QuantRows q = sluice::alloc_quant_rows(rows, K);
  sluice::parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out(K), scratch(K);
    for (int64_t r = begin; r < end; ++r) {
      fill(r, out.data(), scratch.data());
      sluice::quantize_row(q, r, out.data());
    }
  });
  return q;
}

}  // namespace

sluice::QuantRows rms_norm_q4(at::Tensor x, std::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "x, weight: float32 (the Q4 linears' activations)");
  const int64_t H = x.size(1);
  TORCH_CHECK(H % sluice::kQuantGroup == 0, "hidden size must be a multiple of 32");
  float* res = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() && residual->scalar_type() == at::kFloat,
                "residual: contiguous float32, x's shape");
    res = residual->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t stride = x.stride(0);
  return quantized_rows(x.size(0), H, [&](int64_t r, float* out, float* buf) {
    norm_row<float>(xp + r * stride, res == nullptr ? nullptr : res + r * H, w, out, H, static_cast<float>(eps), buf);
  });
}

sluice::QuantRows silu_mul_q4(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "gate_up: float32 (the Q4 linears' activations)");
  const int64_t I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0 && I % sluice::kQuantGroup == 0, "gate|up halves: a multiple of 32 wide");
  const float* gp = gate_up.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  return quantized_rows(gate_up.size(0), I, [&](int64_t r, float* out, float* g) { silu_row<float>(gp + r * stride, out, I, g); });
}

namespace {

// d = s cast to D (torch's round to nearest even); with round_src, s = d cast back.
template <typename S, typename D>
inline void store_row(S* s, D* d, int64_t width, bool round_src) {
  for (int64_t j = 0; j < width; ++j) d[j] = static_cast<D>(static_cast<float>(s[j]));
  if (round_src) {
    for (int64_t j = 0; j < width; ++j) s[j] = static_cast<S>(static_cast<float>(d[j]));
  }
}

#if defined(__F16C__)
// float32 -> float16, the default KV cache under a GGUF model: c10::Half's conversion is
// scalar bit arithmetic (a 16-row decode step's K and V took 12 us a layer, 0.4 ms of
// SmolLM2's step); vcvtps2ph rounds the same way (nearest even, float16 subnormals kept).
template <>
inline void store_row<float, at::Half>(float* s, at::Half* d, int64_t width, bool round_src) {
  int64_t j = 0;
  for (; j + 8 <= width; j += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + j), h);
    if (round_src) _mm256_storeu_ps(s + j, _mm256_cvtph_ps(h));
  }
  for (; j < width; ++j) {
    d[j] = static_cast<at::Half>(s[j]);
    if (round_src) s[j] = static_cast<float>(d[j]);
  }
}
#endif

template <typename S, typename D>
void store_rows(S* src, int64_t src_stride, D* dst, const int64_t* loc, int64_t rows, int64_t width, bool round_src) {
  sluice::parallel_for(rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) store_row<S, D>(src + r * src_stride, dst + loc[r] * width, width, round_src);
  });
}

void store_one(at::Tensor& src, at::Tensor& buf, const at::Tensor& loc, bool round_src) {
  TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1 && src.stride(1) == src.size(2), "k, v: [T, H, D], rows of H*D contiguous");
  TORCH_CHECK(buf.is_contiguous() && buf.size(1) == src.size(1) && buf.size(2) == src.size(2), "buffer: [slots, H, D]");
  const int64_t width = src.size(1) * src.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "store_kv_src", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, buf.scalar_type(), "store_kv_dst", [&] {
      store_rows<S, scalar_t>(src.data_ptr<S>(), src.stride(0), buf.data_ptr<scalar_t>(), loc.data_ptr<int64_t>(),
                              src.size(0), width, round_src);
    });
  });
}

}  // namespace

// k_buf[loc[i]] = k[i], v_buf[loc[i]] = v[i], cast to the buffers' dtype (torch's
// rounding): the KV write of one layer, which as two index_put calls cost ~80 us at
// a 16-token decode step. With round_src, k[i] and v[i] then become what the buffers
// hold (rounded to their dtype and back), in the same pass: the values a prefill's
// attention must see, without reading them back (4 casts a layer, 1.8 ms of a 128-token
// prefill).
void store_kv(at::Tensor k_buf, at::Tensor v_buf, at::Tensor loc, at::Tensor k, at::Tensor v, bool round_src) {
  auto idx = loc.to(at::kLong).contiguous();
  TORCH_CHECK(idx.numel() == k.size(0) && idx.numel() == v.size(0), "one slot per token");
  store_one(k, k_buf, idx, round_src);
  store_one(v, v_buf, idx, round_src);
}

// rotary_ then store_kv of a decode batch's fused qkv rows (float32: q heads, k heads, v
// heads), a row at a time in one parallel pass: the decode stack's step between its qkv
// linear and attention (rotate_row and store_row: the same bits as the two ops).
void rope_store_kv(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin_cache, int64_t q_heads, int64_t kv_heads,
                   int64_t head_dim, at::Tensor k_buf, at::Tensor v_buf, at::Tensor loc) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0), q_size = q_heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.size(1) == q_size + 2 * kv_size, "qkv: float32 [n, q | k | v]");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) == head_dim, "cos_sin_cache: float32 [positions, head_dim]");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type() && k_buf.is_contiguous() && v_buf.is_contiguous() &&
                  k_buf.size(1) * k_buf.size(2) == kv_size && v_buf.size(1) * v_buf.size(2) == kv_size,
              "K, V buffers: [slots, kv_heads, head_dim], one dtype");
  auto pos = positions.to(at::kLong).contiguous();
  auto idx = loc.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == rows && idx.numel() == rows, "one position and one slot per row");
  float* x = qkv.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_buf.scalar_type(), "rope_store_kv", [&] {
    scalar_t* kb = k_buf.data_ptr<scalar_t>();
    scalar_t* vb = v_buf.data_ptr<scalar_t>();
    sluice::parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* row = x + r * stride;
        rotate_row<float>(row, pp[r], cache, q_heads + kv_heads, head_dim);
        store_row<float, scalar_t>(row + q_size, kb + ip[r] * kv_size, kv_size, false);
        store_row<float, scalar_t>(row + q_size + kv_size, vb + ip[r] * kv_size, kv_size, false);
      }
    });
  });
}

// x cast to dtype (float32 <-> bfloat16 / float16, torch's round-to-nearest-even) on the
// kernels' own threads: as torch ops on the engine's worker thread, each cast is an
// OpenMP region whose sleeping helper must be woken (~70 us). Two per linear layer of a
// prefill through oneDNN's bfloat16 copies (CPUs without AVX512-BF16; bf16_linear needs none).
at::Tensor cast(at::Tensor x, at::ScalarType dtype) {
  if (x.scalar_type() == dtype) return x;
  x = x.contiguous();
  auto out = at::empty(x.sizes(), x.options().dtype(dtype));
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "cast_src", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "cast_dst", [&] {
      const S* src = x.data_ptr<S>();
      scalar_t* dst = out.data_ptr<scalar_t>();
      constexpr int64_t kChunk = 1024;  // vector-aligned chunks: each a run of at::vec::convert
      sluice::parallel_for((n + kChunk - 1) / kChunk, 16, [&](int64_t begin, int64_t end) {
        const int64_t from = begin * kChunk, to = std::min(n, end * kChunk);
        at::vec::convert(src + from, dst + from, to - from);
      });
    });
  });
  return out;
}

// logits.argmax(-1) for float32 rows: the first index of each row's largest value, as
// torch's (torch's CPU reduction took 62 us for one 49152-entry row, 500 us for 16: the
// greedy sampler's whole cost in a decode step). Two passes over the row: its maximum,
// then the first position holding it; a row with a NaN answers that NaN's first index,
// as torch does.
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "argmax_rows: float32 [rows, vocab]");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "argmax_rows: an empty row");
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t V = Vec::size();
  sluice::parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * n;
      float best = row[0];  // NaN wins every comparison below, as in torch
      int64_t j = 0;
      if (n >= V) {
        Vec m = Vec::loadu(row);  // maximum() propagates NaN lane-wise
        for (j = V; j + V <= n; j += V) m = at::vec::maximum(m, Vec::loadu(row + j));
        float lanes[V];
        m.store(lanes);
        for (int64_t k = 0; k < V; ++k)
          if (std::isnan(lanes[k]) || lanes[k] > best) best = lanes[k];
      }
      for (; j < n; ++j)
        if (std::isnan(row[j]) || row[j] > best) best = row[j];
      int64_t at = -1;
      if (std::isnan(best)) {
        for (at = 0; !std::isnan(row[at]); ++at) {}
      } else {
        const Vec b(best);
        for (j = 0; j + V <= n && at < 0; j += V) {
          const int equal = (Vec::loadu(row + j) != b).zero_mask();  // 1 bits where row == best
          if (equal) at = j + __builtin_ctz(equal);
        }
        for (; at < 0; ++j)
          if (row[j] == best) at = j;
      }
      idx[r] = at;
    }
  });
  return out;
}
