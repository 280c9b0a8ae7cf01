// Packed, register-blocked single-precision GEMM shared by dense and the
// im2col convolution: C = epilogue(A B + bias), A row-major M x K, B supplied
// as packed panels by a BPacker (a plain matrix, or im2col gathered straight
// into the packed layout), C row-major with leading dimension ldc.
#pragma once

#include "common.h"

namespace jtile {

// Micro-tile: MR rows of C by NR = NV vectors of columns.
#if defined(JTILE_GEMM_MR) && defined(JTILE_GEMM_NV)  // for tuning experiments
constexpr int GEMM_MR = JTILE_GEMM_MR, GEMM_NV = JTILE_GEMM_NV;
#elif defined(__AVX512F__)
constexpr int GEMM_MR = 8, GEMM_NV = 2;
#else
constexpr int GEMM_MR = 6, GEMM_NV = 2;
#endif
constexpr int GEMM_NR = GEMM_NV * W;

// Writes the kc x nc block of B starting at (k0, n0) as ceil(nc / GEMM_NR)
// strips, each kc rows of GEMM_NR floats, columns past nc set to zero.
struct BPacker {
  virtual ~BPacker() = default;
  virtual void pack(int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst) const = 0;
};

// B as a row-major K x N matrix with leading dimension ldb.
struct RowMajorB final : BPacker {
  const float* b;
  int64_t ldb;
  RowMajorB(const float* b, int64_t ldb) : b(b), ldb(ldb) {}
  void pack(int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst) const override;
};

struct GemmOutput {
  float* c;
  int64_t ldc;
  const float* row_bias;  // (M,) added along rows (conv: one per output channel), or null
  const float* col_bias;  // (N,) added along columns (dense), or null
  Epilogue ep;
};

void gemm(ffi::ThreadPool& pool, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const BPacker& b, const GemmOutput& out);

}  // namespace jtile
