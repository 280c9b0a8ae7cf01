// GEMM in the BLIS arrangement: A packed once into MR-row strips per K
// block; each task owns an NC-column block of C (and a chunk of M strips),
// packs its KC x NC slice of B (L2-resident) and sweeps MR x NR micro-tiles
// whose accumulators live in registers. Bias and activation are applied
// when the last K block is stored.
#include "gemm.h"

namespace jtile {
namespace {

constexpr int MR = GEMM_MR, NV = GEMM_NV, NR = GEMM_NR;
constexpr int64_t KC = 256;            // K block
constexpr int64_t NC = 8 * NR;         // columns per task
constexpr int64_t MC_STRIPS = 24;      // M strips per task

struct Tile {
  float* c;
  int64_t ldc;
  int rows, cols;                      // valid part of the MR x NR tile
  bool accumulate, last;
  const float* row_bias;               // already offset to the tile, or null
  const float* col_bias;
  const Epilogue* ep;
};

template <bool Full>
inline void store_tile(V (&acc)[MR][NV], const Tile& t) {
  const int rows = Full ? MR : t.rows;
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < NV; ++v) {
      const int lanes = Full ? W : std::min(W, t.cols - v * W);
      if (lanes <= 0) break;
      float* p = t.c + r * t.ldc + v * W;
      V x = acc[r][v];
      if (t.accumulate) x = vadd(x, lanes == W ? vload(p) : vload_partial(p, lanes));
      if (t.last) {
        if (t.row_bias) x = vadd(x, vset1(t.row_bias[r]));
        if (t.col_bias)
          x = vadd(x, lanes == W ? vload(t.col_bias + v * W) : vload_partial(t.col_bias + v * W, lanes));
        x = (*t.ep)(x);
      }
      if (lanes == W) vstore(p, x); else vstore_partial(p, x, lanes);
    }
}

// acc = a_strip (kc x MR, k-major) times b_strip (kc x NR), stored into the tile.
inline void micro_kernel(int64_t kc, const float* __restrict a, const float* __restrict b, const Tile& t) {
  V acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  for (int64_t p = 0; p < kc; ++p, a += MR, b += NR) {
    V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = vload(b + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const V ar = vset1(a[r]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(ar, bv[v], acc[r][v]);
    }
  }
  if (t.rows == MR && t.cols == NR) store_tile<true>(acc, t); else store_tile<false>(acc, t);
}

// A (m x k, lda) as [k block][m strip][kc][MR], rows past m zero.
void pack_a(ffi::ThreadPool& pool, const float* a, int64_t lda, int64_t m, int64_t k, float* dst) {
  const int64_t strips = ceil_div(m, MR);
  parallel_for(pool, strips, [&](int64_t s) {
    for (int64_t k0 = 0; k0 < k; k0 += KC) {
      const int64_t kc = std::min(KC, k - k0);
      float* d = dst + k0 * strips * MR + s * kc * MR;
      for (int r = 0; r < MR; ++r) {
        const int64_t row = s * MR + r;
        for (int64_t p = 0; p < kc; ++p) d[p * MR + r] = row < m ? a[row * lda + k0 + p] : 0.0f;
      }
    }
  });
}

// Per-thread packing buffer for B, grown on demand and reused across calls.
float* b_buffer(int64_t count) {
  thread_local Scratch buffer;
  thread_local int64_t capacity = 0;
  if (count > capacity) {
    buffer = make_scratch(count);
    capacity = count;
  }
  return buffer.get();
}

}  // namespace

void RowMajorB::pack(int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst) const {
  for (int64_t j = 0; j < nc; j += NR, dst += kc * NR) {
    const int64_t cols = std::min<int64_t>(NR, nc - j);
    const float* src = b + k0 * ldb + n0 + j;
    for (int64_t p = 0; p < kc; ++p, src += ldb)
      for (int v = 0; v < NV; ++v) {
        const int lanes = (int)std::clamp<int64_t>(cols - v * W, 0, W);
        vstore(dst + p * NR + v * W, lanes == W ? vload(src + v * W) : vload_partial(src + v * W, lanes));
      }
  }
}

void gemm(ffi::ThreadPool& pool, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const BPacker& b, const GemmOutput& out) {
  if (m <= 0 || n <= 0) return;
  const int64_t strips = ceil_div(m, MR), kblocks = std::max<int64_t>(1, ceil_div(k, KC));
  Scratch ap = make_scratch(strips * MR * k);
  pack_a(pool, a, lda, m, k, ap.get());
  const int64_t nblocks = ceil_div(n, NC), mchunks = ceil_div(strips, MC_STRIPS);
  parallel_for(pool, nblocks * mchunks, [&](int64_t task) {
    const int64_t n0 = task / mchunks * NC, nc = std::min(NC, n - n0);
    const int64_t s0 = task % mchunks * MC_STRIPS, s1 = std::min(strips, s0 + MC_STRIPS);
    float* bp = b_buffer(KC * ceil_div(nc, NR) * NR);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const int64_t k0 = kb * KC, kc = std::min(KC, k - k0);
      b.pack(k0, kc, n0, nc, bp);
      for (int64_t j = 0; j < nc; j += NR)
        for (int64_t s = s0; s < s1; ++s) {
          const int64_t row = s * MR, col = n0 + j;
          Tile t{out.c + row * out.ldc + col, out.ldc,
                 (int)std::min<int64_t>(MR, m - row), (int)std::min<int64_t>(NR, n - col),
                 kb > 0, kb == kblocks - 1,
                 out.row_bias ? out.row_bias + row : nullptr,
                 out.col_bias ? out.col_bias + col : nullptr, &out.ep};
          micro_kernel(kc, ap.get() + k0 * strips * MR + s * kc * MR, bp + j * kc, t);
        }
    }
  });
}

}  // namespace jtile
