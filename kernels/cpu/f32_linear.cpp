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
// ymm accumulators per x row, read front to back. Or W as q4_linear.cpp's Q4 / Q8 records
// (16 outputs a block too): each panel is then dequantized into a scratch [K][16] as the
// loop reaches it, the same floats a copy would hold, for 1/6 (Q4) of a copy's bytes and
// no copy in memory; on a Zen 1 2-5% slower than a copy's panels from 8 to 512 rows (the
// FMAs, not the bytes, bound it there; bench/RESULTS.md item 31).
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
#include <cstring>
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
constexpr int64_t kGroup = 32;  // columns of one record
constexpr int64_t kPanelAhead = 4096;  // bytes a lone tile prefetches ahead of its panel reads
constexpr int64_t kRecord4 = 320, kRecord8 = 576;  // bytes of a Q4 / Q8 record (q4_linear.cpp)

// Tile (R rows of x, packed [K][6]) x panel ([K][16]) -> y's R x 16 outputs at row stride N.
// (Inlined into its caller: GCC 12's out-of-line copy stored the 12 sums to the stack on
// every k, which halved the rate.)
template <int R>
__attribute__((always_inline)) inline void tile_panel(const float* a, const float* b, int64_t K, float* y, int64_t N,
                                                      const float* next = nullptr, bool ahead = false) {
#if defined(F32_AVX2)
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k, a += kTile, b += kLanes) {
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + k * kLanes), _MM_HINT_T1);
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(b) + kPanelAhead, _MM_HINT_T0);
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

// Panel p of a weight kept as q4_linear.cpp's records (pack_q4: Q4, 320 bytes a group of 32
// columns; pack_q8_vnni: Q8, 576), dequantized into b as [K][16]: the float32 weights gguf's own
// dequantization gives, so the panels pack_f32_panels would hold, bit for bit. Q4: w =
// fma(q, d, m) = d q + m rounded once (d q, 4 bits times fp16's 11, is exact); Q8: w = d (c -
// 128), exact. In a record's chunk of 64 bytes, byte 4j + t is output j's: the shift by 8t (Q4:
// and 8t + 4 for the high nibble) and a mask give column k's 16 codes in two ymm.
// (Never inlined: in block_panels its vector constants took a register from the 6-row tile,
// whose sums then went to the stack on every k; the tile ran ~20% slower.)
template <bool Q8>
__attribute__((noinline)) void dequantize_panel(const uint8_t* rec, int64_t G, float* b) {
  constexpr int64_t record = Q8 ? kRecord8 : kRecord4;
  for (int64_t g = 0; g < G; ++g, rec += record, b += kGroup * kLanes) {
#if defined(F32_AVX2)
    const __m256 d0 = Q8 ? _mm256_loadu_ps(reinterpret_cast<const float*>(rec + 512))
                         : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 256)));
    const __m256 d1 = Q8 ? _mm256_loadu_ps(reinterpret_cast<const float*>(rec + 544))
                         : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 272)));
    const __m256 m0 = Q8 ? _mm256_set1_ps(128.f) : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 288)));
    const __m256 m1 = Q8 ? m0 : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 304)));
    const __m256i mask = _mm256_set1_epi32(Q8 ? 0xFF : 0x0F);
    auto column = [&](__m256i v0, __m256i v1, int shift, float* out) {
      const __m256 c0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(v0, _mm_cvtsi32_si128(shift)), mask));
      const __m256 c1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(v1, _mm_cvtsi32_si128(shift)), mask));
      if constexpr (Q8) {
        _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_sub_ps(c0, m0), d0));
        _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_sub_ps(c1, m1), d1));
      } else {
        _mm256_storeu_ps(out, _mm256_fmadd_ps(c0, d0, m0));
        _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(c1, d1, m1));
      }
    };
    for (int c = 0; c < (Q8 ? 8 : 4); ++c) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * c));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * c + 32));
      for (int t = 0; t < 4; ++t) {
        if constexpr (Q8) {
          column(v0, v1, 8 * t, b + (4 * c + t) * kLanes);
        } else {
          column(v0, v1, 8 * t, b + (8 * c + t) * kLanes);
          column(v0, v1, 8 * t + 4, b + (8 * c + 4 + t) * kLanes);
        }
      }
    }
#else  // the same values lane by lane
    for (int64_t k = 0; k < kGroup; ++k)
      for (int64_t j = 0; j < kLanes; ++j) {
        if constexpr (Q8) {
          float d;
          std::memcpy(&d, rec + 512 + 4 * j, 4);
          b[k * kLanes + j] = d * (static_cast<float>(rec[64 * (k / 4) + 4 * j + k % 4]) - 128.f);
        } else {
          const uint8_t byte = rec[64 * (k / 8) + 4 * j + k % 4];
          const float q = static_cast<float>(k % 8 < 4 ? byte & 0x0F : byte >> 4);
          const float d = c10::detail::fp16_ieee_to_fp32_value(reinterpret_cast<const uint16_t*>(rec + 256)[j]);
          const float m = c10::detail::fp16_ieee_to_fp32_value(reinterpret_cast<const uint16_t*>(rec + 288)[j]);
          b[k * kLanes + j] = std::fma(q, d, m);
        }
      }
#endif
  }
}

// The weight as f32_linear takes it: float32 panels, or records dequantized a panel at a time.
struct Weight {
  const float* panels;  // [P][K][16], or null
  const uint8_t* records;  // [P][G][record bytes], or null
  bool q8;
  int64_t K;
  // Panel p: in place, or dequantized into `scratch` ([K][16]).
  const float* panel(int64_t p, float* scratch) const {
    if (panels != nullptr) return panels + p * K * kLanes;
    const int64_t G = K / kGroup;
    if (q8)
      dequantize_panel<true>(records + p * G * kRecord8, G, scratch);
    else
      dequantize_panel<false>(records + p * G * kRecord4, G, scratch);
    return scratch;
  }
};

// Rows [row0, row0 + rows) of x against panels [p0, p1); `a` holds the rows' copy, `scratch`
// a dequantized panel.
void block_panels(const float* x, int64_t row0, int64_t rows, int64_t K, const Weight& w, int64_t p0, int64_t p1,
                  float* y, int64_t N, float* a, float* scratch) {
  const int64_t tiles = (rows + kTile - 1) / kTile;
  for (int64_t t = 0; t < tiles; ++t)  // [tiles][K][6]; a short last tile's missing rows are never read
    for (int64_t r = 0; r < std::min(kTile, rows - kTile * t); ++r) {
      const float* src = x + (row0 + kTile * t + r) * K;
      float* dst = a + t * K * kTile + r;
      for (int64_t k = 0; k < K; ++k) dst[k * kTile] = src[k];
    }
  for (int64_t p = p0; p < p1; ++p) {
    const float* b = w.panel(p, scratch);
    // From two whole tiles on, the second tile (its panel rows come from L2) also brings the
    // next panel into L2, a line a k: the first tile then finds it there instead of waiting
    // on memory for each line while the later tiles leave memory idle. On a Zen 1, SmolLM2's
    // 120 linears at 12 / 16 rows: -12..-17% / -11..-15%; a short second tile (8 rows) made it
    // slower (bench/RESULTS.md item 33).
    const float* next = w.panels != nullptr && p + 1 < p1 && rows >= 2 * kTile ? w.panels + (p + 1) * K * kLanes : nullptr;
    // Below that, each panel is read from memory by its one or two tiles: the first tile
    // then prefetches a page ahead of its reads, as q4_linear does (the hardware streamer
    // stops at each 4 KB page; bench/RESULTS.md item 20). 4 / 6 / 8 rows: -11..-23%
    // (item 33); with the next-panel prefetch too, 16 rows ran slower.
    const bool ahead = w.panels != nullptr && rows < 2 * kTile;
    for (int64_t t = 0; t < tiles; ++t) {
      const float* at = a + t * K * kTile;
      float* yt = y + (row0 + kTile * t) * N + kLanes * p;
      const float* pf = t == 1 ? next : nullptr;
      const bool pa = ahead && t == 0;
      switch (std::min(kTile, rows - kTile * t)) {
        case 6: tile_panel<6>(at, b, K, yt, N, pf, pa); break;
        case 5: tile_panel<5>(at, b, K, yt, N, pf, pa); break;
        case 4: tile_panel<4>(at, b, K, yt, N, pf, pa); break;
        case 3: tile_panel<3>(at, b, K, yt, N, pf, pa); break;
        case 2: tile_panel<2>(at, b, K, yt, N, pf, pa); break;
        default: tile_panel<1>(at, b, K, yt, N, pf, pa); break;
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

at::Tensor f32_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  const bool records = w.scalar_type() == at::kByte;
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() &&
                  (records ? w.size(2) == kRecord4 || w.size(2) == kRecord8
                           : w.scalar_type() == at::kFloat && w.size(2) == kLanes),
              "w: float32 panels [N / 16, K, 16] (pack_f32_panels) or uint8 records [N / 16, K / 32, 320 | 576] "
              "(pack_q4, pack_q8_vnni)");
  const int64_t K = records ? w.size(1) * kGroup : w.size(1);
  TORCH_CHECK(K == x.size(1), "w's K must be x's");
  x = x.contiguous();
  const int64_t M = x.size(0), P = w.size(0), N = P * kLanes;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Weight weight{records ? nullptr : w.data_ptr<float>(), records ? w.data_ptr<uint8_t>() : nullptr,
                      records && w.size(2) == kRecord8, K};
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
  float* yp = y.data_ptr<float>();
  sluice::parallel_for(slices * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> a(block_rows * K), scratch(records ? K * kLanes : 0);
    for (int64_t i = begin; i < end; ++i) {  // slice-major: a thread's chunk is whole slices
      const int64_t s = i / blocks, row0 = i % blocks * block_rows;
      if (row0 >= M) continue;
      block_panels(xp, row0, std::min(block_rows, M - row0), K, weight, P * s / slices, P * (s + 1) / slices, yp, N,
                   a.data(), scratch.data());
    }
  });
  return y;
}
