// Depthwise convolution: groups == input channels, any channel multiplier
// (output channel o reads input channel o / multiplier), any kernel size,
// stride, dilation and padding, NCHW input, OIHW weight (O, 1, KH, KW).
//
// Tasks run over (batch, input channel) planes: each plane is copied into a
// per-worker buffer with its zero padding and its columns split into
// `stride_w` phases (column i * stride_w + j goes to phase j, index i), so that
// every tap of every output row is a contiguous, unit-stride vector load.
// Outputs are accumulated three rows by up to four vectors of W columns at a
// time in registers, and finished with the fused bias + activation.
//
// The sum runs over every tap, padding included, so NaN and Inf propagate as
// in the direct definition (0 * Inf in the padding gives NaN, as
// lax.conv_general_dilated does).
#include <vector>

#include "common.h"

namespace jtile {
namespace {

struct Plan {
  ConvShape s;
  int64_t mult;      // output channels per input channel
  int64_t rows;      // padded input rows the outputs need
  int64_t phase;     // stride of one phase row in the plane buffer (floats)
  std::vector<int64_t> taps;  // buffer offset of each (ky, kx) tap from its output row
  std::vector<uint32_t> lanes;  // valid lanes of the W-value loads of one padded row

  int64_t plane_size() const { return rows * s.sw * phase + W; }
};

// Values [j W, j W + W) of a padded row whose value k is xrow[k - pl] for the
// lanes p.lanes[j] marks, zero in the others.
inline V load_padded(const Plan& p, const float* xrow, int64_t j) {
  const uint32_t lanes = p.lanes[j];
  const float* src = xrow + j * W - p.s.pl;
  if (lanes == (1u << W) - 1u) return vload(src);
  if (lanes == 0) return vzero();
#if defined(__AVX512F__)
  return {_mm512_maskz_loadu_ps(__mmask16(lanes), src)};  // masked-off lanes are not read
#else
  alignas(64) float t[W];
  for (int e = 0; e < W; ++e) t[e] = lanes >> e & 1u ? src[e] : 0.0f;
  return vload(t);
#endif
}

// buf[(r * sw + j) * phase + i] = padded input[r][i * sw + j], zero outside.
void pad_plane(const Plan& p, const float* x, float* buf) {
  const ConvShape& s = p.s;
  const int64_t len = s.sw * p.phase;
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t y = r - s.pt;
    float* dst = buf + r * len;
    if (y < 0 || y >= s.h) {
      for (int64_t i = 0; i < len; i += W) vstore(dst + i, vzero());  // len is a multiple of W
      continue;
    }
    const float* xrow = x + y * s.w;
    // The next plane is likely the next task's: start fetching its row.
    for (int64_t i = 0; i < s.w; i += 64 / sizeof(float)) __builtin_prefetch(xrow + s.h * s.w + i);
    int64_t i = 0;
#if defined(__AVX512F__)
    if (s.sw == 2) {  // split into even and odd columns with two permutes per 32 values
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      for (; i < p.phase; i += W) {
        const V a = load_padded(p, xrow, 2 * i / W), b = load_padded(p, xrow, 2 * i / W + 1);
        _mm512_storeu_ps(dst + i, _mm512_permutex2var_ps(a.v, even, b.v));
        _mm512_storeu_ps(dst + p.phase + i, _mm512_permutex2var_ps(a.v, odd, b.v));
      }
    }
#endif
    if (s.sw == 1)
      for (; i < p.phase; i += W) vstore(dst + i, load_padded(p, xrow, i / W));
    for (; i < p.phase; ++i)  // other strides: one value at a time
      for (int64_t j = 0; j < s.sw; ++j) {
        const int64_t k = i * s.sw + j;
        dst[j * p.phase + i] = k >= s.pl && k < s.pl + s.w ? xrow[k - s.pl] : 0.0f;
      }
  }
}

// NB vectors from column ox0 of R output rows from oy, for output channel
// weights wo. Rows3x3: a 3x3 kernel with row stride and row dilation 1, where
// output rows share input rows: each input vector is loaded once for all the
// taps and output rows it feeds.
template <int NB, int R, bool Rows3x3>
inline void row_block(const Plan& p, const float* buf, const float* wo, int64_t oy, int64_t ox0,
                      float bias, const Epilogue& ep, float* y) {
  const ConvShape& s = p.s;
  const int64_t row_stride = s.sh * s.sw * p.phase;
  const float* row = buf + oy * row_stride + ox0;
  V acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NB; ++v) acc[r][v] = vzero();
  if constexpr (Rows3x3) {
#pragma GCC unroll 8
    for (int in = 0; in < R + 2; ++in)
#pragma GCC unroll 3
      for (int kx = 0; kx < 3; ++kx) {
        V xv[NB];
        for (int v = 0; v < NB; ++v) xv[v] = vload(row + in * row_stride + p.taps[kx] + v * W);
#pragma GCC unroll 3
        for (int ky = 0; ky < 3; ++ky) {
          if (in - ky < 0 || in - ky >= R) continue;
          const V wv = vset1(wo[ky * 3 + kx]);
          for (int v = 0; v < NB; ++v) acc[in - ky][v] = vfma(wv, xv[v], acc[in - ky][v]);
        }
      }
  } else {
    const int64_t ntaps = s.kh * s.kw;
    for (int64_t t = 0; t < ntaps; ++t) {
      const float* src = row + p.taps[t];
      const V wv = vset1(wo[t]);
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NB; ++v) acc[r][v] = vfma(wv, vload(src + r * row_stride + v * W), acc[r][v]);
    }
  }
  const V bv = vset1(bias);
  for (int r = 0; r < R; ++r) {
    float* yrow = y + (oy + r) * s.ow + ox0;
    for (int v = 0; v < NB; ++v) {
      const int64_t n = std::min<int64_t>(W, s.ow - ox0 - v * W);
      const V out = ep(vadd(acc[r][v], bv));
      if (n == W) vstore(yrow + v * W, out);
      else vstore_partial(yrow + v * W, out, int(n));
    }
  }
}

// Output rows [oy, oy + R), all nvec vectors of each.
template <int R, bool Rows3x3>
void rows_block(const Plan& p, const float* buf, const float* wo, int64_t oy, int64_t nvec,
                float bias, const Epilogue& ep, float* y) {
  int64_t v = 0;
  for (; v + 4 <= nvec; v += 4) row_block<4, R, Rows3x3>(p, buf, wo, oy, v * W, bias, ep, y);
  switch (nvec - v) {
    case 3: row_block<3, R, Rows3x3>(p, buf, wo, oy, v * W, bias, ep, y); break;
    case 2: row_block<2, R, Rows3x3>(p, buf, wo, oy, v * W, bias, ep, y); break;
    case 1: row_block<1, R, Rows3x3>(p, buf, wo, oy, v * W, bias, ep, y); break;
    default: break;
  }
}

template <bool Rows3x3>
void output_rows(const Plan& p, const float* buf, const float* wo, float bias,
                 const Epilogue& ep, float* y) {
  const int64_t nvec = ceil_div(p.s.ow, W);
  int64_t oy = 0;
  for (; oy + 3 <= p.s.oh; oy += 3) rows_block<3, Rows3x3>(p, buf, wo, oy, nvec, bias, ep, y);
  for (; oy < p.s.oh; ++oy) rows_block<1, Rows3x3>(p, buf, wo, oy, nvec, bias, ep, y);
}

void output_plane(const Plan& p, const float* buf, const float* wo, float bias,
                  const Epilogue& ep, float* y) {
  const ConvShape& s = p.s;
  if (s.kh == 3 && s.kw == 3 && s.sh == 1 && s.dh == 1) output_rows<true>(p, buf, wo, bias, ep, y);
  else output_rows<false>(p, buf, wo, bias, ep, y);
}

ffi::Error ConvDepthwise(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b,
                         ffi::Span<const int64_t> attr, int64_t act, float alpha, float lo,
                         float hi, F32Result y) {
  Plan p;
  ConvShape& s = p.s;
  Epilogue ep;
  if (auto e = decode_conv(x, w, b, attr, y, act, alpha, lo, hi, &s, &ep); e.failure()) return e;
  if (s.groups != s.c || s.cg != 1)
    return ffi::Error::InvalidArgument("jtile depthwise: needs groups == input channels");
  if (s.n * s.o * s.oh * s.ow == 0) return ffi::Error::Success();
  p.mult = s.o / s.c;
  p.rows = (s.oh - 1) * s.sh + (s.kh - 1) * s.dh + 1;
  p.phase = (ceil_div(s.ow, W) * W + (s.kw - 1) * s.dw / s.sw + 1 + W - 1) / W * W;
  for (int64_t ky = 0; ky < s.kh; ++ky)
    for (int64_t kx = 0; kx < s.kw; ++kx)
      p.taps.push_back((ky * s.dh * s.sw + kx * s.dw % s.sw) * p.phase + kx * s.dw / s.sw);
  for (int64_t k = 0; k < s.sw * p.phase; k += W) {  // input columns are padded columns [pl, pl + w)
    const int64_t first = std::clamp<int64_t>(s.pl - k, 0, W), last = std::clamp<int64_t>(s.pl + s.w - k, 0, W);
    p.lanes.push_back(first < last ? ((1u << last) - 1u) & ~((1u << first) - 1u) : 0u);
  }

  const float *xs = x.typed_data(), *ws = w.typed_data(), *bias = b.typed_data();
  float* ys = y->typed_data();
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
        output_plane(p, buf, ws + o * s.kh * s.kw, bias[o], ep, ys + (n * s.o + o) * s.oh * s.ow);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtileConvDepthwise, jtile::ConvDepthwise, JTILE_CONV_BINDING);
