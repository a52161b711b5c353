// y = x @ W.T with bfloat16 operands and float32 sums and output, on AMX tiles: the dense
// path of the quantized linears (prefill, and batches from DENSE_MIN_ROWS rows on:
// runtime/layers/quantization/int4.py dense_matmul).
//
// Why not torch's bf16 linear (oneDNN, same AMX instructions): it writes bfloat16, and that
// rounding of every linear's output alone cost SmolLM2 Q4_1 0.3 points of teacher-forced
// top-1 agreement with float32 (98.76% -> 99.06% without it, and mean |dlogprob| 0.0124 ->
// 0.0086; bench/RESULTS.md item 21); and the two casts around it (x to bf16, y back to
// float32) were 240 torch ops of a 30-layer prefill, ~10 ms of 67 at 128 tokens. Here x
// (float32, or bfloat16 as is) is rounded to bf16 inside the call, each product is exact
// and summed in float32 (`tdpbf16ps`), and y is float32.
//
// Packed layout (pack_bf16_tiles in int4.py, once at load): W [N, K] as bf16
// [N / 16, K / 32, 16, 16, 2]. Block (n, k) is one 1 KB B tile: its row p holds, for each
// of 16 outputs j, W[16n + j, 32k + 2p] and W[16n + j, 32k + 2p + 1], the pair `tdpbf16ps`
// multiplies with the pair (2p, 2p + 1) of an x row. The K / 32 tiles of a 16-output block
// follow each other, and the blocks follow each other: one forward stream.
//
// Tiles: tmm0-3 hold the float32 sums of a 32 x 32 output block (2 x 2 tiles of 16 x 16),
// tmm4-5 two 16-row tiles of x (16 x 32 bf16, loaded in place from the rounded copy at
// row stride K), tmm6-7 two B tiles. A thread owns a range of 32-output column blocks (its
// weights are its own) and walks x's rows 32 at a time inside each, so a column block's
// K x 32 weights (96 KB at K = 1536) come from memory once per chunk of kChunkBytes of x
// rows (which stay in L2) and from L1/L2 after.
#include "cpu_common.h"

#include <algorithm>
#include <cstring>

#include "ops.h"
#include "spin_pool.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define BF16_AMX 1
#endif

namespace {

constexpr int64_t kTileK = 32;  // bf16 columns of one x tile row (64 bytes)
constexpr int64_t kTileN = 16;  // outputs of one B tile
constexpr int64_t kTileElems = 512;  // bf16 elements of one B tile
// x rows a thread sweeps per pass over its weights: their bf16 copy stays within L2
// (2 MB a core here) beside the weights of one column block.
constexpr int64_t kChunkBytes = 512 * 1024;

#if defined(BF16_AMX)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile is 16 rows x 64 bytes: a 16 x 16 float32 block, 16 x 32 bf16 of x, or a B tile.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // GCC 12 drops the stores to cfg as dead before ldtilecfg reads them (llama.cpp hit it too).
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// The float32 sums of 16 RT rows of x (bf16 at a, row stride K) with the CT 16-output
// blocks of B tiles at b0 and b1, left in tiles 0-3 (row tile t, block c: tile 2t + c).
// RT, CT in {1, 2}: the tails of M and N (both multiples of 16).
template <int RT, int CT>
void tile_sums(const uint16_t* a, const uint16_t* b0, const uint16_t* b1, int64_t K) {
  const int64_t tiles = K / kTileK, stride_a = K * 2;
  _tile_zero(0);
  if constexpr (CT == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && CT == 2) _tile_zero(3);
  for (int64_t k = 0; k < tiles; ++k) {
    _tile_loadd(4, a + kTileK * k, stride_a);
    _tile_loadd(6, b0 + kTileElems * k, 64);
    if constexpr (RT == 2) _tile_loadd(5, a + 16 * K + kTileK * k, stride_a);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (RT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (CT == 2) {
      _tile_loadd(7, b1 + kTileElems * k, 64);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (RT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// y (row stride N) = the sums: 16 RT rows x 16 CT outputs.
template <int RT, int CT>
void tile_block(const uint16_t* a, const uint16_t* b0, const uint16_t* b1, float* y, int64_t K, int64_t N) {
  tile_sums<RT, CT>(a, b0, b1, K);
  _tile_stored(0, y, N * 4);
  if constexpr (CT == 2) _tile_stored(1, y + kTileN, N * 4);
  if constexpr (RT == 2) _tile_stored(2, y + 16 * N, N * 4);
  if constexpr (RT == 2 && CT == 2) _tile_stored(3, y + 16 * N + kTileN, N * 4);
}

// y (row stride I) = silu(gate) * up for 16 RT rows x 16 outputs, gate's sums from the
// block at b0 and up's from b1: fused_ops.cpp silu_mul's float32 arithmetic, the same
// vector ops lane for lane, so the same bits as silu_mul over bf16_linear's output.
template <int RT>
void gated_block(const uint16_t* a, const uint16_t* b0, const uint16_t* b1, float* y, int64_t K, int64_t I) {
  using Vec = at::vec::Vectorized<float>;
  tile_sums<RT, 2>(a, b0, b1, K);
  alignas(64) float gate[RT][16 * 16], up[RT][16 * 16];
  _tile_stored(0, gate[0], 64);
  _tile_stored(1, up[0], 64);
  if constexpr (RT == 2) {
    _tile_stored(2, gate[1], 64);
    _tile_stored(3, up[1], 64);
  }
  for (int t = 0; t < RT; ++t) {
    for (int r = 0; r < 16; ++r) {
      float* yr = y + (16 * t + r) * I;
      for (int j = 0; j < 16; j += Vec::size()) {
        const Vec g = Vec::loadu(gate[t] + 16 * r + j);
        (g / (Vec(1.f) + g.neg().exp()) * Vec::loadu(up[t] + 16 * r + j)).store(yr + j);
      }
    }
  }
}

// Rows [begin, end) of float32 x rounded to bf16 (round to nearest even, as torch's cast).
void round_rows(const float* x, uint16_t* a, int64_t K, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* xr = x + r * K;
    uint16_t* ar = a + r * K;
    for (int64_t j = 0; j < K; j += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + j + 16), _mm512_loadu_ps(xr + j));
      _mm512_storeu_si512(ar + j, reinterpret_cast<__m512i>(v));
    }
  }
}

#endif

}  // namespace

bool bf16_linear_amx() {
#if defined(BF16_AMX)
  // Linux hands the 8 KB tile state only to processes that ask for it.
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

namespace {

void check_operands(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(bf16_linear_amx(), "bf16_linear needs AMX-BF16 (bf16_linear_amx())");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: float32 or bfloat16 [M, K]");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == 16 &&
                  packed.size(3) == kTileN && packed.size(4) == 2 && packed.is_contiguous(),
              "packed: bfloat16 [N / 16, K / 32, 16, 16, 2] (pack_bf16_tiles)");
  TORCH_CHECK(packed.size(1) * kTileK == x.size(1), "packed's K must be x's");
}

#if defined(BF16_AMX)
// x in bf16, its rows padded with zeros to Mp (a multiple of 16: whole tiles).
at::Tensor rounded_rows(at::Tensor x, int64_t Mp) {
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto a = at::empty({Mp, K}, x.options().dtype(at::kBFloat16));
  uint16_t* ap = reinterpret_cast<uint16_t*>(a.data_ptr());
  if (Mp > M) std::memset(ap + M * K, 0, (Mp - M) * K * 2);
  if (x.scalar_type() == at::kBFloat16) {
    std::memcpy(ap, x.data_ptr(), M * K * 2);
  } else {
    const float* xp = x.data_ptr<float>();
    sluice::parallel_for(M, 16, [&](int64_t begin, int64_t end) { round_rows(xp, ap, K, begin, end); });
  }
  return a;
}

// float32 y [M, width] = f over each thread's column units [begin, end) of `units` and x's
// rows (rounded to bf16) in steps of 32, taken in chunks of kChunkBytes that stay in L2:
// f(x's bf16 rows at the step, the tiles, y's rows at the step, unit, two 16-row tiles?).
template <typename F>
at::Tensor walk(const at::Tensor& x, const at::Tensor& packed, int64_t width, int64_t units, const F& f) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({(M + 15) / 16 * 16, width}, x.options().dtype(at::kFloat));
  const int64_t Mp = y.size(0), chunk = std::max<int64_t>(32, kChunkBytes / (K * 2) / 32 * 32);
  const auto a = rounded_rows(x, Mp);
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  sluice::parallel_for(units, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t r0 = 0; r0 < Mp; r0 += chunk) {
      const int64_t r1 = std::min(Mp, r0 + chunk);
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t r = r0; r < r1; r += 32) f(ap + r * K, bp, yp + r * width, p, r + 16 < r1);
      }
    }
    _tile_release();
  });
  return y.narrow(0, 0, M);
}
#endif

}  // namespace

at::Tensor bf16_linear(at::Tensor x, at::Tensor packed) {
  check_operands(x, packed);
#if defined(BF16_AMX)
  const int64_t N = packed.size(0) * kTileN, K = x.size(1), block = K / kTileK * kTileElems;
  // Unit p: outputs [32 p, 32 p + 32), two 16-output blocks (one at N's tail).
  return walk(x, packed, N, (N / kTileN + 1) / 2,
              [&](const uint16_t* a, const uint16_t* b, float* y, int64_t p, bool two_rows) {
                const uint16_t *b0 = b + 2 * p * block, *b1 = b0 + block;
                y += 2 * kTileN * p;
                const bool two = 2 * kTileN * p + kTileN < N;
                if (two_rows) {
                  two ? tile_block<2, 2>(a, b0, b1, y, K, N) : tile_block<2, 1>(a, b0, b1, y, K, N);
                } else {
                  two ? tile_block<1, 2>(a, b0, b1, y, K, N) : tile_block<1, 1>(a, b0, b1, y, K, N);
                }
              });
#else
  return at::Tensor();  // not reached: check_operands refuses without AMX
#endif
}

// silu(gate) * up, float32 [M, I], from a gate|up layer's tiles (N = 2 I, gate's outputs
// first): the MLP's first half in one call, without its [M, 2 I] output or a pass over it.
at::Tensor bf16_linear_silu_mul(at::Tensor x, at::Tensor packed) {
  check_operands(x, packed);
  TORCH_CHECK(packed.size(0) % 2 == 0, "packed: gate|up, an even number of 16-output blocks");
#if defined(BF16_AMX)
  const int64_t I = packed.size(0) / 2 * kTileN, K = x.size(1), block = K / kTileK * kTileElems;
  // Unit p: outputs [16 p, 16 p + 16) of the activation, from gate block p and up block p + I / 16.
  return walk(x, packed, I, I / kTileN, [&](const uint16_t* a, const uint16_t* b, float* y, int64_t p, bool two_rows) {
    const uint16_t *b0 = b + p * block, *b1 = b0 + I / kTileN * block;
    y += kTileN * p;
    two_rows ? gated_block<2>(a, b0, b1, y, K, I) : gated_block<1>(a, b0, b1, y, K, I);
  });
#else
  return at::Tensor();  // not reached: check_operands refuses without AMX
#endif
}
