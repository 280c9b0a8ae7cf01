// Convolution on vectors of W consecutive output channels, any groups: the
// channel-blocked arrangement of depthwise.cc (described there) and of
// conv_grouped.cc for groups of fewer than W output channels, whose lanes then
// span several groups. Lane i of a block starting at output channel o0 reads,
// for each c < C/groups, input channel c of the group of output channel o0 +
// i, so each c has its own transposed band; the taps are summed in the order
// c, ky, kx.
#include <vector>

#include "blocked.h"

namespace jtile {
namespace {

struct Blocked {
  ConvShape s;
  int64_t og;           // output channels per group
  int64_t blocks;       // blocks of W output channels
  int b;                // output columns per register block
  int64_t owp;          // output row length rounded up to b
  int64_t cols;         // padded input columns in the buffer (each W floats)
  int64_t band;         // output rows per task
  int64_t bands;

  int64_t in_rows(int64_t out_rows) const { return (out_rows - 1) * s.sh + (s.kh - 1) * s.dh + 1; }
  int64_t chunk() const { return in_rows(band) * cols * W; }  // the band of one c
  int64_t in_floats() const { return s.cg * chunk(); }
  int64_t out_floats() const { return band * owp * W; }
};

// The input rows [y0, y1) a band of output rows [oy0, oy1) reads (clipped to
// the image), with the band's rows outside them, in the vertical padding,
// zeroed; returns the input row of the band's first buffer row.
int64_t band_rows(const Blocked& p, int64_t oy0, int64_t oy1, float* buf, int64_t* y0, int64_t* y1) {
  const ConvShape& s = p.s;
  const int64_t rows = p.in_rows(oy1 - oy0), first = oy0 * s.sh - s.pt;  // input row of buffer row 0
  *y0 = std::max<int64_t>(first, 0), *y1 = std::min(first + rows, s.h);
  for (int64_t r = 0; r < rows; ++r)
    if (first + r < *y0 || first + r >= *y1)
      for (int64_t j = 0; j < p.cols; ++j) vstore(buf + (r * p.cols + j) * W, vzero());
  return first;
}

// The input rows output rows [oy0, oy1) read, for output channels [o0, o0 +
// W), as buf[(r * cols + j) * W + lane] = padded input row oy0 * sh - pt + r,
// column j, of input channel c of the group of output channel o0 + lane (x
// NCHW, or with `nchwc` NCHWc, channel o0 + lane itself: depthwise).
// Padding columns are zero already (never written); rows in the vertical
// padding are zeroed here.
void load_band(const Blocked& p, const float* x, int64_t o0, int64_t c, int64_t oy0, int64_t oy1, bool nchwc,
               float* buf) {
  const ConvShape& s = p.s;
  int64_t y0, y1;
  const int64_t first = band_rows(p, oy0, oy1, buf, &y0, &y1);
  if (y0 >= y1) return;
  if (nchwc) {  // x + ((o0 / W) * h + y) * w * W holds row y's vectors of the lanes' channels
    const int64_t count = std::min(s.w, p.cols - s.pl) * W;
    for (int64_t y = y0; y < y1; ++y) {
      const float* src = x + ((o0 / W) * s.h + y) * s.w * W;
      float* dst = buf + ((y - first) * p.cols + s.pl) * W;
      for (int64_t i = 0; i < count; i += W) vstore(dst + i, vload(src + i));
    }
    return;
  }
  const float* planes[W];
  const int lanes = (int)std::min<int64_t>(W, s.o - o0);
  for (int i = 0; i < lanes; ++i) planes[i] = x + ((o0 + i) / p.og * s.cg + c) * s.h * s.w;
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

// P consecutive pixels of the expansion's output, act(sum_k wt[k] x[k] + bias)
// for a block's W channels (wt: the block's weight, `channels` vectors), from
// x at the first pixel (planes `plane` floats apart) into P vectors at dst.
template <int P, typename Act>
inline void expand_pixels(const float* x, int64_t plane, int64_t channels, const float* wt, V bias, Act act,
                          float* dst) {
  V acc[P];
  for (int j = 0; j < P; ++j) acc[j] = vzero();
  for (int64_t k = 0; k < channels; ++k, x += plane) {
    const V wv = vload(wt + k * W);
    for (int j = 0; j < P; ++j) acc[j] = vfma(vset1(x[j]), wv, acc[j]);
  }
  for (int j = 0; j < P; ++j) vstore(dst + j * W, act(vadd(acc[j], bias)));
}

// load_band's band computed by the expansion from its input x (one image,
// NCHW): wt its weight for the block's W channels (`channels` vectors), bias
// theirs. The padding stays zero: it pads the expansion's output.
void expand_band(const Blocked& p, const float* x, const Expansion& e, const float* wt, V bias, int64_t oy0,
                 int64_t oy1, float* buf) {
  const ConvShape& s = p.s;
  int64_t y0, y1;
  const int64_t first = band_rows(p, oy0, oy1, buf, &y0, &y1);
  const int64_t plane = s.h * s.w, last_col = std::min(s.w, p.cols - s.pl);  // columns past it are never read
  e.ep.visit([&](auto act) {
    for (int64_t y = y0; y < y1; ++y) {
      const float* row = x + y * s.w;
      float* dst = buf + ((y - first) * p.cols + s.pl) * W;
      int64_t i = 0;
      for (; i + 16 <= last_col; i += 16) expand_pixels<16>(row + i, plane, e.channels, wt, bias, act, dst + i * W);
      for (; i + 4 <= last_col; i += 4) expand_pixels<4>(row + i, plane, e.channels, wt, bias, act, dst + i * W);
      for (; i < last_col; ++i) expand_pixels<1>(row + i, plane, e.channels, wt, bias, act, dst + i * W);
    }
  });
}

// B output columns from the buffer position `in` (row oy * sh, column ox0 *
// sw of the band of c = 0) into out (B vectors), with the bias and clamped to
// [lo, hi] (an activation that is one, or none: -inf and inf keep every
// value's bits); taps in the order c, ky, kx.
// KW > 0: a KW-wide kernel at column stride S and dilation 1, unrolled so
// that each input vector is loaded once for every output it feeds; KW == 0:
// any width, stride and dilation.
template <int KW, int S, int B>
inline void out_block(const Blocked& p, const float* in, const float* wt, V bias, float lo, float hi, float* out) {
  const ConvShape& s = p.s;
  V acc[B];
  for (int b = 0; b < B; ++b) acc[b] = vzero();
  for (int64_t cy = 0; cy < s.cg * s.kh; ++cy) {
    const int64_t c = cy / s.kh, ky = cy % s.kh;
    const float* row = in + c * p.chunk() + ky * s.dh * p.cols * W;
    if constexpr (KW > 0) {
      const float* wrow = wt + cy * KW * W;
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
        const V wv = vload(wt + (cy * s.kw + kx) * W);
        for (int b = 0; b < B; ++b) acc[b] = vfma(wv, vload(row + (b * s.sw + kx * s.dw) * W), acc[b]);
      }
    }
  }
  for (int b = 0; b < B; ++b) vstore(out + b * W, vclamp_hi(vclamp_lo(vadd(acc[b], bias), lo), hi));
}

// `rows` output rows of a band, row r's ox at out[r * ldo + ox * W].
template <int KW, int S, int B>
void compute_band(const Blocked& p, const float* buf, const float* wt, V bias, float lo, float hi, int64_t rows,
                  float* out, int64_t ldo) {
  const int64_t row_step = p.s.sh * p.cols * W;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t ox = 0; ox < p.owp; ox += B)
      out_block<KW, S, B>(p, buf + r * row_step + ox * p.s.sw * W, wt, bias, lo, hi, out + r * ldo + ox * W);
}

using BandFn = void (*)(const Blocked&, const float*, const float*, V, float, float, int64_t, float*, int64_t);

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
  p.og = s.og();
  p.blocks = ceil_div(s.o, W);
  p.b = register_block(s.ow);
  p.owp = ceil_div(s.ow, p.b) * p.b;
  p.cols = std::max((p.owp - 1) * s.sw + (s.kw - 1) * s.dw + 1, s.pl + s.w);
  // Bands: enough tasks to balance the workers, and a buffer that stays in
  // L2 (about 128 KB), but at least 4 rows a band where the plane allows
  // (each band re-reads its kernel's overlap rows).
  const int64_t row_bytes = s.cg * s.sh * p.cols * W * int64_t(sizeof(float));
  const int64_t by_size = std::max<int64_t>(1, (int64_t(128) << 10) / row_bytes);
  const int64_t by_tasks = ceil_div(s.oh * s.n * p.blocks, 4 * int64_t(threads));
  p.band = std::clamp<int64_t>(std::min(by_size, std::max<int64_t>(by_tasks, 4)), 1, s.oh);
  p.bands = ceil_div(s.oh, p.band);
  return p;
}

// Output rows [oy0, oy1) from `out` (as store_blocked's) with the residual
// (laid out as y, or null) and the activation into y, the channel block's
// (oh, ow) positions of W channels each.
void store_nchwc(const float* out, int64_t owp, int64_t ow, int64_t oy0, int64_t oy1, const Epilogue& ep,
                 const float* residual, float* y) {
  ep.visit([&](auto act) {
    for (int64_t oy = oy0; oy < oy1; ++oy)
      for (int64_t ox = 0; ox < ow; ++ox) {
        const int64_t at = (oy * ow + ox) * W;
        V v = vload(out + ((oy - oy0) * owp + ox) * W);
        if (residual) v = vadd(v, vload(residual + at));
        vstore(y + at, act(v));
      }
  });
}

// Lanes [0, lanes) of the W-vector rows t < count: rows[t * W + i] = m[(o0 + i) * count + t], the rest zero.
void block_rows(const float* m, int64_t o0, int64_t lanes, int64_t count, float* rows) {
  for (int64_t i = 0; i < W; ++i)
    for (int64_t t = 0; t < count; ++t) rows[t * W + i] = i < lanes ? m[(o0 + i) * count + t] : 0.0f;
}

V block_vector(const float* v, int64_t o0, int64_t lanes) {
  alignas(64) float lane[W] = {};
  for (int64_t i = 0; i < lanes; ++i) lane[i] = v[o0 + i];
  return vload(lane);
}

}  // namespace

void conv_channel_blocks(ffi::ThreadPool& pool, const ConvShape& s, const float* xs, const float* ws,
                         const float* bias, const Epilogue& ep, const float* residual, float* ys,
                         Layouts layouts, const Expansion* expansion) {
  const Blocked p = make_blocked(s, workers(pool));
  const BandFn compute = pick(p);
  const int64_t taps = s.kh * s.kw, k = s.cg * taps;
  // An NCHWc y whose rows are whole register blocks, under no residual and no
  // activation or a clamp, is written straight from the registers, not
  // through a band of `out` and a pass over it (MobileNetV2's 576-channel 3x3
  // at 14x14 17.3 against 21.5 us a call, 384-channel 12.8 against 15.6).
  float lo = -std::numeric_limits<float>::infinity(), hi = std::numeric_limits<float>::infinity();
  const bool direct = layouts.y && p.owp == s.ow && residual == nullptr && ep.as_clamp(&lo, &hi);
  // Per worker: the input band (zeroed when first taken: its padding columns
  // are never written), the output band, the block's weights, its expansion weights.
  Workspace scratch(pool, 4);
  std::vector<char> fresh(workers(pool), 1);
  parallel_for(pool, s.n * p.blocks * p.bands, [&](int64_t task, int worker) {
    const int64_t band = task % p.bands, block = task / p.bands % p.blocks, n = task / p.bands / p.blocks;
    float* in = scratch.get(worker, 0, p.in_floats(), fresh[worker]);
    float* out = direct ? nullptr : scratch.get(worker, 1, p.out_floats());
    float* wt = scratch.get(worker, 2, k * W);
    fresh[worker] = 0;
    const int64_t o0 = block * W, lanes = std::min<int64_t>(W, s.o - o0);
    block_rows(ws, o0, lanes, k, wt);
    const int64_t oy0 = band * p.band, oy1 = std::min(s.oh, oy0 + p.band);
    // An NCHWc image holds its channels rounded up to whole blocks.
    const int64_t x_channels = layouts.x ? p.blocks * W : s.c, y_channels = layouts.y ? p.blocks * W : s.o;
    if (expansion != nullptr) {
      float* we = scratch.get(worker, 3, expansion->channels * W);
      block_rows(expansion->w, o0, lanes, expansion->channels, we);
      expand_band(p, xs + n * expansion->channels * s.h * s.w, *expansion, we,
                  block_vector(expansion->b, o0, lanes), oy0, oy1, in);
    } else {
      for (int64_t c = 0; c < s.cg; ++c)
        load_band(p, xs + n * x_channels * s.h * s.w, o0, c, oy0, oy1, layouts.x, in + c * p.chunk());
    }
    const int64_t at = (n * y_channels + o0) * s.oh * s.ow;
    if (direct)
      return compute(p, in, wt, block_vector(bias, o0, lanes), lo, hi, oy1 - oy0, ys + at + oy0 * s.ow * W, s.ow * W);
    compute(p, in, wt, block_vector(bias, o0, lanes), lo, hi, oy1 - oy0, out, p.owp * W);
    if (layouts.y)
      store_nchwc(out, p.owp, s.ow, oy0, oy1, ep, residual ? residual + at : nullptr, ys + at);
    else
      store_blocked(out, p.owp, (int)lanes, s.oh, s.ow, oy0, oy1, ep, residual ? residual + at : nullptr, ys + at);
  });
}

}  // namespace jtile
