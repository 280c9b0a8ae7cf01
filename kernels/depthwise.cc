// Depthwise convolution: groups == input channels, any channel multiplier
// (output channel o reads input channel o / multiplier), any kernel size,
// stride, dilation and padding, NCHW input, OIHW weight (O, 1, KH, KW).
//
// Two arrangements, picked by shape (measured against each other on
// EfficientNet-B0's and MobileNetV3's layers, and 3x3 layers from 14x14 to
// 112x112):
//
// - Channel-blocked (kernels/channel_blocks.cc, shared with conv_grouped.cc),
//   as ONNX Runtime's NCHWc kernels are: a task takes W output channels (one
//   vector's lanes) and a band of output rows. It transposes the input rows
//   the band needs, for the W input channels those outputs read, into a
//   per-worker buffer of padded rows of W-channel vectors
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
  if (planes)
    conv_planes(pool, s, x.typed_data(), w.typed_data(), b.typed_data(), ep, y->typed_data());
  else
    conv_channel_blocks(pool, s, x.typed_data(), w.typed_data(), b.typed_data(), ep, nullptr, y->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtileConvDepthwise, jtile::ConvDepthwise, JTILE_CONV_BINDING);
