// Depthwise convolution: groups == input channels, any channel multiplier
// (output channel o reads input channel o / multiplier), any kernel size,
// stride, dilation and padding, NCHW input, OIHW weight (O, 1, KH, KW). With
// one output channel per input channel, x and y may be NCHWc instead
// ("x_nchwc", "y_nchwc"): channel blocks then copy the input band in and
// store it out as it is.
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
//   feeds. Faster than planes on strided layers and narrow planes.
// - Planes, for 3x3 and 5x5 stride-1 layers with wide enough rows (see
//   planes_pay), where that is 1.05-1.7x faster (the taps do not pay for two
//   transposes): a task copies one input plane with its zero padding into a
//   per-worker buffer and accumulates three output rows by up to four vectors
//   of W columns in registers, each input vector loaded once for the taps and
//   rows it feeds. (At stride 2, planes whose rows were split by column
//   parity measured 0.9-1.15x the time of channel blocks, so they are not used.)
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
  int k;            // square kernel, 3 or 5
  int64_t mult;     // output channels per input channel
  int64_t pitch;    // floats per padded row in the plane buffer (a multiple of W)
  std::vector<uint32_t> lanes;  // valid lanes of the W-value loads of one padded row

  int64_t rows() const { return s.oh + k - 1; }
  int64_t plane_size() const { return rows() * pitch + W; }
};

Planes make_planes(const ConvShape& s) {
  // Output vector v, tap kx reads columns v * W + kx + [0, W).
  Planes p{s, (int)s.kh, s.o / s.c, ceil_div(ceil_div(s.ow, W) * W + s.kw - 1, W) * W, {}};
  for (int64_t k = 0; k < p.pitch; k += W) {  // input columns are padded columns [pl, pl + w)
    const int64_t first = std::clamp<int64_t>(s.pl - k, 0, W), last = std::clamp<int64_t>(s.pl + s.w - k, 0, W);
    p.lanes.push_back(first < last ? ((1u << last) - 1u) & ~((1u << first) - 1u) : 0u);
  }
  return p;
}

// buf[r * pitch + i] = padded input[r][i], zero outside the input.
void pad_plane(const Planes& p, const float* x, float* buf) {
  const ConvShape& s = p.s;
  for (int64_t r = 0; r < p.rows(); ++r) {
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

// NB vectors from column ox0 of R output rows from oy of a K x K kernel:
// output rows share input rows, so each input vector is loaded once for all
// the taps and output rows it feeds.
template <int K, int NB, int R>
inline void plane_block(const Planes& p, const float* buf, const float* wo, int64_t oy, int64_t ox0,
                        float bias, const Epilogue& ep, float* y) {
  const float* row = buf + oy * p.pitch + ox0;
  V acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NB; ++v) acc[r][v] = vzero();
#pragma GCC unroll 8
  for (int in = 0; in < R + K - 1; ++in)
#pragma GCC unroll 5
    for (int kx = 0; kx < K; ++kx) {
      V xv[NB];
      for (int v = 0; v < NB; ++v) xv[v] = vload(row + in * p.pitch + kx + v * W);
#pragma GCC unroll 5
      for (int ky = 0; ky < K; ++ky) {
        if (in - ky < 0 || in - ky >= R) continue;
        const V wv = vset1(wo[ky * K + kx]);
        for (int v = 0; v < NB; ++v) acc[in - ky][v] = vfma(wv, xv[v], acc[in - ky][v]);
      }
    }
  const V bv = vset1(bias);
  ep.visit([&](auto act) {
    for (int r = 0; r < R; ++r) {
      float* yrow = y + (oy + r) * p.s.ow + ox0;
      for (int v = 0; v < NB; ++v) {
        const int64_t n = std::min<int64_t>(W, p.s.ow - ox0 - v * W);
        const V out = act(vadd(acc[r][v], bv));
        if (n == W) vstore(yrow + v * W, out);
        else vstore_partial(yrow + v * W, out, int(n));
      }
    }
  });
}

// Output rows [oy, oy + R), all nvec vectors of each.
template <int K, int R>
void plane_rows(const Planes& p, const float* buf, const float* wo, int64_t oy, int64_t nvec,
                float bias, const Epilogue& ep, float* y) {
  int64_t v = 0;
  for (; v + 4 <= nvec; v += 4) plane_block<K, 4, R>(p, buf, wo, oy, v * W, bias, ep, y);
  switch (nvec - v) {
    case 3: plane_block<K, 3, R>(p, buf, wo, oy, v * W, bias, ep, y); break;
    case 2: plane_block<K, 2, R>(p, buf, wo, oy, v * W, bias, ep, y); break;
    case 1: plane_block<K, 1, R>(p, buf, wo, oy, v * W, bias, ep, y); break;
    default: break;
  }
}

// Every row of one output plane.
template <int K>
void plane_all_rows(const Planes& p, const float* buf, const float* wo, int64_t nvec, float bias,
                    const Epilogue& ep, float* y) {
  int64_t oy = 0;
  for (; oy + 3 <= p.s.oh; oy += 3) plane_rows<K, 3>(p, buf, wo, oy, nvec, bias, ep, y);
  for (; oy < p.s.oh; ++oy) plane_rows<K, 1>(p, buf, wo, oy, nvec, bias, ep, y);
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
        float* y = ys + (n * s.o + o) * s.oh * s.ow;
        if (p.k == 3) plane_all_rows<3>(p, buf, ws + o * 9, nvec, bias[o], ep, y);
        else plane_all_rows<5>(p, buf, ws + o * 25, nvec, bias[o], ep, y);
      }
    }
  });
}

// Planes pay where a row fills enough lanes to beat the two transposes of
// the channel-blocked arrangement (measured, AVX-512, rows of 7 to 112
// outputs): 3x3 from rows of W outputs (1.3-1.7x at 16 to 112; level at 14,
// 0.55x at 7), 5x5 from 7W/4 (1.05-1.35x at 28 to 56; 0.95x at 24, 0.5x at 7).
bool planes_pay(const ConvShape& s) {
  if (s.kh != s.kw || s.sh != 1 || s.sw != 1 || s.dh != 1 || s.dw != 1) return false;
  return (s.kh == 3 && s.ow >= W) || (s.kh == 5 && 4 * s.ow >= 7 * W);
}

// ---------------------------------------------------------------- handler

ffi::Error ConvDepthwise(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b,
                         ffi::Span<const int64_t> attr, int64_t act, float alpha, float lo,
                         float hi, int64_t x_nchwc, int64_t y_nchwc, F32Result y) {
  ConvShape s;
  Epilogue ep;
  const Layouts layouts{x_nchwc != 0, y_nchwc != 0};
  if (auto e = decode_conv(x, w, b, attr, y, act, alpha, lo, hi, &s, &ep, -1, layouts); e.failure()) return e;
  if (s.groups != s.c || s.cg != 1)
    return ffi::Error::InvalidArgument("jtile depthwise: needs groups == input channels");
  if ((layouts.x || layouts.y) && s.o != s.c)
    return ffi::Error::InvalidArgument("jtile depthwise: NCHWc x or y needs one output channel per input channel");
  if (s.n * s.o * s.oh * s.ow == 0) return ffi::Error::Success();
  const Bias bias(b, s.o);
  if (planes_pay(s) && !layouts.x && !layouts.y)
    conv_planes(pool, s, x.typed_data(), w.typed_data(), bias.data(), ep, y->typed_data());
  else
    conv_channel_blocks(pool, s, x.typed_data(), w.typed_data(), bias.data(), ep, nullptr, y->typed_data(),
                        layouts);
  return ffi::Error::Success();
}

// The depthwise conv of act(we x + be), a 1x1 conv's output computed band by
// band inside it (channel blocks with an Expansion): x (N, c, H, W) NCHW, we
// (C, c), be (C,), w (C, 1, KH, KW). The 1x1 conv's activation comes as the
// "expand_*" epilogue attributes.
ffi::Error ConvExpandedDepthwise(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b,
                                 ffi::Span<const int64_t> attr, int64_t act, float alpha, float lo, float hi,
                                 F32Buffer we, F32Buffer be, int64_t expand_act, float expand_alpha,
                                 float expand_lo, float expand_hi, int64_t y_nchwc, F32Result y) {
  const auto xd = x.dimensions(), ed = we.dimensions(), wd = w.dimensions();
  if (xd.size() != 4 || ed.size() != 2 || wd.size() != 4 || ed[1] != xd[1] || !Bias::fits(be, ed[0]))
    return ffi::Error::InvalidArgument(
        "jtile expanded depthwise: expected x (N, c, H, W), an expansion weight (C, c) and bias (C,) or (1,)");
  // The depthwise conv's geometry, as if x were the expansion's output.
  const int64_t expanded[4] = {xd[0], ed[0], xd[2], xd[3]}, weight[4] = {wd[0], wd[1], wd[2], wd[3]};
  ConvShape s;
  const Bias expand_bias(be, ed[0]);
  Expansion e{we.typed_data(), expand_bias.data(), xd[1], {}};
  Epilogue ep;
  const Layouts layouts{false, y_nchwc != 0};
  if (auto err = decode_conv(ffi::Span<const int64_t>(expanded, 4), weight, b, attr, y, act, alpha, lo, hi, &s, &ep,
                             -1, {}, -1, layouts);
      err.failure())
    return err;
  if (auto err = make_epilogue(expand_act, expand_alpha, expand_lo, expand_hi, &e.ep); err.failure()) return err;
  if (s.groups != s.c || s.cg != 1 || s.o != s.c)
    return ffi::Error::InvalidArgument("jtile expanded depthwise: needs one output channel per input channel");
  if (s.n * s.o * s.oh * s.ow == 0) return ffi::Error::Success();
  const Bias bias(b, s.o);
  conv_channel_blocks(pool, s, x.typed_data(), w.typed_data(), bias.data(), ep, nullptr, y->typed_data(),
                      layouts, &e);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileConvDepthwise, jtile::ConvDepthwise,
                     JTILE_CONV_ARGS.Attr<int64_t>("x_nchwc").Attr<int64_t>("y_nchwc").Ret<jtile::F32Buffer>());
JTILE_DEFINE_HANDLER(JtileConvExpandedDepthwise, jtile::ConvExpandedDepthwise,
                     JTILE_CONV_ARGS.Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Attr<int64_t>("expand_activation")
                         .Attr<float>("expand_alpha")
                         .Attr<float>("expand_clip_lo")
                         .Attr<float>("expand_clip_hi")
                         .Attr<int64_t>("y_nchwc")
                         .Ret<jtile::F32Buffer>());
