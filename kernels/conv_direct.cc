// Direct convolution, every configuration (stride, dilation, groups,
// asymmetric padding, batch), NCHW in and out with no transposes: the input
// is copied once into a zero-padded buffer whose rows are split by column
// phase (padded column j at [j % sw][j / sw]), so that one tap of W outputs
// at column stride sw is one contiguous load. A task takes a band of output
// rows of one image and group, and computes them for every output channel,
// OB channels by up to XV vectors of W columns at a time in registers, each
// tap XV input loads and OB broadcast weights (repacked so that the OB taps
// of one (c, kh, kw) are contiguous) for OB x XV FMAs. (Image stems, 3->16
// to 3->64 at stride 2, took 1.05-1.2x as long as through `grouped`; the
// previous arrangement, a task a row of 8 channels and each tap's columns
// gathered at stride 2, took 3-4x as long as this one.)
//
// Each output sums its taps in one order (c, ky, kx), whatever the split.
#include <vector>

#include "common.h"

namespace jtile {
namespace {

constexpr int OB = 4;  // output channels per register block
constexpr int XV = 4;  // vectors of output columns per register block, at most

struct Direct {
  ConvShape s;
  int64_t pitch;  // floats per column phase of a padded row
  int64_t row;    // floats per padded row: sw phases
  int64_t plane;  // floats per padded channel
  int64_t nob;    // blocks of OB output channels per group
  int64_t taps;   // c * kh * kw of a group
  std::vector<int64_t> column;  // per kx: where column kx * dw of a padded row lies in its phases
};

// Output columns [ox0, ox0 + XVN * W) of output row `xrow` (the padded rows
// of the group's first channel that output row reads from) for output
// channels [o0, o0 + nvalid) of the block whose packed weights are `wt`.
template <int XVN>
void row_block(const Direct& d, const float* xrow, const float* wt, int64_t ox0, const float* bias,
               int64_t nvalid, const Epilogue& ep, float* yrow) {
  const ConvShape& s = d.s;
  V acc[OB][XVN];
  for (int j = 0; j < OB; ++j)
    for (int v = 0; v < XVN; ++v) acc[j][v] = vzero();
  for (int64_t c = 0; c < s.cg; ++c)
    for (int64_t ky = 0; ky < s.kh; ++ky) {
      const float* r = xrow + c * d.plane + ky * s.dh * d.row + ox0;
      for (int64_t kx = 0; kx < s.kw; ++kx, wt += OB) {
        const float* xk = r + d.column[kx];
        V xv[XVN];
        for (int v = 0; v < XVN; ++v) xv[v] = vload(xk + v * W);
        for (int o = 0; o < OB; ++o) {
          const V wo = vset1(wt[o]);
          for (int v = 0; v < XVN; ++v) acc[o][v] = vfma(wo, xv[v], acc[o][v]);
        }
      }
    }
  const int64_t plane = s.oh * s.ow;
  for (int64_t o = 0; o < nvalid; ++o)
    for (int v = 0; v < XVN; ++v) {
      const int lanes = (int)std::min<int64_t>(W, s.ow - ox0 - v * W);
      const V out = ep(vadd(acc[o][v], vset1(bias[o])));
      float* dst = yrow + o * plane + ox0 + v * W;
      if (lanes == W) vstore(dst, out); else vstore_partial(dst, out, lanes);
    }
}

using RowBlockFn = void (*)(const Direct&, const float*, const float*, int64_t, const float*, int64_t,
                            const Epilogue&, float*);
constexpr RowBlockFn kRowBlocks[XV] = {row_block<1>, row_block<2>, row_block<3>, row_block<4>};

ffi::Error ConvDirect(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b,
                      ffi::Span<const int64_t> attr, int64_t act, float alpha, float lo,
                      float hi, F32Result y) {
  Direct d;
  ConvShape& s = d.s;
  Epilogue ep;
  if (auto e = decode_conv(x, w, b, attr, y, act, alpha, lo, hi, &s, &ep); e.failure()) return e;
  if (s.n * s.o * s.oh * s.ow == 0) return ffi::Error::Success();
  const int64_t hp = s.h + s.pt + s.pb, wp = s.w + s.pl + s.pr;
  // Each phase holds what the last output vector reads past the row too.
  d.pitch = ceil_div(wp, s.sw) + XV * W;
  d.row = s.sw * d.pitch;
  d.plane = hp * d.row;
  d.nob = ceil_div(s.og(), OB);
  d.taps = s.cg * s.kh * s.kw;
  for (int64_t kx = 0; kx < s.kw; ++kx) d.column.push_back(kx * s.dw % s.sw * d.pitch + kx * s.dw / s.sw);

  // Every float of the buffer is written: zero in the padding and past the row.
  Scratch xp(s.n * s.c * d.plane, false);
  const float* xs = x.typed_data();
  constexpr int64_t kChunks = 4;  // of rows per channel, for the workers to share
  parallel_for(pool, s.n * s.c * kChunks, [&](int64_t task) {
    const int64_t nc = task / kChunks, chunk = task % kChunks;
    for (int64_t r = chunk * hp / kChunks; r < (chunk + 1) * hp / kChunks; ++r) {
      float* dst = &xp[nc * d.plane + r * d.row];
      const int64_t iy = r - s.pt;
      if (iy < 0 || iy >= s.h) {
        std::memset(dst, 0, d.row * sizeof(float));
        continue;
      }
      const float* src = xs + (nc * s.h + iy) * s.w;
      for (int64_t phase = 0; phase < s.sw; ++phase, dst += d.pitch) {
        const int64_t first = phase - s.pl;  // the input column dst[0] holds
        int64_t k = 0;
        for (; k < d.pitch && first + k * s.sw < 0; ++k) dst[k] = 0.0f;
        const int64_t end = std::clamp<int64_t>(ceil_div(s.w - first, s.sw), k, d.pitch);  // past the last input
        copy_strided(dst + k, src + first + k * s.sw, end - k, s.sw);
        k = end;
        std::memset(dst + k, 0, (d.pitch - k) * sizeof(float));
      }
    }
  });

  // Weights as [group][o-block][c][kh][kw][OB], zero past the group's channels.
  Scratch wpk = make_scratch(s.groups * d.nob * d.taps * OB);
  const float* ws = w.typed_data();
  for (int64_t o = 0; o < s.o; ++o) {
    const int64_t g = o / s.og(), ob = o % s.og() / OB, j = o % s.og() % OB;
    for (int64_t t = 0; t < d.taps; ++t) wpk[((g * d.nob + ob) * d.taps + t) * OB + j] = ws[o * d.taps + t];
  }

  const Bias bias_of(b, s.o);
  const float* bias = bias_of.data();
  float* ys = y->typed_data();
  const int64_t rows = std::max<int64_t>(1, ceil_div(s.oh * s.n * s.groups, 8 * int64_t(workers(pool))));
  const int64_t bands = ceil_div(s.oh, rows);
  parallel_for(pool, s.n * s.groups * bands, [&](int64_t task) {
    const int64_t band = task % bands, g = task / bands % s.groups, n = task / bands / s.groups;
    for (int64_t oy = band * rows; oy < std::min(s.oh, (band + 1) * rows); ++oy) {
      const float* xrow = &xp[(n * s.c + g * s.cg) * d.plane + oy * s.sh * d.row];
      for (int64_t ob = 0; ob < d.nob; ++ob) {
        const int64_t o0 = g * s.og() + ob * OB, nvalid = std::min<int64_t>(OB, s.og() - ob * OB);
        const float* wt = &wpk[(g * d.nob + ob) * d.taps * OB];
        float* yrow = ys + ((n * s.o + o0) * s.oh + oy) * s.ow;
        for (int64_t ox0 = 0; ox0 < s.ow; ox0 += XV * W) {
          const int64_t vectors = std::min<int64_t>(XV, ceil_div(s.ow - ox0, W));
          kRowBlocks[vectors - 1](d, xrow, wt, ox0, bias + o0, nvalid, ep, yrow);
        }
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileConvDirect, jtile::ConvDirect, JTILE_CONV_BINDING);
