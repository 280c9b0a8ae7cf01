// Grouped convolution, channel-blocked ("grouped"): NCHW input, any groups,
// stride, dilation and padding, bias, residual and activation fused, for
// convs with many groups (RegNet, ResNeXt), where a GEMM per group is too
// small to fill its register tile, and (under `auto`, AVX-512) for convs of
// one group with a window, where it beats im2col + GEMM.
//
// With `span_groups` (jtile.kernels picks it for stride-1 convs whose groups
// have at most W / 4 output channels, ResNeXt's first stage), the weights are
// OIHW and the conv runs on vectors of W consecutive output channels spanning
// several groups (kernels/channel_blocks.cc). With `groups_per_vector` gp > 1
// (groups of W / gp output channels, RegNet's 8 with AVX-512), one vector
// holds gp groups, channel c of group i in lane c * gp + i: the weights are
// packed so, the task's input rows interleave the gp groups' channels, and
// each tap broadcasts gp input values at once (vbroadcast_lanes), so no lane
// idles where a group has fewer than W outputs. Otherwise the weights are packed
// ahead of time as [group][block of W output channels][c][ky][kx][W]
// (jtile.kernels.pack_gemm_weight with W rows), and a task takes two blocks
// of W output channels of one group (one, the last, where a group has an odd
// number) and a band of output rows. It copies the input rows the band needs,
// for the group's channels, into a per-worker buffer with their zero padding
// (or, for an input of at most kSharedInputBytes that several tasks of a
// group read, takes them from one padded copy made up front: 14x14 to 7x7
// layers with many channels had copied their input once per task, 8 times
// for 256 outputs), and accumulates B output columns at a time in registers,
// each tap one weight vector a block times B input values broadcast from the
// buffer. The band, held as W-channel vectors per position, is then
// transposed into the output planes with the residual and
// the activation (kernels/blocked.h).
//
// With a fused max pool (attribute "max_pool", the image stem's: a conv, its
// activation, then a strided max pool), a task takes a band of pooled rows: it
// computes the conv rows their windows read (a band's first row may be its
// neighbour's last, computed twice), applies the activation and pools them in
// its buffer, W channels a vector, so the conv's output never reaches memory.
//
// Every output sums its taps in one order (c, ky, kx) whatever the band or
// thread split, padding included, so NaN and Inf propagate as in XLA and the
// result does not depend on the thread count.
#include <limits>
#include <utility>

#include "blocked.h"

namespace jtile {
namespace {

// Inputs up to this size are padded once per call and read by every task;
// larger ones are copied a band of rows per task, rows that stay in L2. (At
// 1 MB, ResNet-50's 3x3 stride-2 conv on 128x56x56, 1.7 MB padded, copied
// each band's rows for each of its 4 tasks and took 1.12x the time.)
constexpr int64_t kSharedInputBytes = int64_t(2) << 20;

struct Grouped {
  ConvShape s;
  int gp;           // groups a vector holds (W / their output channels), or 1: one group's channels
  int64_t packs;    // vectors' worth of groups: groups / gp, rounded up
  alignas(64) int32_t lanes_in_order[W];  // gp > 1: the vector lane holding output channel l of a pack
  int64_t blocks;   // blocks of W output channels per pack
  int nv;           // blocks per task: 2 where a group has two or more (its last task may take 1)
  int64_t units;    // tasks' worth of blocks per group
  int b;            // output columns per register block
  int64_t owp;      // output row length rounded up to b
  int64_t whole;    // output columns computed b at a time
  int tail;         // the rest of the row, 4 or more columns, computed as one block (or 0)
  int64_t cols;     // padded input columns per buffer row
  int64_t band;     // conv output rows a task computes at most
  FusedPool pool;
  int64_t ph, pw;   // the rows and columns the call stores (pooled or not)
  int64_t rows;     // of them per task
  int64_t bands;
  bool shared;      // x padded once for every task (small inputs), not a band's rows per task

  // The conv rows stored rows [y0, y1) need.
  std::pair<int64_t, int64_t> conv_rows(int64_t y0, int64_t y1) const {
    if (!pool.active()) return {y0, y1};
    return {std::clamp<int64_t>(y0 * pool.sh - pool.pt, 0, s.oh),
            std::clamp<int64_t>((y1 - 1) * pool.sh - pool.pt + pool.kh, 0, s.oh)};
  }

  int64_t in_rows(int64_t out_rows) const { return (out_rows - 1) * s.sh + (s.kh - 1) * s.dh + 1; }
};

// Bands of even height over `rows` rows, at most `most` a band, with
// `per_band` tasks a band on `threads` workers: the count whose busiest
// worker has the fewest rows to compute, each band's `overlap` rows with its
// neighbour included, the fewest bands on ties.
int64_t balanced_bands(int64_t rows, int64_t most, int64_t overlap, int64_t per_band, int threads) {
  if (rows <= 0) return 0;
  const auto load = [&](int64_t bands) {
    return ceil_div(per_band * bands, threads) * (ceil_div(rows, bands) + overlap);
  };
  int64_t bands = ceil_div(rows, std::max<int64_t>(most, 1));
  for (int64_t b = bands + 1; b <= rows; ++b)
    if (load(b) < load(bands)) bands = b;
  return ceil_div(rows, ceil_div(rows, bands));  // no more than the bands' height needs
}

Grouped make_grouped(const ConvShape& s, const FusedPool& pool, int gp, int threads) {
  Grouped p;
  p.s = s;
  p.gp = gp;
  p.packs = ceil_div(s.groups, gp);
  for (int l = 0; l < W; ++l) p.lanes_in_order[l] = gp > 1 ? (int32_t)(l % s.og() * gp + l / s.og()) : l;
  p.pool = pool;
  p.ph = pool.out_h(s.oh);
  p.pw = pool.out_w(s.ow);
  p.blocks = ceil_div(s.og() * gp, W);
  p.nv = p.blocks >= 2 ? 2 : 1;
  p.units = ceil_div(p.blocks, p.nv);
  p.b = register_block(s.ow);
  p.owp = ceil_div(s.ow, p.b) * p.b;
  // SqueezeNet's 13-wide rows as 7 + 6 columns, not 7 + 7
  p.tail = (int)(s.ow % p.b);
  if (p.tail < 4) p.tail = 0;
  p.whole = p.tail ? s.ow - p.tail : p.owp;
  p.cols = std::max((p.owp - 1) * s.sw + (s.kw - 1) * s.dw + 1, s.pl + s.w);
  // Bands: input rows that stay in L2 (about 128 KB), balanced over the
  // workers (DenseNet's 3x3 convs to 32 channels, one task a band, had taken
  // 7 bands of 4 rows at 28x28, 4 at 14x14, for 4 tasks a worker: 1.15x and
  // 1.1x the time of 2).
  const int64_t by_size = std::max<int64_t>(1, (int64_t(32) << 10) / (s.cg * gp * p.cols * s.sh));
  int64_t most = std::clamp<int64_t>(by_size, 1, s.oh);  // rows a band may take
  if (pool.active())  // as many pooled rows as fit in about that many conv rows
    most = std::clamp<int64_t>((most - pool.kh) / pool.sh + 1, 1, std::max<int64_t>(p.ph, 1));
  p.bands = balanced_bands(p.ph, most, ceil_div((s.kh - 1) * s.dh, s.sh), s.n * p.packs * p.units, threads);
  p.rows = p.bands > 0 ? ceil_div(p.ph, p.bands) : 1;
  p.band = pool.active() ? (p.rows - 1) * pool.sh + pool.kh : p.rows;
  p.shared = gp == 1 && p.units > 1 && s.n * s.c * p.in_rows(s.oh) * p.cols * int64_t(sizeof(float)) <= kSharedInputBytes;
  return p;
}

// The input rows output rows [oy0, oy1) read, of channels [c0, c1) of the
// group whose first channel is at x: buf[(c * rows + r) * cols + j] = padded
// channel c, row oy0 * sh - pt + r, column j (zero in the padding).
void load_rows(const Grouped& p, const float* x, int64_t oy0, int64_t oy1, int64_t c0, int64_t c1, float* buf) {
  const ConvShape& s = p.s;
  const int64_t rows = p.in_rows(oy1 - oy0), first = oy0 * s.sh - s.pt;
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = buf + (c * rows + r) * p.cols;
      const int64_t y = first + r;
      if (y < 0 || y >= s.h) {
        std::memset(dst, 0, p.cols * sizeof(float));
        continue;
      }
      std::memset(dst, 0, s.pl * sizeof(float));
      std::memcpy(dst + s.pl, x + (c * s.h + y) * s.w, s.w * sizeof(float));
      std::memset(dst + s.pl + s.w, 0, (p.cols - s.pl - s.w) * sizeof(float));
    }
}

// load_rows for a vector of GP groups, `present` of them (x at the first
// one's first channel), interleaved as the broadcasts read them:
// buf[((c * rows + r) * cols + j) * GP + i] = padded channel c of group i
// (zero for absent groups).
template <int GP>
void load_packed_rows(const Grouped& p, const float* x, int64_t oy0, int64_t oy1, int64_t present, float* buf) {
  const ConvShape& s = p.s;
  const int64_t rows = p.in_rows(oy1 - oy0), first = oy0 * s.sh - s.pt;
  std::memset(buf, 0, s.cg * rows * p.cols * GP * sizeof(float));
  for (int64_t c = 0; c < s.cg; ++c)
    for (int64_t r = std::max<int64_t>(0, -first); r < std::min(rows, s.h - first); ++r) {
      float* dst = buf + ((c * rows + r) * p.cols + s.pl) * GP;
      const float* src = x + (c * s.h + first + r) * s.w;
      const int64_t group = s.cg * s.h * s.w;
      if (present == GP) {  // the compiler interleaves whole vectors
        for (int64_t j = 0; j < s.w; ++j)
          for (int i = 0; i < GP; ++i) dst[j * GP + i] = src[i * group + j];
        continue;
      }
      for (int64_t i = 0; i < present; ++i)
        for (int64_t j = 0; j < s.w; ++j) dst[j * GP + i] = src[i * group + j];
    }
}

using LoadFn = void (*)(const Grouped&, const float*, int64_t, int64_t, int64_t, float*);

// Output rows [0, rows), columns [ox0, ox1) (B at a time), of the band from
// the buffer (`in_rows` rows a channel) into out, NV blocks of W channels
// (block v's weights at wt + v * K * W, its outputs at out + v * band * owp *
// W, as (r * owp + ox) * W), with the bias; each broadcast input value feeds NV FMAs. With GP > 1 groups
// a vector (NV = 1), each broadcast carries GP groups' input values, and the
// lanes are put in channel order before the bias. KS > 0: a KS x KS window
// without dilation, its taps unrolled (a loop of 3 taps a row had cost a
// sixth of the time in loop control); KS = 0: any window.
template <int B, int NV, int GP, int KS>
void compute_rows(const Grouped& p, const float* buf, int64_t in_rows, const float* wt, const V* bias,
                  int64_t rows, int64_t ox0, int64_t ox1, float* out) {
  const ConvShape& s = p.s;
  const int64_t kh = KS ? KS : s.kh, kw = KS ? KS : s.kw, dh = KS ? 1 : s.dh, dw = KS ? 1 : s.dw;
  const int64_t channel = in_rows * p.cols, k = s.cg * kh * kw, half = p.band * p.owp * W;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t ox = ox0; ox < ox1; ox += B) {
      V acc[NV][B];
      for (int v = 0; v < NV; ++v)
        for (int b = 0; b < B; ++b) acc[v][b] = vzero();
      const float* base = buf + (r * s.sh * p.cols + ox * s.sw) * GP;
      const float* w = wt;
      for (int64_t c = 0; c < s.cg; ++c)
#pragma GCC unroll 3
        for (int64_t ky = 0; ky < kh; ++ky) {
          const float* row = base + (c * channel + ky * dh * p.cols) * GP;
#pragma GCC unroll 3
          for (int64_t kx = 0; kx < kw; ++kx, w += W) {
            V wv[NV];
            for (int v = 0; v < NV; ++v) wv[v] = vload(w + v * k * W);
            const float* xk = row + kx * dw * GP;
#pragma GCC unroll 8
            for (int b = 0; b < B; ++b) {
              const V xb = vbroadcast_lanes<GP>(xk + b * s.sw * GP);
              for (int v = 0; v < NV; ++v) acc[v][b] = vfma(wv[v], xb, acc[v][b]);
            }
          }
        }
      for (int v = 0; v < NV; ++v)
        for (int b = 0; b < B; ++b) {
          const V sum = GP > 1 ? vpermute(acc[v][b], p.lanes_in_order) : acc[v][b];
          vstore(out + v * half + (r * p.owp + ox + b) * W, vadd(sum, bias[v]));
        }
    }
}

using RowsFn = void (*)(const Grouped&, const float*, int64_t, const float*, const V*, int64_t, int64_t, int64_t,
                        float*);

// Pooled rows [y0, y1) (at pooled ((r * pw + ox) * W)) of conv rows [cy0,
// cy1) of one block in `out` ((r * owp + ox) * W, bias included): each tap
// goes through `tap`, each window's maximum through `finish`; taps outside
// the conv's output are skipped (padding as -inf), a window of none is -inf,
// NaN propagates. Stride-2 windows 3 wide over 3 whole rows (the stems')
// share columns: window x reads columns 2x - pl + {0, 1, 2}, and its last is
// the next window's first, so each column's maximum over the rows is taken
// once.
template <typename Tap, typename Finish>
void pool_rows(const Grouped& p, Tap tap, Finish finish, int64_t cy0, int64_t cy1, int64_t y0, int64_t y1,
               const float* out, float* pooled) {
  const FusedPool& q = p.pool;
  const int64_t row = p.owp * W;
  const V none = vset1(-std::numeric_limits<float>::infinity());
  for (int64_t y = y0; y < y1; ++y) {
    const int64_t top = std::max(y * q.sh - q.pt, cy0), bottom = std::min(y * q.sh - q.pt + q.kh, cy1);
    const float* first_row = out + (top - cy0) * row;
    float* dst = pooled + (y - y0) * p.pw * W;
    const auto any_window = [&](int64_t x) {
      const int64_t left = std::max<int64_t>(x * q.sw - q.pl, 0), right = std::min(x * q.sw - q.pl + q.kw, p.s.ow);
      if (top >= bottom || left >= right) {
        vstore(dst + x * W, none);
        return;
      }
      V m = none;
      for (const float* r = first_row; r < first_row + (bottom - top) * row; r += row)
        for (int64_t i = left; i < right; ++i) m = vmax_nan(m, tap(vload(r + i * W)));
      vstore(dst + x * W, finish(m));
    };
    // windows 3 wide at stride 2 wholly inside the row: x in [inner0, inner1)
    const bool shared = bottom - top == 3 && q.kw == 3 && q.sw == 2;
    const int64_t inner0 = shared ? std::min(ceil_div(q.pl, 2), p.pw) : p.pw;
    const int64_t fit = p.s.ow + q.pl - 3;  // 2x at most this
    const int64_t inner1 = shared && fit >= 0 ? std::clamp<int64_t>(fit / 2 + 1, inner0, p.pw) : inner0;
    for (int64_t x = 0; x < inner0; ++x) any_window(x);
    if (inner0 < inner1) {
      const auto column = [&](int64_t c) {
        const float* r = first_row + c * W;
        return vmax_nan(vmax_nan(tap(vload(r)), tap(vload(r + row))), tap(vload(r + 2 * row)));
      };
      V last = column(2 * inner0 - q.pl);
      for (int64_t x = inner0; x < inner1; ++x) {
        const int64_t c = 2 * x - q.pl;
        const V middle = column(c + 1), next = column(c + 2);
        vstore(dst + x * W, finish(vmax_nan(vmax_nan(last, middle), next)));
        last = next;
      }
    }
    for (int64_t x = inner1; x < p.pw; ++x) any_window(x);
  }
}

// pool_rows with the activation: a clamp (identity, ReLU, clip) is monotone,
// so it is applied once to each window's maximum (NaN stays NaN either way;
// a zero's sign may differ); any other activation to every tap. (A separate activation pass and a chain
// of nine maxima a window had cost a third of SqueezeNet's stem.)
void pool_band(const Grouped& p, const Epilogue& ep, int64_t cy0, int64_t cy1, int64_t y0, int64_t y1,
               const float* out, float* pooled) {
  const auto same = [](V v) { return v; };
  float lo, hi;
  if (ep.as_clamp(&lo, &hi))
    ep.visit([&](auto act) { pool_rows(p, same, act, cy0, cy1, y0, y1, out, pooled); });
  else
    ep.visit([&](auto act) { pool_rows(p, act, same, cy0, cy1, y0, y1, out, pooled); });
}

template <int NV, int GP, int KS>
RowsFn pick_b(int b) {
  switch (b) {
    case 4: return compute_rows<4, NV, GP, KS>;
    case 5: return compute_rows<5, NV, GP, KS>;
    case 6: return compute_rows<6, NV, GP, KS>;
    case 7: return compute_rows<7, NV, GP, KS>;
    default: return compute_rows<8, NV, GP, KS>;
  }
}

// The row function for NV blocks of GP groups, its taps unrolled for an
// undilated 3x3 window.
template <int NV, int GP = 1>
RowsFn pick_rows(const ConvShape& s, int b) {
  const bool three = s.kh == 3 && s.kw == 3 && s.dh == 1 && s.dw == 1;
  return three ? pick_b<NV, GP, 3>(b) : pick_b<NV, GP, 0>(b);
}

// The loader and row function for vectors of gp groups.
std::pair<LoadFn, RowsFn> pick_packed(const ConvShape& s, int gp, int b) {
  switch (gp) {
    case 2: return {load_packed_rows<2>, pick_rows<1, 2>(s, b)};
    case 4: return {load_packed_rows<4>, pick_rows<1, 4>(s, b)};
    default: return {load_packed_rows<8>, pick_rows<1, 8>(s, b)};
  }
}

ffi::Error ConvGrouped(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b, F32Buffer res, F32Buffer,
                       ffi::Span<const int64_t> attr, int64_t act, float alpha, float lo, float hi,
                       int64_t channel0, ffi::Span<const int64_t> kernel, int64_t span_groups,
                       int64_t groups_per_vector, ffi::Span<const int64_t> max_pool, F32Result y) {
  auto wd = w.dimensions();
  ConvShape s;
  Epilogue ep;
  FusedPool fused;
  if (auto e = decode_fused_pool(max_pool, &fused); e.failure()) return e;
  if (auto e = decode_packed_conv("grouped", x, kernel, b, attr, y, act, alpha, lo, hi, &s, &ep, channel0, fused);
      e.failure())
    return e;
  const int64_t taps = s.cg * s.kh * s.kw;
  const bool narrow = span_groups != 0;  // lanes span groups: OIHW weights, kernels/channel_blocks.cc
  const int gp = (int)groups_per_vector;
  if (gp != 1 && (narrow || (gp != 2 && gp != 4 && gp != 8) || s.og() * gp != W))
    return ffi::Error::InvalidArgument(
        "jtile grouped: groups_per_vector must be 1, or 2, 4 or 8 groups whose output channels fill a vector "
        "of W (without span_groups)");
  if (fused.active() && (narrow || gp != 1 || res.element_count() > 0))
    return ffi::Error::InvalidArgument(
        "jtile grouped: a fused max pool takes weights packed per group and no residual");
  const Grouped p = make_grouped(s, fused, gp, workers(pool));
  const bool packed_ok = narrow ? wd.size() == 4 && wd[0] == s.o && wd[1] == s.cg && wd[2] == s.kh && wd[3] == s.kw
                                : wd.size() == 4 && wd[0] == p.packs && wd[1] == p.blocks && wd[2] == taps && wd[3] == W;
  if (!packed_ok)
    return ffi::Error::InvalidArgument(
        "jtile grouped: w must be OIHW when vectors span groups, else packed as (groups / groups_per_vector, "
        "blocks, K, W), W the vector width");
  const bool has_residual = res.element_count() > 0;
  if (has_residual && (int64_t)res.element_count() != conv_output_size(s))
    return ffi::Error::InvalidArgument("jtile grouped: the residual must be empty or have the output's shape");
  if (s.n * s.o * s.oh * s.ow == 0) return ffi::Error::Success();
  const Bias bias_of(b, s.o);
  if (narrow) {
    conv_channel_blocks(pool, s, x.typed_data(), w.typed_data(), bias_of.data(), ep,
                        has_residual ? res.typed_data() : nullptr, conv_output(s, y, channel0));
    return ffi::Error::Success();
  }
  const LoadFn load_packed = pick_packed(s, gp, p.b).first;
  const auto one_block = [&](int b) { return gp > 1 ? pick_packed(s, gp, b).second : pick_rows<1>(s, b); };
  // [blocks per task - 1][whole register blocks, the row's tail]
  const RowsFn compute[2][2] = {{one_block(p.b), one_block(p.tail)}, {pick_rows<2>(s, p.b), pick_rows<2>(s, p.tail)}};
  const float *xs = x.typed_data(), *ws = w.typed_data(), *bias = bias_of.data();
  const float* rs = has_residual ? res.typed_data() : nullptr;
  float* ys = conv_output(s, y, channel0);
  const int64_t plane = p.ph * p.pw, units = p.units, half = p.band * p.owp * W;
  Workspace scratch(pool, 3);  // per worker: the input rows, the output band, the pooled band
  const int64_t padded_rows = p.in_rows(s.oh);
  const Scratch padded = p.shared ? Scratch(s.n * s.c * padded_rows * p.cols, false) : Scratch();
  if (p.shared)
    parallel_for(pool, s.n * s.c, [&](int64_t nc) {
      const int64_t g = nc % s.c / s.cg, first = (nc - nc % s.c) + g * s.cg;
      load_rows(p, xs + first * s.h * s.w, 0, s.oh, nc - first, nc - first + 1,
                &padded[first * padded_rows * p.cols]);
    });
  parallel_for(pool, s.n * p.packs * units * p.bands, [&](int64_t task, int worker) {
    const int64_t band = task % p.bands, unit = task / p.bands % units;
    const int64_t g = task / p.bands / units % p.packs, n = task / p.bands / units / p.packs;
    const int64_t channels = std::min<int64_t>(gp, s.groups - g * gp) * s.og();  // the pack's outputs
    const int64_t y0 = band * p.rows, y1 = std::min(p.ph, y0 + p.rows);
    const auto [oy0, oy1] = p.conv_rows(y0, y1);
    const int64_t in_rows = p.in_rows(oy1 - oy0);
    float* out = scratch.get(worker, 1, p.nv * half);
    const int nv = (int)std::min<int64_t>(p.nv, p.blocks - unit * p.nv);
    V bv[2];
    for (int v = 0; v < nv; ++v) {
      const int64_t block = unit * p.nv + v, lanes = std::min<int64_t>(W, channels - block * W);
      alignas(64) float lane_bias[W] = {};
      for (int64_t i = 0; i < lanes; ++i) lane_bias[i] = bias[g * gp * s.og() + block * W + i];
      bv[v] = vload(lane_bias);
    }
    const int64_t first = n * s.c + g * gp * s.cg;
    const float* in = p.shared ? &padded[(first * padded_rows + oy0 * s.sh) * p.cols] : nullptr;
    if (gp > 1) {
      float* rows = scratch.get(worker, 0, s.cg * gp * p.in_rows(p.band) * p.cols);
      load_packed(p, xs + first * s.h * s.w, oy0, oy1, channels / s.og(), rows);
      in = rows;
    } else if (!p.shared) {
      float* rows = scratch.get(worker, 0, s.cg * p.in_rows(p.band) * p.cols);
      load_rows(p, xs + first * s.h * s.w, oy0, oy1, 0, s.cg, rows);
      in = rows;
    }
    const float* wt = ws + (g * p.blocks + unit * p.nv) * taps * W;
    const int64_t rows_in = p.shared ? padded_rows : in_rows;
    compute[nv - 1][0](p, in, rows_in, wt, bv, oy1 - oy0, 0, p.whole, out);
    if (p.tail) compute[nv - 1][1](p, in, rows_in, wt, bv, oy1 - oy0, p.whole, s.ow, out);
    for (int v = 0; v < nv; ++v) {
      const int64_t block = unit * p.nv + v, o0 = g * gp * s.og() + block * W, at = (n * s.o + o0) * plane;
      const int lanes = (int)std::min<int64_t>(W, channels - block * W);
      if (!p.pool.active()) {
        store_blocked(out + v * half, p.owp, lanes, s.oh, s.ow, oy0, oy1, ep, rs ? rs + at : nullptr, ys + at);
        continue;
      }
      float* pooled = scratch.get(worker, 2, p.rows * p.pw * W);
      pool_band(p, ep, oy0, oy1, y0, y1, out + v * half, pooled);
      store_blocked(pooled, p.pw, lanes, p.ph, p.pw, y0, y1, Epilogue{}, nullptr, ys + at);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileConvGrouped, jtile::ConvGrouped,
                     JTILE_CONV_RESIDUAL_BINDING.Attr<xla::ffi::Span<const int64_t>>("kernel")
                         .Attr<int64_t>("span_groups")
                         .Attr<int64_t>("groups_per_vector")
                         .Attr<xla::ffi::Span<const int64_t>>("max_pool")
                         .Ret<jtile::F32Buffer>());

// The vector width W the packed weights of the channel-blocked kernels use.
extern "C" int64_t JtileVectorLanes() { return jtile::W; }
