// The kernels' entry points, one definition each in this directory's .cpp files: what
// bindings.cpp exposes to Python and decode_stack.cpp calls directly.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <vector>

at::Tensor paged_attention(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_idx, at::Tensor token_req,
                           at::Tensor lens, double scale);
at::Tensor paged_decode(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_idx, at::Tensor lens, double scale);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin_cache, int64_t heads, int64_t head_dim);
at::Tensor silu_mul(at::Tensor gate_up);
void store_kv(at::Tensor k_buf, at::Tensor v_buf, at::Tensor loc, at::Tensor k, at::Tensor v, bool round_src);
at::Tensor cast(at::Tensor x, at::ScalarType dtype);
at::Tensor argmax_rows(at::Tensor logits);
at::Tensor q8_linear(at::Tensor x, at::Tensor qw, at::Tensor scales);
std::string q4_linear_isa();
at::Tensor q4_linear(at::Tensor x, at::Tensor packed);
at::Tensor q8_linear_vnni(at::Tensor x, at::Tensor packed);
std::string f32_linear_isa();
at::Tensor f32_linear(at::Tensor x, at::Tensor w);
const std::vector<std::string>& bf16_linear_isas();
at::Tensor bf16_linear(at::Tensor x, at::Tensor packed, const std::string& isa);
at::Tensor bf16_linear_silu_mul(at::Tensor x, at::Tensor packed, const std::string& isa);
