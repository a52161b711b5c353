// y = x @ W.T in float32 on the FMA units of an AVX2 CPU: the dense path of the quantized
// linears where bfloat16 is not native (prefill, and batches from dense_min_rows rows on:
// runtime/layers/quantization/int4.py dense_matmul).
//
// Why not oneDNN (torch.ops.mkldnn._linear_pointwise on its packed copy): on an AMD EPYC
// (Zen 2) it ran SmolLM2's 120 GEMMs of a 1024-token chunk at 74 G multiply-adds/s on 2
// cores, 69% of the 2 FMAs a cycle this CPU issues; this loop runs them at 85-88
// (bench/RESULTS.md item 28). The prefill is float32 GEMMs and little else there. On a
// Zen 1 (one 256-bit FMA a cycle, as two halves) both reach ~90% at 1024 rows, and this
// loop is 10-30% faster from 12 to 96 rows: decode batches, where it beats the Q4 blocks.
//
// Packed layout (pack_f32_panels in int4.py, once at load): W [N, K] as [N / 16, K, 16],
// panel p's row k holding W[16p + j, k] for j = 0..15: one panel is the 16 outputs of two
// ymm accumulators per x row, read front to back.
//
// The loop (BLIS's): x's rows go in blocks of at most kBlockBytes (so a block, copied as
// [tiles][K][6], stays in L2 while every panel passes over it), and within a block a 6-row
// tile meets one panel at a time: 12 ymm of sums, 2 of the panel's row k, 1 broadcast of
// x[r, k]: 12 FMAs for 2 + 6 loads a k, within the 2 loads a cycle beside 2 FMAs.
//
// Batch invariance by construction: y[m, n] = sum over k = 0..K-1, in that order, of one
// fma each into one float lane. A row's operations are the same whatever M, its tile, its
// block or the thread count.
#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ops.h"
#include "spin_pool.h"

#if defined(CPU_CAPABILITY_AVX2)
#define F32_AVX2 1  // (an AVX-512 build leaves float32 GEMMs to oneDNN, which has the wider form)
#endif

namespace {

constexpr int64_t kLanes = 16;  // outputs of one panel
constexpr int64_t kTile = 6;  // x rows of one tile
constexpr int64_t kBlockBytes = 192 * 1024;  // a block's copy of x

// Tile (R rows of x, packed [K][6]) x panel ([K][16]) -> y's R x 16 outputs at row stride N.
// (Inlined into its caller: GCC 12's out-of-line copy stored the 12 sums to the stack on
// every k, which halved the rate.)
template <int R>
__attribute__((always_inline)) inline void tile_panel(const float* a, const float* b, int64_t K, float* y, int64_t N) {
#if defined(F32_AVX2)
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k, a += kTile, b += kLanes) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(a + r);
      lo[r] = _mm256_fmadd_ps(xr, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xr, b1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * N, lo[r]);
    _mm256_storeu_ps(y + r * N + 8, hi[r]);
  }
#else  // the same operations lane by lane
  float acc[R][kLanes] = {};
  for (int64_t k = 0; k < K; ++k, a += kTile, b += kLanes)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kLanes; ++j) acc[r][j] = std::fma(a[r], b[j], acc[r][j]);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kLanes; ++j) y[r * N + j] = acc[r][j];
#endif
}

// Rows [row0, row0 + rows) of x against panels [p0, p1); `a` holds the rows' copy.
void block_panels(const float* x, int64_t row0, int64_t rows, int64_t K, const float* panels, int64_t p0, int64_t p1,
                  float* y, int64_t N, float* a) {
  const int64_t tiles = (rows + kTile - 1) / kTile;
  for (int64_t t = 0; t < tiles; ++t)  // [tiles][K][6]; a short last tile's missing rows are never read
    for (int64_t r = 0; r < std::min(kTile, rows - kTile * t); ++r) {
      const float* src = x + (row0 + kTile * t + r) * K;
      float* dst = a + t * K * kTile + r;
      for (int64_t k = 0; k < K; ++k) dst[k * kTile] = src[k];
    }
  for (int64_t p = p0; p < p1; ++p) {
    const float* b = panels + p * K * kLanes;
    for (int64_t t = 0; t < tiles; ++t) {
      const float* at = a + t * K * kTile;
      float* yt = y + (row0 + kTile * t) * N + kLanes * p;
      switch (std::min(kTile, rows - kTile * t)) {
        case 6: tile_panel<6>(at, b, K, yt, N); break;
        case 5: tile_panel<5>(at, b, K, yt, N); break;
        case 4: tile_panel<4>(at, b, K, yt, N); break;
        case 3: tile_panel<3>(at, b, K, yt, N); break;
        case 2: tile_panel<2>(at, b, K, yt, N); break;
        default: tile_panel<1>(at, b, K, yt, N); break;
      }
    }
  }
}

}  // namespace

std::string f32_linear_isa() {
#if defined(F32_AVX2)
  return "avx2";
#else
  return "";
#endif
}

at::Tensor f32_linear(at::Tensor x, at::Tensor panels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.size(2) == kLanes &&
                  panels.is_contiguous(),
              "panels: float32 [N / 16, K, 16] (pack_f32_panels)");
  TORCH_CHECK(panels.size(1) == x.size(1), "panels' K must be x's");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = P * kLanes;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  // Each thread takes one slice of the panels (its weights are its own: a step's weights
  // come from memory once) and runs it over every row block, copying the block itself:
  // the threads' work differs by at most a panel, whatever M (splitting rows in 6-row
  // tiles left 36 rows to one thread and 28 to the other at M = 64).
  const int64_t threads = sluice::SpinPool::get().threads();
  const int64_t slices = std::min<int64_t>(P, threads);
  const int64_t max_rows = std::max(kTile, kBlockBytes / (4 * K) / kTile * kTile);
  const int64_t blocks = (M + max_rows - 1) / max_rows;
  const int64_t block_rows = ((M + blocks - 1) / blocks + kTile - 1) / kTile * kTile;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  sluice::parallel_for(slices * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> a(block_rows * K);
    for (int64_t i = begin; i < end; ++i) {  // slice-major: a thread's chunk is whole slices
      const int64_t s = i / blocks, row0 = i % blocks * block_rows;
      if (row0 >= M) continue;
      block_panels(xp, row0, std::min(block_rows, M - row0), K, wp, P * s / slices, P * (s + 1) / slices, yp, N, a.data());
    }
  });
  return y;
}
