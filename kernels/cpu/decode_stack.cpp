// DecodeStack: a decode batch's whole decoder stack (Llama family, Q4-block linears) in
// one call, the layers' weights bound once.
//
// It runs, layer by layer, exactly the kernels the Python modules call on this path, with
// the same arguments (runtime/models/llama.py with runtime/models/cpu_path.py's ops bound
// and runtime/layers/quantization/q4q8.py's linears):
//
//   x = rms_norm(h) (layer 0) | add_rms_norm_(h, residual)      residual += h, in place
//   qkv = linear(x, qkv); rotary_(qkv, q and k heads)
//   store_kv(k, v at loc) (with rotary_: rope_store_kv, one pass); o = paged_decode(q, the pool, kv_idx, lens)
//       (with token_req: paged_attention(q, the pool, kv_idx, token_req, lens), the
//        per-query order of deterministic inference)
//   h = linear(o, o_proj) [+ all-reduce]; x = add_rms_norm_(h, residual)
//   h = linear(silu_mul(linear(x, gate_up)), down) [+ all-reduce]
//   final: add_rms_norm_(h, residual, final norm)
//
// where linear is q4_linear on the layer's Q4 blocks, or f32_linear on its panels (or records)
// from dense_min_rows rows on (where the layers keep panels: q4q8.dense_min_rows),
//
// (the all-reduces only under tensor parallelism: the ranks' ShmComm, the collective the
// row-parallel modules call there), so its output has the same bits as the module path's. What it saves is the Python
// between the kernels: ~12 module calls and ~20 tensor views per layer, ~2 ms of a
// single stream's 7 ms step on SmolLM2's 30 layers. And where a linear runs Q4 blocks,
// the row op before it (a norm, silu_mul) quantizes each output row for it as it makes
// it (rms_norm_q4, silu_mul_q4): one parallel pass instead of a serial norm (or a silu
// pass) and then q4_linear's quantization pass, the same bits.
#include <utility>
#include <vector>

#include "ops.h"

DecodeStack::DecodeStack(const std::vector<at::Tensor>& per_layer, at::Tensor final_norm, at::Tensor cos_sin_cache,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
                         int64_t dense_min_rows, ShmComm* comm, double comm_timeout_s)
    : final_norm_(std::move(final_norm)), cos_sin_cache_(std::move(cos_sin_cache)), heads_(num_heads),
      kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps), dense_min_rows_(dense_min_rows),
      comm_(comm), comm_timeout_s_(comm_timeout_s) {
  TORCH_CHECK(per_layer.size() % 12 == 0, "12 tensors per layer");
  for (size_t i = 0; i < per_layer.size(); i += 12) {
    const auto* t = per_layer.data() + i;
    layers_.push_back({t[0], t[1], {t[2], t[6]}, {t[3], t[7]}, {t[4], t[8]}, {t[5], t[9]}, t[10], t[11]});
  }
}

at::Tensor DecodeStack::forward(at::Tensor h, at::Tensor positions, at::Tensor loc, at::Tensor kv_idx, at::Tensor lens,
                                std::optional<at::Tensor> token_req) const {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "h: float32 [n, hidden], contiguous");
  const int64_t n = h.size(0), q_size = heads_ * head_dim_;
  positions = positions.to(at::kLong).contiguous();
  loc = loc.to(at::kLong).contiguous();
  kv_idx = kv_idx.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  if (token_req.has_value()) token_req = token_req->to(at::kLong).contiguous();
  at::Tensor residual;
  // A linear's input comes from a row op (a norm, silu * up): where the linear runs Q4
  // blocks the op quantizes its rows itself (rms_norm_q4, silu_mul_q4: the same bits as
  // the op, then q4_linear), else it writes them for f32_linear's panels.
  auto normed = [&](const at::Tensor& x, const at::Tensor& weight, const Linear& w) {
    const bool first = !residual.defined();
    if (first) residual = x;
    if (uses_blocks(n, w)) return q4_linear_rows(rms_norm_q4(x, first ? std::nullopt : std::optional(residual), weight, eps_), w.blocks);
    return linear(first ? rms_norm(x, weight, eps_) : add_rms_norm_(x, residual, weight, eps_), w);
  };
  for (const Layer& layer : layers_) {
    at::Tensor qkv = normed(h, layer.input_norm, layer.qkv);
    rope_store_kv(qkv, positions, cos_sin_cache_, heads_, kv_heads_, head_dim_, layer.k_buf, layer.v_buf, loc);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({n, heads_, head_dim_});
    at::Tensor o = token_req.has_value()
                       ? paged_attention(q, layer.k_buf, layer.v_buf, kv_idx, *token_req, lens, scale_)
                       : paged_decode(q, layer.k_buf, layer.v_buf, kv_idx, lens, scale_);
    h = linear(o.view({n, q_size}), layer.o);
    if (comm_ != nullptr) comm_->all_reduce_(h, comm_timeout_s_);
    at::Tensor gate_up = normed(h, layer.post_norm, layer.gate_up);
    h = uses_blocks(n, layer.down) ? q4_linear_rows(silu_mul_q4(gate_up), layer.down.blocks) : linear(silu_mul(gate_up), layer.down);
    if (comm_ != nullptr) comm_->all_reduce_(h, comm_timeout_s_);
  }
  if (!residual.defined()) return rms_norm(h, final_norm_, eps_);
  return add_rms_norm_(h, residual, final_norm_, eps_);
}

bool DecodeStack::uses_blocks(int64_t rows, const Linear& w) const {
  return !(rows >= dense_min_rows_ && w.panels.numel() > 0);
}

at::Tensor DecodeStack::linear(const at::Tensor& x, const Linear& w) const {
  return uses_blocks(x.size(0), w) ? q4_linear(x, w.blocks) : f32_linear(x, w.panels);
}
