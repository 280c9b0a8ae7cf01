// Depthwise convolution: groups == input channels, any channel multiplier
// (output channel o reads input channel o / multiplier), any kernel size,
// stride, dilation and padding, NCHW input, OIHW weight (O, 1, KH, KW).
//
// Two arrangements, picked by shape (measured against each other on
// EfficientNet-B0's and MobileNetV3's layers, and 3x3 layers from 14x14 to
// 112x112):
//
// - Channel-blocked, as ONNX Runtime's NCHWc kernels are: a task takes W
//   output channels (one vector's lanes) and a band of output rows. It
//   transposes the input rows the band needs, for the W input channels those
//   outputs read, into a per-worker buffer of padded rows of W-channel vectors
//   (zero in the padding), so that every tap of every output is one vector load
//   and one FMA, whatever the plane's width. Outputs are accumulated B columns
//   at a time in registers (B chosen per layer so that few columns are
//   wasted) with the bias, and the band is transposed back into the output
//   planes with the activation. Small planes (7x7, 14x14) thus fill every lane, and
//   3x3, 5x5 and 7x7 kernels at stride 1 or 2 have unrolled inner loops in
//   which each input vector is loaded once for all the outputs of the block it
//   feeds. 1.2-3.3x the plane arrangement on 5x5 and strided layers and on
//   planes narrower than 2W.
// - Planes, for 3x3 stride-1 layers with rows of at least 2W outputs, where
//   that is 1.15-1.6x faster (nine taps do not pay for two transposes): a task
//   copies one input plane with its zero padding into a per-worker buffer and
//   accumulates three output rows by up to four vectors of W columns in
//   registers, each input vector loaded once for the taps and rows it feeds.
//
// The sum runs over every tap, padding included, in the same order (ky, then
// kx) for every output and every band or thread split, so NaN and Inf
// propagate as in the direct definition (0 * Inf in the padding gives NaN, as
// lax.conv_general_dilated does) and results do not depend on the thread count.
#include <vector>

#include "blocked.h"

namespace jtile {
namespace {

// ---------------------------------------------------------------- channel blocks

struct Blocked {
  ConvShape s;
  int64_t mult;         // output channels per input channel
  int64_t blocks;       // blocks of W output channels
  int b;                // output columns per register block
  int64_t owp;          // output row length rounded up to b
  int64_t cols;         // padded input columns in the buffer (each W floats)
  int64_t band;         // output rows per task
  int64_t bands;

  int64_t in_rows(int64_t out_rows) const { return (out_rows - 1) * s.sh + (s.kh - 1) * s.dh + 1; }
  int64_t in_floats() const { return in_rows(band) * cols * W; }
  int64_t out_floats() const { return band * owp * W; }
};

// The input rows output rows [oy0, oy1) read, for output channels [o0, o0 +
// W), as buf[(r * cols + j) * W + lane] = padded input row oy0 * sh + r,
// column j, channel (o0 + lane) / mult. Padding columns are zero already
// (never written); rows in the vertical padding are zeroed here.
void load_band(const Blocked& p, const float* x, int64_t o0, int64_t oy0, int64_t oy1, float* buf) {
  const ConvShape& s = p.s;
  const int64_t rows = p.in_rows(oy1 - oy0), first = oy0 * s.sh - s.pt;  // input row of buffer row 0
  const int64_t y0 = std::max<int64_t>(first, 0), y1 = std::min(first + rows, s.h);
  for (int64_t r = 0; r < rows; ++r)
    if (first + r < y0 || first + r >= y1)
      for (int64_t j = 0; j < p.cols; ++j) vstore(buf + (r * p.cols + j) * W, vzero());
  if (y0 >= y1) return;
  const float* planes[W];
  const int lanes = (int)std::min<int64_t>(W, s.o - o0);
  for (int i = 0; i < lanes; ++i) planes[i] = x + (o0 + i) / p.mult * s.h * s.w;
  const int64_t end = y1 * s.w;
  const int64_t last_col = std::min(s.w, p.cols - s.pl);  // input columns past it are never read
  for (int64_t q = y0 * s.w; q < end; q += W) {
    const int count = (int)std::min<int64_t>(W, end - q);
    V r[W];
    for (int i = 0; i < W; ++i)
      r[i] = i >= lanes ? vzero() : count == W ? vload(planes[i] + q) : vload_partial(planes[i] + q, count);
    transpose(r);
    int64_t y = q / s.w, ix = q % s.w;
    for (int j = 0; j < count; ++j) {
      if (ix < last_col) vstore(buf + ((y - first) * p.cols + ix + s.pl) * W, r[j]);
      if (++ix == s.w) ix = 0, ++y;
    }
  }
}

// B output columns from the buffer position `in` (row oy * sh, column ox0 *
// sw of the band) into out (B vectors), with the bias.
// KW > 0: a KW-wide kernel at column stride S and dilation 1, unrolled so
// that each input vector is loaded once for every output it feeds; KW == 0:
// any width, stride and dilation.
template <int KW, int S, int B>
inline void out_block(const Blocked& p, const float* in, const float* wt, V bias, float* out) {
  const ConvShape& s = p.s;
  V acc[B];
  for (int b = 0; b < B; ++b) acc[b] = vzero();
  for (int64_t ky = 0; ky < s.kh; ++ky) {
    const float* row = in + ky * s.dh * p.cols * W;
    if constexpr (KW > 0) {
      const float* wrow = wt + ky * KW * W;
      V wv[KW];
      for (int kx = 0; kx < KW; ++kx) wv[kx] = vload(wrow + kx * W);
#pragma GCC unroll 32
      for (int j = 0; j < (B - 1) * S + KW; ++j) {
        const V xv = vload(row + j * W);
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) {
          const int kx = j - b * S;
          if (kx >= 0 && kx < KW) acc[b] = vfma(wv[kx], xv, acc[b]);
        }
      }
    } else {
      for (int64_t kx = 0; kx < s.kw; ++kx) {
        const V wv = vload(wt + (ky * s.kw + kx) * W);
        for (int b = 0; b < B; ++b) acc[b] = vfma(wv, vload(row + (b * s.sw + kx * s.dw) * W), acc[b]);
      }
    }
  }
  for (int b = 0; b < B; ++b) vstore(out + b * W, vadd(acc[b], bias));
}

template <int KW, int S, int B>
void compute_band(const Blocked& p, const float* buf, const float* wt, V bias, int64_t rows, float* out) {
  const int64_t row_step = p.s.sh * p.cols * W;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t ox = 0; ox < p.owp; ox += B)
      out_block<KW, S, B>(p, buf + r * row_step + ox * p.s.sw * W, wt, bias, out + (r * p.owp + ox) * W);
}

using BandFn = void (*)(const Blocked&, const float*, const float*, V, int64_t, float*);

template <int KW, int S>
BandFn pick_b(int b) {
  switch (b) {
    case 4: return compute_band<KW, S, 4>;
    case 5: return compute_band<KW, S, 5>;
    case 6: return compute_band<KW, S, 6>;
    case 7: return compute_band<KW, S, 7>;
    default: return compute_band<KW, S, 8>;
  }
}

BandFn pick(const Blocked& p) {
  const ConvShape& s = p.s;
  if (s.dw == 1 && s.sw <= 2) {
    const bool s1 = s.sw == 1;
    switch (s.kw) {
      case 3: return s1 ? pick_b<3, 1>(p.b) : pick_b<3, 2>(p.b);
      case 5: return s1 ? pick_b<5, 1>(p.b) : pick_b<5, 2>(p.b);
      case 7: return s1 ? pick_b<7, 1>(p.b) : pick_b<7, 2>(p.b);
      default: break;
    }
  }
  return pick_b<0, 0>(p.b);
}

Blocked make_blocked(const ConvShape& s, int threads) {
  Blocked p;
  p.s = s;
  p.mult = s.o / s.c;
  p.blocks = ceil_div(s.o, W);
  p.b = register_block(s.ow);
  p.owp = ceil_div(s.ow, p.b) * p.b;
  p.cols = std::max((p.owp - 1) * s.sw + (s.kw - 1) * s.dw + 1, s.pl + s.w);
  // Bands: enough tasks to balance the workers, and a buffer that stays in
  // L2 (about 128 KB), but at least 4 rows a band where the plane allows
  // (each band re-reads its kernel's overlap rows).
  const int64_t row_bytes = s.sh * p.cols * W * int64_t(sizeof(float));
  const int64_t by_size = std::max<int64_t>(1, (int64_t(128) << 10) / row_bytes);
  const int64_t by_tasks = ceil_div(s.oh * s.n * p.blocks, 4 * int64_t(threads));
  p.band = std::clamp<int64_t>(std::min(by_size, std::max<int64_t>(by_tasks, 4)), 1, s.oh);
  p.bands = ceil_div(s.oh, p.band);
  return p;
}

void conv_blocked(ffi::ThreadPool& pool, const ConvShape& s, const float* xs, const float* ws,
                  const float* bias, const Epilogue& ep, float* ys) {
  const Blocked p = make_blocked(s, workers(pool));
  const BandFn compute = pick(p);
  const int64_t taps = s.kh * s.kw;
  // Per worker: the input band (zeroed when first taken: its padding columns
  // are never written), the output band, the block's weights.
  Workspace scratch(pool, 3);
  std::vector<char> fresh(workers(pool), 1);
  parallel_for(pool, s.n * p.blocks * p.bands, [&](int64_t task, int worker) {
    const int64_t band = task % p.bands, block = task / p.bands % p.blocks, n = task / p.bands / p.blocks;
    float* in = scratch.get(worker, 0, p.in_floats(), fresh[worker]);
    float* out = scratch.get(worker, 1, p.out_floats());
    float* wt = scratch.get(worker, 2, taps * W);
    fresh[worker] = 0;
    const int64_t o0 = block * W, lanes = std::min<int64_t>(W, s.o - o0);
    alignas(64) float bv[W] = {};
    for (int64_t i = 0; i < W; ++i) {
      if (i < lanes) bv[i] = bias[o0 + i];
      for (int64_t t = 0; t < taps; ++t) wt[t * W + i] = i < lanes ? ws[(o0 + i) * taps + t] : 0.0f;
    }
    const int64_t oy0 = band * p.band, oy1 = std::min(s.oh, oy0 + p.band);
    load_band(p, xs + n * s.c * s.h * s.w, o0, oy0, oy1, in);
    compute(p, in, wt, vload(bv), oy1 - oy0, out);
    store_blocked(out, p.owp, (int)lanes, s.oh, s.ow, oy0, oy1, ep, nullptr,
                  ys + (n * s.o + o0) * s.oh * s.ow);
  });
}

// ---------------------------------------------------------------- planes

struct Planes {
  ConvShape s;
  int64_t mult;     // output channels per input channel
  int64_t pitch;    // floats per padded row in the plane buffer (a multiple of W)
  std::vector<uint32_t> lanes;  // valid lanes of the W-value loads of one padded row

  int64_t plane_size() const { return (s.oh + 2) * pitch + W; }
};

Planes make_planes(const ConvShape& s) {
  Planes p{s, s.o / s.c, (ceil_div(s.ow, W) * W + 2 + W - 1) / W * W, {}};
  for (int64_t k = 0; k < p.pitch; k += W) {  // input columns are padded columns [pl, pl + w)
    const int64_t first = std::clamp<int64_t>(s.pl - k, 0, W), last = std::clamp<int64_t>(s.pl + s.w - k, 0, W);
    p.lanes.push_back(first < last ? ((1u << last) - 1u) & ~((1u << first) - 1u) : 0u);
  }
  return p;
}

// buf[r * pitch + i] = padded input[r][i], zero outside the input.
void pad_plane(const Planes& p, const float* x, float* buf) {
  const ConvShape& s = p.s;
  for (int64_t r = 0; r < s.oh + 2; ++r) {
    const int64_t y = r - s.pt;
    float* dst = buf + r * p.pitch;
    if (y < 0 || y >= s.h) {
      for (int64_t i = 0; i < p.pitch; i += W) vstore(dst + i, vzero());
      continue;
    }
    const float* xrow = x + y * s.w;
    // The next plane is likely the next task's: start fetching its row.
    for (int64_t i = 0; i < s.w; i += 64 / sizeof(float)) __builtin_prefetch(xrow + s.h * s.w + i);
    for (int64_t i = 0; i < p.pitch; i += W) {
      const uint32_t lanes = p.lanes[i / W];
      const float* src = xrow + i - s.pl;
#if defined(__AVX512F__)
      vstore(dst + i, {_mm512_maskz_loadu_ps(__mmask16(lanes), src)});  // masked-off lanes are not read
#else
      alignas(64) float t[W];
      for (int e = 0; e < W; ++e) t[e] = lanes >> e & 1u ? src[e] : 0.0f;
      vstore(dst + i, vload(t));
#endif
    }
  }
}

// NB vectors from column ox0 of R output rows from oy: output rows share
// input rows, so each input vector is loaded once for all the taps and output
// rows it feeds.
template <int NB, int R>
inline void plane_block(const Planes& p, const float* buf, const float* wo, int64_t oy, int64_t ox0,
                        float bias, const Epilogue& ep, float* y) {
  const float* row = buf + oy * p.pitch + ox0;
  V acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NB; ++v) acc[r][v] = vzero();
#pragma GCC unroll 8
  for (int in = 0; in < R + 2; ++in)
#pragma GCC unroll 3
    for (int kx = 0; kx < 3; ++kx) {
      V xv[NB];
      for (int v = 0; v < NB; ++v) xv[v] = vload(row + in * p.pitch + kx + v * W);
#pragma GCC unroll 3
      for (int ky = 0; ky < 3; ++ky) {
        if (in - ky < 0 || in - ky >= R) continue;
        const V wv = vset1(wo[ky * 3 + kx]);
        for (int v = 0; v < NB; ++v) acc[in - ky][v] = vfma(wv, xv[v], acc[in - ky][v]);
      }
    }
  const V bv = vset1(bias);
  for (int r = 0; r < R; ++r) {
    float* yrow = y + (oy + r) * p.s.ow + ox0;
    for (int v = 0; v < NB; ++v) {
      const int64_t n = std::min<int64_t>(W, p.s.ow - ox0 - v * W);
      const V out = ep(vadd(acc[r][v], bv));
      if (n == W) vstore(yrow + v * W, out);
      else vstore_partial(yrow + v * W, out, int(n));
    }
  }
}

// Output rows [oy, oy + R), all nvec vectors of each.
template <int R>
void plane_rows(const Planes& p, const float* buf, const float* wo, int64_t oy, int64_t nvec,
                float bias, const Epilogue& ep, float* y) {
  int64_t v = 0;
  for (; v + 4 <= nvec; v += 4) plane_block<4, R>(p, buf, wo, oy, v * W, bias, ep, y);
  switch (nvec - v) {
    case 3: plane_block<3, R>(p, buf, wo, oy, v * W, bias, ep, y); break;
    case 2: plane_block<2, R>(p, buf, wo, oy, v * W, bias, ep, y); break;
    case 1: plane_block<1, R>(p, buf, wo, oy, v * W, bias, ep, y); break;
    default: break;
  }
}

void conv_planes(ffi::ThreadPool& pool, const ConvShape& s, const float* xs, const float* ws,
                 const float* bias, const Epilogue& ep, float* ys) {
  const Planes p = make_planes(s);
  const int64_t nvec = ceil_div(s.ow, W);
  // Tasks of several planes when planes are small, so that claiming a task
  // costs little next to computing it.
  const int64_t planes = s.n * s.c;
  const int64_t per_task = std::clamp<int64_t>(4096 / (p.mult * s.oh * s.ow), 1, ceil_div(planes, 8));
  Workspace scratch(pool, 1);
  parallel_for(pool, ceil_div(planes, per_task), [&](int64_t task, int worker) {
    float* buf = scratch.get(worker, 0, p.plane_size());
    for (int64_t nc = task * per_task; nc < std::min(planes, (task + 1) * per_task); ++nc) {
      const int64_t n = nc / s.c, c = nc % s.c;
      pad_plane(p, xs + nc * s.h * s.w, buf);
      for (int64_t m = 0; m < p.mult; ++m) {
        const int64_t o = c * p.mult + m;
        const float* wo = ws + o * 9;
        float* y = ys + (n * s.o + o) * s.oh * s.ow;
        int64_t oy = 0;
        for (; oy + 3 <= s.oh; oy += 3) plane_rows<3>(p, buf, wo, oy, nvec, bias[o], ep, y);
        for (; oy < s.oh; ++oy) plane_rows<1>(p, buf, wo, oy, nvec, bias[o], ep, y);
      }
    }
  });
}

// ---------------------------------------------------------------- handler

ffi::Error ConvDepthwise(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b,
                         ffi::Span<const int64_t> attr, int64_t act, float alpha, float lo,
                         float hi, F32Result y) {
  ConvShape s;
  Epilogue ep;
  if (auto e = decode_conv(x, w, b, attr, y, act, alpha, lo, hi, &s, &ep); e.failure()) return e;
  if (s.groups != s.c || s.cg != 1)
    return ffi::Error::InvalidArgument("jtile depthwise: needs groups == input channels");
  if (s.n * s.o * s.oh * s.ow == 0) return ffi::Error::Success();
  const bool planes = s.kh == 3 && s.kw == 3 && s.sh == 1 && s.sw == 1 && s.dh == 1 && s.dw == 1 &&
                      s.ow >= 2 * W;
  (planes ? conv_planes : conv_blocked)(pool, s, x.typed_data(), w.typed_data(), b.typed_data(), ep,
                                        y->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtileConvDepthwise, jtile::ConvDepthwise, JTILE_CONV_BINDING);
