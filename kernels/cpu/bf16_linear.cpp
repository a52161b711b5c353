// y = x @ W.T with bfloat16 operands and float32 sums and output: the dense path of the
// quantized linears (prefill, and batches from DENSE_MIN_ROWS rows on:
// runtime/layers/quantization/int4.py dense_matmul), on AMX tiles or, on CPUs with
// AVX512-BF16 and no AMX (e.g. AMD Zen 4), on `vdpbf16ps` vectors over the same layout.
//
// Why not torch's bf16 linear (oneDNN, same instructions): it writes bfloat16, and that
// rounding of every linear's output alone cost SmolLM2 Q4_1 0.3 points of teacher-forced
// top-1 agreement with float32 (98.76% -> 99.06% without it, and mean |dlogprob| 0.0124 ->
// 0.0086; bench/RESULTS.md item 21); and the two casts around it (x to bf16, y back to
// float32) were 240 torch ops of a 30-layer prefill, ~10 ms of 67 at 128 tokens. Here x
// (float32, or bfloat16 as is) is rounded to bf16 inside the call, each product is exact
// and summed in float32 (`tdpbf16ps` / `vdpbf16ps`), and y is float32. The two ISAs sum in
// different orders: each is batch-invariant, but their bits differ in the last places.
//
// Packed layout (pack_bf16_tiles in int4.py, once at load): W [N, K] as bf16
// [N / 16, K / 32, 16, 16, 2]. Block (n, k) is one 1 KB B tile: its row p holds, for each
// of 16 outputs j, W[16n + j, 32k + 2p] and W[16n + j, 32k + 2p + 1], the pair `tdpbf16ps`
// multiplies with the pair (2p, 2p + 1) of an x row. The same row is one zmm for
// `vdpbf16ps`: lane j's pair times x's pair (2p, 2p + 1) broadcast to every lane. The
// K / 32 tiles of a 16-output block follow each other, and the blocks follow each other:
// one forward stream.
//
// AMX tiles: tmm0-3 hold the float32 sums of a 32 x 32 output block (2 x 2 tiles of
// 16 x 16), tmm4-5 two 16-row tiles of x (16 x 32 bf16, loaded in place from the rounded
// copy at row stride K), tmm6-7 two B tiles. Vectors: 8 rows x 32 outputs of sums in 16
// zmm. A thread owns a range of 32-output column blocks (its weights are its own) and
// walks x's rows 32 at a time inside each, so a column block's K x 32 weights (96 KB at
// K = 1536) come from memory once per chunk of kChunkBytes of x rows (which stay in L2)
// and from L1/L2 after.
#include "cpu_common.h"

#include <algorithm>
#include <cstring>

#include "ops.h"
#include "spin_pool.h"
#include <string>
#include <vector>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define BF16_VEC 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define BF16_AMX 1
#endif
#endif

namespace {

constexpr int64_t kTileK = 32;  // bf16 columns of one x tile row (64 bytes)
constexpr int64_t kTileN = 16;  // outputs of one B tile
constexpr int64_t kTileElems = 512;  // bf16 elements of one B tile
// x rows a thread sweeps per pass over its weights: their bf16 copy stays within L2
// (2 MB a core here) beside the weights of one column block.
constexpr int64_t kChunkBytes = 512 * 1024;

#if defined(BF16_VEC)

// y[0:16] = silu(gate) * up: fused_ops.cpp silu_mul's float32 arithmetic, the same vector
// ops lane for lane, so the same bits as silu_mul over bf16_linear's output.
inline void silu_mul_16(const float* gate, const float* up, float* y) {
  using Vec = at::vec::Vectorized<float>;
  for (int j = 0; j < 16; j += Vec::size()) {
    const Vec g = Vec::loadu(gate + j);
    (g / (Vec(1.f) + g.neg().exp()) * Vec::loadu(up + j)).store(y + j);
  }
}

#endif

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
// block at b0 and up's from b1.
template <int RT>
void gated_block(const uint16_t* a, const uint16_t* b0, const uint16_t* b1, float* y, int64_t K, int64_t I) {
  tile_sums<RT, 2>(a, b0, b1, K);
  alignas(64) float gate[RT][16 * 16], up[RT][16 * 16];
  _tile_stored(0, gate[0], 64);
  _tile_stored(1, up[0], 64);
  if constexpr (RT == 2) {
    _tile_stored(2, gate[1], 64);
    _tile_stored(3, up[1], 64);
  }
  for (int t = 0; t < RT; ++t) {
    for (int r = 0; r < 16; ++r) silu_mul_16(gate[t] + 16 * r, up[t] + 16 * r, y + (16 * t + r) * I);
  }
}

#endif

#if defined(BF16_VEC)

constexpr int kVecRows = 8;  // x rows per register block: 8 x 2 float32 sums in 16 zmm

// The float32 sums of kVecRows rows of x (bf16 at a, row stride K) with CT 16-output
// blocks (b0, b1) into acc[r][c]: per B row p of a tile, one load of each block's row and,
// per x row, its pair (2p, 2p + 1) broadcast and multiplied into both (`vdpbf16ps`).
template <int CT>
inline void vec_sums(const uint16_t* a, const uint16_t* b0, const uint16_t* b1, int64_t K, __m512 (&out)[kVecRows][2]) {
  // Summed in locals: summed through `out`, GCC stored all 16 after every step (0.08 vs 0.1
  // T multiply-adds/s).
  __m512 acc[kVecRows][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  const auto pair = [&](int64_t r, int64_t col) {  // x[r, col], x[r, col + 1] as one int32 (col even)
    int32_t bits;
    std::memcpy(&bits, a + r * K + col, 4);
    return bits;
  };
  for (int64_t k = 0; k < K / kTileK; ++k) {
    const uint16_t *w0 = b0 + kTileElems * k, *w1 = b1 + kTileElems * k;
    for (int p = 0; p < kTileK / 2; ++p) {
      const __m512bh c0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w0 + 2 * kTileN * p));
      const __m512bh c1 = CT == 2 ? reinterpret_cast<__m512bh>(_mm512_loadu_si512(w1 + 2 * kTileN * p)) : c0;
      for (int r = 0; r < kVecRows; ++r) {
        const __m512bh xr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair(r, kTileK * k + 2 * p)));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, c0);
        if constexpr (CT == 2) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, c1);
      }
    }
  }
  for (int r = 0; r < kVecRows; ++r) out[r][0] = acc[r][0], out[r][1] = acc[r][1];
}

// tile_block's work on vectors: y (row stride N) for `rows` rows (16 or 32) x 16 CT outputs.
template <int CT>
void vec_block(const uint16_t* a, const uint16_t* b0, const uint16_t* b1, float* y, int64_t K, int64_t N, int64_t rows) {
  __m512 acc[kVecRows][2];
  for (int64_t r0 = 0; r0 < rows; r0 += kVecRows) {
    vec_sums<CT>(a + r0 * K, b0, b1, K, acc);
    for (int r = 0; r < kVecRows; ++r) {
      _mm512_storeu_ps(y + (r0 + r) * N, acc[r][0]);
      if constexpr (CT == 2) _mm512_storeu_ps(y + (r0 + r) * N + kTileN, acc[r][1]);
    }
  }
}

// gated_block's work on vectors.
void vec_gated(const uint16_t* a, const uint16_t* b0, const uint16_t* b1, float* y, int64_t K, int64_t I, int64_t rows) {
  __m512 acc[kVecRows][2];
  alignas(64) float gate[16], up[16];
  for (int64_t r0 = 0; r0 < rows; r0 += kVecRows) {
    vec_sums<2>(a + r0 * K, b0, b1, K, acc);
    for (int r = 0; r < kVecRows; ++r) {
      _mm512_store_ps(gate, acc[r][0]);
      _mm512_store_ps(up, acc[r][1]);
      silu_mul_16(gate, up, y + (r0 + r) * I);
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

bool amx_granted() {
#if defined(BF16_AMX)
  // Linux hands the 8 KB tile state only to processes that ask for it.
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

}  // namespace

const std::vector<std::string>& bf16_linear_isas() {  // (a reference: on_tiles asks on every call)
  static const std::vector<std::string> isas = [] {
    std::vector<std::string> found;
    if (amx_granted()) found.emplace_back("amx-bf16");
#if defined(BF16_VEC)
    found.emplace_back("avx512-bf16");
#endif
    return found;
  }();
  return isas;
}

namespace {

// Whether the call runs on AMX tiles: `isa` named (one of bf16_linear_isas()), or the first.
bool on_tiles(const at::Tensor& x, const at::Tensor& packed, const std::string& isa) {
  const auto& isas = bf16_linear_isas();
  TORCH_CHECK(!isas.empty(), "bf16_linear needs AMX-BF16 or AVX512-BF16 (bf16_linear_isas() is empty)");
  TORCH_CHECK(isa.empty() || std::find(isas.begin(), isas.end(), isa) != isas.end(), "bf16_linear: isa '", isa,
              "' is not one of this CPU's bf16_linear_isas()");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: float32 or bfloat16 [M, K]");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == 16 &&
                  packed.size(3) == kTileN && packed.size(4) == 2 && packed.is_contiguous(),
              "packed: bfloat16 [N / 16, K / 32, 16, 16, 2] (pack_bf16_tiles)");
  TORCH_CHECK(packed.size(1) * kTileK == x.size(1), "packed's K must be x's");
  return (isa.empty() ? isas.front() : isa) == "amx-bf16";
}

#if defined(BF16_VEC)
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
// f(x's bf16 rows at the step, the tiles, y's rows at the step, unit, rows at the step:
// 16 or 32). `tiles`: the thread holds the AMX tile state while it runs f.
template <typename F>
at::Tensor walk(const at::Tensor& x, const at::Tensor& packed, int64_t width, int64_t units, bool tiles, const F& f) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({(M + 15) / 16 * 16, width}, x.options().dtype(at::kFloat));
  const int64_t Mp = y.size(0), chunk = std::max<int64_t>(32, kChunkBytes / (K * 2) / 32 * 32);
  const auto a = rounded_rows(x, Mp);
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  sluice::parallel_for(units, 1, [&](int64_t begin, int64_t end) {
#if defined(BF16_AMX)
    if (tiles) configure_tiles();
#endif
    for (int64_t r0 = 0; r0 < Mp; r0 += chunk) {
      const int64_t r1 = std::min(Mp, r0 + chunk);
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t r = r0; r < r1; r += 32) f(ap + r * K, bp, yp + r * width, p, std::min<int64_t>(32, r1 - r));
      }
    }
#if defined(BF16_AMX)
    if (tiles) _tile_release();
#endif
  });
  return y.narrow(0, 0, M);
}
#endif

}  // namespace

at::Tensor bf16_linear(at::Tensor x, at::Tensor packed, const std::string& isa) {
  const bool tiles = on_tiles(x, packed, isa);
#if defined(BF16_VEC)
  const int64_t N = packed.size(0) * kTileN, K = x.size(1), block = K / kTileK * kTileElems;
  // Unit p: outputs [32 p, 32 p + 32), two 16-output blocks (one at N's tail).
  return walk(x, packed, N, (N / kTileN + 1) / 2, tiles,
              [&](const uint16_t* a, const uint16_t* b, float* y, int64_t p, int64_t rows) {
                const uint16_t *b0 = b + 2 * p * block, *b1 = b0 + block;
                y += 2 * kTileN * p;
                const bool two = 2 * kTileN * p + kTileN < N;
#if defined(BF16_AMX)
                if (tiles) {
                  if (rows == 32) {
                    two ? tile_block<2, 2>(a, b0, b1, y, K, N) : tile_block<2, 1>(a, b0, b1, y, K, N);
                  } else {
                    two ? tile_block<1, 2>(a, b0, b1, y, K, N) : tile_block<1, 1>(a, b0, b1, y, K, N);
                  }
                  return;
                }
#endif
                two ? vec_block<2>(a, b0, b1, y, K, N, rows) : vec_block<1>(a, b0, b1, y, K, N, rows);
              });
#else
  return at::Tensor();  // not reached: on_tiles refuses without AVX512-BF16
#endif
}

// silu(gate) * up, float32 [M, I], from a gate|up layer's tiles (N = 2 I, gate's outputs
// first): the MLP's first half in one call, without its [M, 2 I] output or a pass over it.
at::Tensor bf16_linear_silu_mul(at::Tensor x, at::Tensor packed, const std::string& isa) {
  const bool tiles = on_tiles(x, packed, isa);
  TORCH_CHECK(packed.size(0) % 2 == 0, "packed: gate|up, an even number of 16-output blocks");
#if defined(BF16_VEC)
  const int64_t I = packed.size(0) / 2 * kTileN, K = x.size(1), block = K / kTileK * kTileElems;
  // Unit p: outputs [16 p, 16 p + 16) of the activation, from gate block p and up block p + I / 16.
  return walk(x, packed, I, I / kTileN, tiles,
              [&](const uint16_t* a, const uint16_t* b, float* y, int64_t p, int64_t rows) {
                const uint16_t *b0 = b + p * block, *b1 = b0 + I / kTileN * block;
                y += kTileN * p;
#if defined(BF16_AMX)
                if (tiles) {
                  rows == 32 ? gated_block<2>(a, b0, b1, y, K, I) : gated_block<1>(a, b0, b1, y, K, I);
                  return;
                }
#endif
                vec_gated(a, b0, b1, y, K, I, rows);
              });
#else
  return at::Tensor();  // not reached: on_tiles refuses without AVX512-BF16
#endif
}
