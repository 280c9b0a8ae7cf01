// Direct convolution, every configuration (stride, dilation, groups,
// asymmetric padding, batch): the input is copied once into a zero-padded
// buffer, then each task computes one output row for a block of OB output
// channels, W output columns at a time, with the OB x W accumulators held in
// registers (OB x XV vectors of W columns) and the weights repacked so that
// the OB taps of one (c, kh, kw) are contiguous.
#include "common.h"

namespace jtile {
namespace {

constexpr int OB = 8;  // output channels per register block
constexpr int XV = 2;  // vectors of output columns per register block

ffi::Error ConvDirect(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b,
                      ffi::Span<const int64_t> attr, int64_t act, float alpha, float lo,
                      float hi, F32Result y) {
  ConvShape s;
  Epilogue ep;
  if (auto e = decode_conv(x, w, b, attr, y, act, alpha, lo, hi, &s, &ep); e.failure()) return e;
  const int64_t hp = s.h + s.pt + s.pb, wp = s.w + s.pl + s.pr, plane = hp * wp;
  const int64_t og = s.og(), nob = ceil_div(og, OB), taps = s.cg * s.kh * s.kw;

  // Zero-padded input, with slack for the lanes of the last vector past a row.
  Scratch xp = make_scratch(s.n * s.c * plane + XV * W * s.sw);
  const float* xs = x.typed_data();
  parallel_for(pool, s.n * s.c, [&](int64_t nc) {
    for (int64_t r = 0; r < s.h; ++r)
      std::memcpy(&xp[nc * plane + (r + s.pt) * wp + s.pl], xs + (nc * s.h + r) * s.w,
                  s.w * sizeof(float));
  });

  // Weights as [group][o-block][c][kh][kw][OB], zero past the group's channels.
  Scratch wpk = make_scratch(s.groups * nob * taps * OB);
  const float* ws = w.typed_data();
  for (int64_t o = 0; o < s.o; ++o) {
    int64_t g = o / og, ob = (o % og) / OB, j = o % og % OB;
    for (int64_t t = 0; t < taps; ++t)
      wpk[((g * nob + ob) * taps + t) * OB + j] = ws[o * taps + t];
  }

  const Bias bias_of(b, s.o);
  const float* bias = bias_of.data();
  float* ys = y->typed_data();
  parallel_for(pool, s.n * s.groups * nob * s.oh, [&](int64_t task) {
    const int64_t oh = task % s.oh, ob = task / s.oh % nob, g = task / s.oh / nob % s.groups,
                  n = task / s.oh / nob / s.groups;
    const int64_t o0 = g * og + ob * OB, nvalid = std::min<int64_t>(OB, og - ob * OB);
    const float* wblock = &wpk[(g * nob + ob) * taps * OB];
    const float* xrow = &xp[(n * s.c + g * s.cg) * plane + oh * s.sh * wp];
    for (int64_t ow0 = 0; ow0 < s.ow; ow0 += XV * W) {
      V acc[OB][XV];
      for (int j = 0; j < OB; ++j)
        for (int v = 0; v < XV; ++v) acc[j][v] = vzero();
      const float* wt = wblock;
      for (int64_t c = 0; c < s.cg; ++c)
        for (int64_t ky = 0; ky < s.kh; ++ky) {
          const float* xk = xrow + c * plane + ky * s.dh * wp + ow0 * s.sw;
          for (int64_t kx = 0; kx < s.kw; ++kx, wt += OB) {
            V xv[XV];
            for (int v = 0; v < XV; ++v) xv[v] = vload_strided(xk + kx * s.dw + v * W * s.sw, s.sw);
            for (int j = 0; j < OB; ++j) {
              const V wj = vset1(wt[j]);
              for (int v = 0; v < XV; ++v) acc[j][v] = vfma(wj, xv[v], acc[j][v]);
            }
          }
        }
      for (int64_t j = 0; j < nvalid; ++j) {
        float* dst = ys + ((n * s.o + o0 + j) * s.oh + oh) * s.ow + ow0;
        for (int v = 0; v < XV; ++v) {
          const int lanes = (int)std::min<int64_t>(W, s.ow - ow0 - v * W);
          if (lanes <= 0) break;
          V out = ep(vadd(acc[j][v], vset1(bias[o0 + j])));
          if (lanes == W) vstore(dst + v * W, out); else vstore_partial(dst + v * W, out, lanes);
        }
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileConvDirect, jtile::ConvDirect, JTILE_CONV_BINDING);
