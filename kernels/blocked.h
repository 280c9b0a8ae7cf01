// Helpers of the channel-blocked conv kernels (channel_blocks.cc, depthwise.cc, conv_grouped.cc),
// whose outputs are computed as vectors of W output channels per position:
// a W x W transpose, the register block width, and the store of a block of
// such vectors back into NCHW output planes.
#pragma once

#include "common.h"

namespace jtile {

// r[i] lane j becomes r[j] lane i.
inline void transpose(V (&r)[W]) {
#if defined(__AVX512F__)
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i].v, r[2 * i + 1].v);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i].v, r[2 * i + 1].v);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i].v = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1].v = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2].v = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3].v = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i].v, r[4 + i].v, 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i].v, r[4 + i].v, 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i].v, r[12 + i].v, 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i].v, r[12 + i].v, 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i].v = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i].v = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[4 + i].v = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i].v = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
#else
  alignas(64) float t[W][W];
  for (int i = 0; i < W; ++i) vstore(t[i], r[i]);
  for (int j = 0; j < W; ++j) {
    alignas(64) float col[W];
    for (int i = 0; i < W; ++i) col[i] = t[i][j];
    r[j] = vload(col);
  }
#endif
}

// Output columns per register block, 4 to 8: the width that wastes the fewest
// columns of a row of `ow` outputs (rows are computed in whole blocks), the
// widest on ties.
inline int register_block(int64_t ow) {
  int best = 8;
  for (int b = 8; b >= 4; --b)
    if (ceil_div(ow, b) * b < ceil_div(ow, best) * best) best = b;
  return best;
}

// Output rows [oy0, oy1) held in `out` as (oy - oy0, ox) -> W channels at
// out[((oy - oy0) * owp + ox) * W] (bias included), written with the residual
// (laid out as y, or null) and the activation to the first `lanes` of the
// consecutive (oh, ow) planes at y.
inline void store_blocked(const float* out, int64_t owp, int lanes, int64_t oh, int64_t ow,
                          int64_t oy0, int64_t oy1, const Epilogue& ep, const float* residual,
                          float* y) {
  const int64_t plane = oh * ow, end = oy1 * ow;
  ep.visit([&](auto act) {
    for (int64_t q = oy0 * ow; q < end; q += W) {
      const int count = (int)std::min<int64_t>(W, end - q);
      V r[W];
      int64_t oy = q / ow, ox = q % ow;
      for (int j = 0; j < W; ++j) {
        r[j] = j < count ? vload(out + ((oy - oy0) * owp + ox) * W) : vzero();
        if (++ox == ow) ox = 0, ++oy;
      }
      transpose(r);
      for (int i = 0; i < lanes; ++i) {
        const int64_t at = i * plane + q;
        V v = r[i];
        if (residual) v = vadd(v, count == W ? vload(residual + at) : vload_partial(residual + at, count));
        v = act(v);
        if (count == W) vstore(y + at, v); else vstore_partial(y + at, v, count);
      }
    }
  });
}

// A 1x1 conv (stride 1, unpadded, one group) whose output is the input of a
// channel-blocked conv, computed band by band inside it: x then holds the 1x1
// conv's input, `channels` of them, NCHW, and each band is act(w x + b) for
// the W input channels its outputs read, so the 1x1 conv's output is never
// written out. Rows a band shares with the next are computed by both.
struct Expansion {
  const float* w = nullptr;  // (C, channels): the 1x1 conv's weight, C the channel-blocked conv's input channels
  const float* b = nullptr;  // (C,)
  int64_t channels = 0;
  Epilogue ep;
};

// The conv of x by OIHW weights ws, any groups, computed on vectors of W
// consecutive output channels (kernels/channel_blocks.cc), with the bias,
// the residual (laid out as y, or null) and the activation. x and y are NCHW,
// or NCHWc where `layouts` says so (then with one group per channel, C == O):
// such a band is copied in and stored out as it is, without transposes, its
// padding lanes too (zero weights and bias there). With an `expansion` (one
// group per channel, NCHW x), bands are computed from x by it instead.
void conv_channel_blocks(ffi::ThreadPool& pool, const ConvShape& s, const float* xs, const float* ws,
                         const float* bias, const Epilogue& ep, const float* residual, float* ys,
                         Layouts layouts = {}, const Expansion* expansion = nullptr);

}  // namespace jtile
