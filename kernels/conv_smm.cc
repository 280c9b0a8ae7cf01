// Convolution as GEMM ("smm", as ai3 calls it): for each image and group,
// out (O/g x OH*OW) = w (O/g x C/g*KH*KW) times im2col(x). The im2col matrix
// is never materialised: the GEMM's B packer gathers it straight into packed
// panels. A 1x1, stride-1, unpadded conv needs no gathering at all: x itself
// is the B matrix.
#include "gemm.h"

namespace jtile {
namespace {

// im2col of one image's group channels, rows (c, ky, kx), columns (oy, ox).
// A packed strip's columns are split into runs that stay in one output row;
// for each row of B a run is then one strided (at stride 1, contiguous) read
// of an input row, zero-filled where it falls into the padding.
struct Im2colB final : BPacker {
  const ConvShape& s;
  const float* x;  // first channel of the group in this image
  Im2colB(const ConvShape& s, const float* x) : s(s), x(x) {}

  struct Run {
    int q0, len;       // columns [q0, q0 + len) of the strip
    int64_t iy, ix;    // input position of the first column's (0, 0) tap
  };

  void pack(int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst) const override {
    const int64_t taps = s.kh * s.kw;
    for (int64_t j = 0; j < nc; j += GEMM_NR, dst += kc * GEMM_NR) {
      const int cols = (int)std::min<int64_t>(GEMM_NR, nc - j);
      Run runs[GEMM_NR];
      int nruns = 0;
      for (int q = 0; q < cols;) {
        const int64_t p = n0 + j + q, oy = p / s.ow, ox = p % s.ow;
        const int len = (int)std::min<int64_t>(cols - q, s.ow - ox);
        runs[nruns++] = Run{q, len, oy * s.sh - s.pt, ox * s.sw - s.pl};
        q += len;
      }
      for (int64_t kk = 0; kk < kc; ++kk) {
        const int64_t c = (k0 + kk) / taps, tap = (k0 + kk) % taps;
        const int64_t dy = tap / s.kw * s.dh, dx = tap % s.kw * s.dw;
        float* d = dst + kk * GEMM_NR;
        std::fill(d + cols, d + GEMM_NR, 0.0f);
        for (int r = 0; r < nruns; ++r) {
          const Run& run = runs[r];
          float* out = d + run.q0;
          const int64_t iy = run.iy + dy, ix = run.ix + dx;
          if (iy < 0 || iy >= s.h) {
            std::fill(out, out + run.len, 0.0f);
            continue;
          }
          // Columns e with 0 <= ix + e * sw < w read the input, the rest are padding.
          const int64_t lo = std::min<int64_t>(run.len, ix >= 0 ? 0 : ceil_div(-ix, s.sw));
          const int64_t hi = std::max(lo, std::min<int64_t>(run.len, ix < s.w ? ceil_div(s.w - ix, s.sw) : 0));
          const float* in = x + (c * s.h + iy) * s.w + ix;
          std::fill(out, out + lo, 0.0f);
          if (s.sw == 1)
            std::memcpy(out + lo, in + lo, (hi - lo) * sizeof(float));
          else
            for (int64_t e = lo; e < hi; ++e) out[e] = in[e * s.sw];
          std::fill(out + hi, out + run.len, 0.0f);
        }
      }
    }
  }
};

ffi::Error ConvSmm(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b,
                   ffi::Span<const int64_t> attr, int64_t act, float alpha, float lo, float hi,
                   F32Result y) {
  ConvShape s;
  Epilogue ep;
  if (auto e = decode_conv(x, w, b, attr, y, &s); e.failure()) return e;
  if (auto e = make_epilogue(act, alpha, lo, hi, &ep); e.failure()) return e;
  const int64_t og = s.og(), taps = s.cg * s.kh * s.kw, pixels = s.oh * s.ow;
  const bool pointwise = s.kh == 1 && s.kw == 1 && s.sh == 1 && s.sw == 1 &&
                         s.pt + s.pb + s.pl + s.pr == 0;
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t g = 0; g < s.groups; ++g) {
      const float* xg = x.typed_data() + (n * s.c + g * s.cg) * s.h * s.w;
      GemmOutput out{y->typed_data() + (n * s.o + g * og) * pixels, pixels,
                     b.typed_data() + g * og, nullptr, ep};
      const float* wg = w.typed_data() + g * og * taps;
      if (pointwise)
        gemm(pool, og, pixels, taps, wg, taps, RowMajorB(xg, s.h * s.w), out);
      else
        gemm(pool, og, pixels, taps, wg, taps, Im2colB(s, xg), out);
    }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtileConvSmm, jtile::ConvSmm, JTILE_CONV_BINDING);
