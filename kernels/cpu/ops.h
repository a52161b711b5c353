// The kernels' entry points, one definition each in this directory's .cpp files: what
// bindings.cpp exposes to Python and decode_stack.cpp calls directly.
#pragma once
#include <ATen/ATen.h>

#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "q4_rows.h"

at::Tensor paged_attention(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_idx, at::Tensor token_req,
                           at::Tensor lens, double scale);
at::Tensor paged_decode(at::Tensor q, at::Tensor k_buf, at::Tensor v_buf, at::Tensor kv_idx, at::Tensor lens, double scale);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin_cache, int64_t heads, int64_t head_dim);
at::Tensor silu_mul(at::Tensor gate_up);
// rms_norm (residual: add_rms_norm_) / silu_mul with each output row quantized for
// q4_linear_rows as it is made (float32 only): the decode stack's layer inputs.
sluice::QuantRows rms_norm_q4(at::Tensor x, std::optional<at::Tensor> residual, at::Tensor weight, double eps);
sluice::QuantRows silu_mul_q4(at::Tensor gate_up);
void rope_store_kv(at::Tensor qkv, at::Tensor positions, at::Tensor cos_sin_cache, int64_t q_heads, int64_t kv_heads,
                   int64_t head_dim, at::Tensor k_buf, at::Tensor v_buf, at::Tensor loc);
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

// The tensor-parallel collectives of the ranks on one machine, through a shared memory
// segment (shm_comm.cpp; runtime/distributed/shm_comm.py maps it). Every rank calls the
// same ops in the same order; each raises after timeout_s (<= 0: never) or when a peer's
// process has exited.
class ShmComm {
 public:
  ShmComm(at::Tensor segment, int64_t rank, int64_t world, int64_t slot_bytes, std::vector<int64_t> pids,
          std::vector<int64_t> start_times, double spin_us);
  static int64_t segment_bytes(int64_t world, int64_t slot_bytes);

  void all_reduce_(at::Tensor x, double timeout_s);          // x = the sum of every rank's x, in place
  at::Tensor all_gather(at::Tensor x, double timeout_s);     // [world, *x.shape]: rank r's x at [r]
  void broadcast_(at::Tensor x, int64_t root, double timeout_s);  // x = root's x, in place

 private:
  struct Header;
  struct RankState;
  uint8_t* slot(int64_t rank, uint64_t op) const;
  void arrive(uint64_t op);
  bool all_arrived(uint64_t op) const;
  void wait_all(uint64_t op, double timeout_s) const;

  at::Tensor segment_;  // keeps the mapping alive
  int64_t rank_, world_, slot_bytes_;
  std::vector<int64_t> pids_, start_times_;
  std::chrono::steady_clock::duration spin_;
  Header* header_ = nullptr;
  RankState* ranks_ = nullptr;
  uint8_t* data_ = nullptr;
  uint64_t op_ = 0;
  std::mutex mu_;  // one op at a time per process: op_ and the slots are this rank's
};

// A decode batch's whole decoder stack in one call (decode_stack.cpp).
class DecodeStack {
 public:
  // Per layer, in order: input norm, post-attention norm (weights), qkv, o, gate_up, down
  // (pack_q4 records), their panels (empty tensors where none), K and V buffers of the KV
  // pool. Batches of dense_min_rows rows or more take the panels. Under tensor parallelism
  // (this rank's shards and heads), `comm` sums o_proj's and down_proj's partial outputs
  // over the ranks, as the row-parallel modules' all-reduce does; nullptr at tp_size 1.
  DecodeStack(const std::vector<at::Tensor>& per_layer, at::Tensor final_norm, at::Tensor cos_sin_cache,
              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
              int64_t dense_min_rows, ShmComm* comm, double comm_timeout_s);

  // h: the embeddings [n, hidden] (float32; its storage becomes the residual stream);
  // one new token per request at `positions`, KV written at `loc`; kv_idx / lens as
  // paged_decode takes them, or with token_req as paged_attention does. Returns the final
  // norm's output [n, hidden].
  at::Tensor forward(at::Tensor h, at::Tensor positions, at::Tensor loc, at::Tensor kv_idx, at::Tensor lens,
                     std::optional<at::Tensor> token_req) const;

 private:
  struct Linear {
    at::Tensor blocks, panels;  // pack_q4 records; what f32_linear takes, or an empty tensor
  };
  struct Layer {
    at::Tensor input_norm, post_norm;
    Linear qkv, o, gate_up, down;
    at::Tensor k_buf, v_buf;
  };
  at::Tensor linear(const at::Tensor& x, const Linear& w) const;
  bool uses_blocks(int64_t rows, const Linear& w) const;  // Q4 blocks, not f32_linear's panels

  std::vector<Layer> layers_;
  at::Tensor final_norm_, cos_sin_cache_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_, eps_;
  int64_t dense_min_rows_;
  ShmComm* comm_;  // kept alive by the Python binding (keep_alive)
  double comm_timeout_s_;
};
