// Packed, register-blocked single-precision GEMM shared by dense and the
// im2col convolution: C = epilogue(A B^T + bias) for operands A (M x K) and
// B (N x K), each supplied by an Operand that packs it into strips (a plain
// matrix, im2col gathered straight into the packed layout, or weights packed
// once ahead of time). C is row-major, or stored transposed.
#pragma once

#include <functional>

#include "common.h"

namespace jtile {

// Micro-tiles: MR rows of C by NR = NV vectors of columns. The wide tile
// (7 x 4 with AVX-512) serves every GEMM but a conv's in channel rows, which
// takes the tall one (8 x 3): the wide tile's 28 accumulators, 4 B vectors
// and a broadcast need 33 registers, so one accumulator spills on every k
// step; 8 x 3 needs 28. Measured on 1x1 and 3x3 convs in channel rows 1.04-1.15x
// (and 0.78-0.84x on 7x7 pixel-row layers, which keep the wide tile).
#if defined(JTILE_GEMM_MR) && defined(JTILE_GEMM_NV)  // for tuning experiments
constexpr int GEMM_MR = JTILE_GEMM_MR, GEMM_NV = JTILE_GEMM_NV, GEMM_TALL_MR = GEMM_MR, GEMM_TALL_NV = GEMM_NV;
#elif defined(__AVX512F__)
constexpr int GEMM_MR = 7, GEMM_NV = 4, GEMM_TALL_MR = 8, GEMM_TALL_NV = 3;
#else
constexpr int GEMM_MR = 6, GEMM_NV = 2, GEMM_TALL_MR = 6, GEMM_TALL_NV = 2;
#endif
constexpr int GEMM_NR = GEMM_NV * W;
// The most rows of an operand strip, of either tile (R of Operand::pack).
constexpr int GEMM_MAX_STRIP = std::max({GEMM_MR, GEMM_NR, GEMM_TALL_MR, GEMM_TALL_NV * W});
enum class GemmShape { kWide, kTall };

// One GEMM operand as `rows` x K (the M rows of A, or the N columns of C for
// B), handed to the kernel in strips of R rows: a strip is kc x R floats,
// k-major, rows past the end zero.
struct Operand {
  virtual ~Operand() = default;
  // Writes rows [i0, i0 + count) x [k0, k0 + kc) as ceil(count / R) strips.
  virtual void pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int r, float* dst) const = 0;
  // A pre-packed operand: the strip holding row i0 (a multiple of R) from k0
  // on, with *stride set to the distance between strips; others return null.
  virtual const float* packed(int64_t k0, int64_t i0, int64_t* stride) const { return nullptr; }
  // An operand the kernel can read in place: rows [i0, i0 + R) at k0 are R
  // consecutive floats, with *k_stride floats from one k to the next; others
  // return null.
  virtual const float* direct(int64_t k0, int64_t i0, int64_t* k_stride) const { return nullptr; }
  // An A the micro-kernel reads in place from a channel-blocked tensor: row
  // i0 + q, k0 + kk (k0 a multiple of W, as every K block's start) at
  // p[kk / W * *block_stride + q * W + kk % W]; others return null.
  virtual const float* blocked(int64_t k0, int64_t i0, int64_t* block_stride) const { return nullptr; }
  // An A the micro-kernel reads in place row by row: row i0 + q, k0 + kk at
  // p[q * *lda + kk]; others return null.
  virtual const float* rows(int64_t k0, int64_t i0, int64_t* lda) const { return nullptr; }
};

// Row i is a[i * lda + k]: A row-major, or B given as (N, K) (x @ w.T).
struct Rows final : Operand {
  const float* a;
  int64_t lda;
  Rows(const float* a, int64_t lda) : a(a), lda(lda) {}
  void pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int r, float* dst) const override;
  const float* rows(int64_t k0, int64_t i0, int64_t* lda_out) const override {
    *lda_out = lda;
    return a + i0 * lda + k0;
  }
};

// Row i is column i of a row-major K x N matrix: b[k * ldb + i].
struct Columns final : Operand {
  const float* b;
  int64_t ldb;
  Columns(const float* b, int64_t ldb) : b(b), ldb(ldb) {}
  void pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int r, float* dst) const override;
  const float* direct(int64_t k0, int64_t i0, int64_t* k_stride) const override {
    *k_stride = ldb;
    return b + k0 * ldb + i0;
  }
};

// Row i is position i of one NCHWc image of `positions` positions and K
// channels: x[k / W * positions * W + i * W + k % W].
struct NchwcRows final : Operand {
  const float* x;
  int64_t positions;
  NchwcRows(const float* x, int64_t positions) : x(x), positions(positions) {}
  void pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int r, float* dst) const override;
  const float* blocked(int64_t k0, int64_t i0, int64_t* block_stride) const override {
    *block_stride = positions * W;
    return x + k0 / W * positions * W + i0 * W;
  }
};

// Already packed, as [strip][K][R] (see jtile.kernels.pack_gemm_weight).
struct Prepacked final : Operand {
  const float* p;
  int64_t k;
  int r;
  Prepacked(const float* p, int64_t k, int r) : p(p), k(k), r(r) {}
  void pack(int64_t, int64_t, int64_t, int64_t, int, float*) const override;
  const float* packed(int64_t k0, int64_t i0, int64_t* stride) const override {
    *stride = k * r;
    return p + i0 / r * k * r + k0 * r;
  }
};

struct GemmOutput {
  float* c;
  int64_t ldc;
  const float* row_bias;  // (M,) added along rows, or null
  const float* col_bias;  // (N,) added along columns, or null
  Epilogue ep;
  const float* residual = nullptr;  // laid out as c, added before ep, or null
  // block > 0: C is stored transposed, C[i][j] at c[i / block * block_stride +
  // j * ldc + i % block], and the residual is read there (conv: i = (image,
  // pixel) with block = pixels, j = output channel).
  int64_t block = 0, block_stride = 0;
  // Distance between C's vectors of W columns in a row: W (row-major), or,
  // with ldc = W, the size of an output channel block (C[i][j] at c[j / W *
  // vector_stride + i * W + j % W]: pixel rows written NCHWc).
  int64_t vector_stride = W;
  bool transposed() const { return block > 0; }
  int64_t column(int64_t j) const { return j / W * vector_stride + j % W; }  // offset of column j in a row
};

// serial: run on the calling thread only (a caller that parallelises over
// many small GEMMs itself); the result is the same bits either way. shape:
// the register tile (A's strips of MR rows, pre-packed ones included).
void gemm(ffi::ThreadPool& pool, int64_t m, int64_t n, int64_t k, const Operand& a,
          const Operand& b, const GemmOutput& out, bool serial = false, GemmShape shape = GemmShape::kWide);

// `batch` independent GEMMs of one shape: `element(i, compute)` calls
// `compute(a, b, out)` with element i's operands and output. With at least as
// many elements as workers, each element runs whole on one worker (one
// parallel_for for the batch, not two per element); otherwise one after
// another, each spread over the pool. The bits do not depend on the choice.
using GemmCompute = std::function<void(const Operand&, const Operand&, const GemmOutput&)>;
using GemmElement = std::function<void(int64_t, const GemmCompute&)>;
void gemm_batched(ffi::ThreadPool& pool, int64_t batch, int64_t m, int64_t n, int64_t k,
                  const GemmElement& element);

}  // namespace jtile
