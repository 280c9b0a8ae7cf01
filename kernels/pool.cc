// Pooling over the last two axes of x (NCHW, or any leading axes): max,
// average (padding counted or not in the divisor) and global average. Each
// task is one (n, c) plane; an output row is built by sweeping the window
// taps over a row buffer, so the inner loop runs along contiguous output
// (3-wide max windows at column stride 2 work in registers instead).
// Attribute "pool" = [kh, kw, sh, sw, pad_top, pad_bottom, pad_left, pad_right].
//
// The average pool may apply a per-channel prologue to x as it reads it (the
// "shift", "scale" and "bias" buffers, each one value per channel of NCHW x,
// one for all or none: see ChannelValues; and the
// "prologue_activation" attribute): act((x - shift) * scale + bias), the
// folded batch norm and ReLU of a DenseNet transition whose average pool runs
// before its 1x1 conv (jtile._pool_before_conv), so that they cost no pass of
// their own. Padding is the pooled value's, 0, not transformed.
#include <limits>
#include <vector>

#include "common.h"

namespace jtile {
namespace {

struct PoolShape {
  int64_t planes, h, w, kh, kw, sh, sw, pt, pl, oh, ow;
  bool whole_plane;  // one window covering the plane exactly, no padding
};

ffi::Error decode_pool(const F32Buffer& x, ffi::Span<const int64_t> a, F32Result& y, PoolShape* p) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() < 2 || yd.size() != xd.size() || a.size() != 8)
    return ffi::Error::InvalidArgument("jtile pool: bad ranks or pool attribute");
  int64_t r = xd.size();
  *p = PoolShape{(int64_t)x.element_count() / (xd[r - 2] * xd[r - 1]), xd[r - 2], xd[r - 1],
                 a[0], a[1], a[2], a[3], a[4], a[6], yd[r - 2], yd[r - 1], false};
  p->whole_plane = p->oh == 1 && p->ow == 1 && p->kh == p->h && p->kw == p->w &&
                   a[4] == 0 && a[5] == 0 && a[6] == 0 && a[7] == 0;
  if (p->oh != window_out(p->h, p->kh, p->sh, a[4], a[5]) || p->ow != window_out(p->w, p->kw, p->sw, a[6], a[7]))
    return ffi::Error::InvalidArgument("jtile pool: output shape does not match the attributes");
  return ffi::Error::Success();
}

// The input rows of plane `in` that output row oy's window reads (those in
// the vertical padding left out) into src, in order; returns their count.
int window_rows(const PoolShape& p, const float* in, int64_t oy, const float** src) {
  int count = 0;
  for (int64_t ky = 0; ky < p.kh; ++ky) {
    const int64_t iy = oy * p.sh + ky - p.pt;
    if (iy >= 0 && iy < p.h) src[count++] = in + iy * p.w;
  }
  return count;
}

// fn(first, last) on the workers of parallel_for for runs of planes, about
// 8 a worker, so that small planes (7x7 at 832 channels) do not cost a task
// each.
template <typename F>
void plane_runs(ffi::ThreadPool& pool, int64_t planes, F&& fn) {
  const int64_t per_task = std::max<int64_t>(1, planes / (8 * int64_t(workers(pool))));
  parallel_for(pool, ceil_div(planes, per_task),
               [&](int64_t task) { fn(task * per_task, std::min(planes, (task + 1) * per_task)); });
}

// For each output row of each plane: acc[ox] = reduce over the window taps
// inside the input, starting from `init`; then finish(acc, plane, oy). The
// window's input rows are first combined into a row buffer (contiguous
// vectors), which holds `init` in the left and right padding and past the
// end; each output vector then reads it once per column tap, W outputs at a
// time at the window's stride (stride 2: two loads and a permute; strides 1
// and 2 compiled as constants), with no partial vectors or bounds checks. `combine` takes (float, float) and (V, V);
// `transform(plane)` gives the function each input vector of the plane
// passes through as it is read.
template <typename Combine, typename Transform, typename Finish>
void pool_rows(ffi::ThreadPool& pool, const PoolShape& p, const float* x, float init,
               Combine combine, Transform transform, Finish finish) {
  const int64_t vectors = ceil_div(p.ow, W);
  // The last output vector reads up to (vectors * W - 1) * sw + kw - 1 (one more at stride 2).
  const int64_t length = std::max(vectors * W * p.sw + p.kw, p.pl + p.w) + W;
  plane_runs(pool, p.planes, [&](int64_t first, int64_t last) {
    // Per plane, first the window rows of a group of output rows (each
    // combined into its own padded row), then their sweeps, so that a sweep's
    // unaligned loads come long after the stores they read, not right behind
    // them (row by row was slower). A group is as many rows as fill 64 KB
    // (every row of a plane up to 160x160 at stride 2). Alone, 3x3 stride-2
    // max pools, us: 128x55x55 35 against 39, 256x27x27 22 against 28,
    // 480x28x28 40 against 52 (the groups cost 0-2 us of that: 34, 21 and 37
    // with one buffer for the whole plane).
    const int64_t group = std::clamp<int64_t>((int64_t(16) << 10) / length, 1, std::max<int64_t>(p.oh, 1));
    std::vector<float> buffer(vectors * W), padded(group * length, init);
    std::vector<const float*> src(p.kh);  // the window's rows inside the input
    float* acc = buffer.data();
    for (int64_t plane = first; plane < last; ++plane) {
      const float* in = x + plane * p.h * p.w;
      const auto read = transform(plane);
      for (int64_t oy0 = 0; oy0 < p.oh; oy0 += group) {
        const int64_t oy1 = std::min(p.oh, oy0 + group);
        for (int64_t oy = oy0; oy < oy1; ++oy) {
          float* row = padded.data() + (oy - oy0) * length + p.pl;
          const int count = window_rows(p, in, oy, src.data());
          if (count == 0) {
            std::fill(row, row + p.w, init);  // every window row is padding
          } else {
            int64_t i = 0;
            for (; i + W <= p.w; i += W) {
              V v = read(vload(src[0] + i));
              for (int j = 1; j < count; ++j) v = combine(v, read(vload(src[j] + i)));
              vstore(row + i, v);
            }
            if (const int rest = int(p.w - i); rest > 0) {
              V v = read(vload_partial(src[0] + i, rest));
              for (int j = 1; j < count; ++j) v = combine(v, read(vload_partial(src[j] + i, rest)));
              vstore_partial(row + i, v, rest);
            }
          }
        }
        for (int64_t oy = oy0; oy < oy1; ++oy) {
          const float* start = padded.data() + (oy - oy0) * length;
          auto sweep = [&](auto stride) {
            for (int64_t ox = 0; ox < vectors * W; ox += W) {
              const float* at = start + ox * stride();
              V v = vload_strided(at, stride());
              for (int64_t kx = 1; kx < p.kw; ++kx) v = combine(v, vload_strided(at + kx, stride()));
              vstore(acc + ox, v);
            }
          };
          if (p.sw == 1) sweep([] { return int64_t(1); });
          else if (p.sw == 2) sweep([] { return int64_t(2); });
          else sweep([&] { return p.sw; });
          finish(acc, plane, oy);
        }
      }
    }
  });
}

// A stride-1 window padded to keep the plane's size (GoogLeNet's 3x3 max
// pools with padding 1), with the plane as one flat run of h * w values, so
// that a 14x14 plane costs 13 full vectors a pass instead of 14 partial rows
// (measured 5x faster on 512 planes of 14x14). The horizontal pass reads each
// column tap of x at a flat offset, only the lanes whose tap falls on the
// lane's row and inside the plane (`lanes`, the same for every plane), `init`
// in the others; the vertical pass reads the horizontal maxima `kh` rows
// apart, between rows of `init` for the padding. The two passes run a plane
// apart over two buffers (horizontal p, vertical p - 1), so that unaligned
// loads come a plane after the stores they read. `combine` as for pool_rows.
bool same_size_stride1(const PoolShape& p) {
  return p.sh == 1 && p.sw == 1 && p.oh == p.h && p.ow == p.w && !p.whole_plane;
}

template <typename Combine>
void pool_flat_planes(ffi::ThreadPool& pool, const PoolShape& p, const float* x, float* out, float init,
                      Combine combine) {
  const int64_t size = p.h * p.w, vectors = ceil_div(size, W);
  const int64_t above = p.pt * p.w, below = (p.kh - 1 - p.pt) * p.w, stride = above + vectors * W + below + W;
  std::vector<uint32_t> lanes(p.kw * vectors, 0);  // bit l: column tap kx of position v * W + l is on its row
  for (int64_t kx = 0; kx < p.kw; ++kx)
    for (int64_t i = 0; i < size; ++i) {
      const int64_t col = i % p.w + kx - p.pl;
      if (col >= 0 && col < p.w) lanes[kx * vectors + i / W] |= 1u << (i % W);
    }
  plane_runs(pool, p.planes, [&](int64_t first, int64_t last) {
    std::vector<float> rows(2 * stride, init);
    const V none = vset1(init);
    auto horizontal = [&](int64_t plane) {
      const float* in = x + plane * size - p.pl;
      float* h = rows.data() + (plane - first) % 2 * stride + above;
      for (int64_t v = 0; v < vectors; ++v) {
        V m = vload_lanes(in + v * W, lanes[v], none);
        for (int64_t kx = 1; kx < p.kw; ++kx) m = combine(m, vload_lanes(in + v * W + kx, lanes[kx * vectors + v], none));
        vstore(h + v * W, m);
      }
    };
    auto vertical = [&](int64_t plane) {
      const float* h = rows.data() + (plane - first) % 2 * stride;
      float* y = out + plane * size;
      for (int64_t i = 0; i < size; i += W) {
        V v = vload(h + i);
        for (int64_t ky = 1; ky < p.kh; ++ky) v = combine(v, vload(h + i + ky * p.w));
        if (i + W <= size) vstore(y + i, v);
        else vstore_partial(y + i, v, int(size - i));
      }
    };
    for (int64_t plane = first; plane <= last; ++plane) {
      if (plane < last) horizontal(plane);
      if (plane > first) vertical(plane - 1);
    }
  });
}

#if defined(__AVX512F__)
// A 2- or 3-wide window at column stride 2 without left padding (the
// ceil-mode stride-2 max pools of GoogLeNet and SqueezeNet), each output
// vector straight from registers: the window rows' maxima over input columns
// [2 ox, 2 ox + 32] (three vectors, the third the next output vector's
// first), then the taps at even columns, odd columns and (3 wide) even
// columns one further, by permutes. Columns past the row are -inf (the right
// padding). No row buffer, no unaligned reloads of fresh stores. Windows of
// 2 or 3 rows (all but a ceil-mode window's last) unroll: alone (warm, one
// thread, us) 64x55x55 12.8 against 19.2 with a loop over rows everywhere,
// 128x27x27 7.4 against 10.0, 32x112x112 29.5 against 41.6.
//
// Where no masked vector is needed for what a row's windows read (each
// window inside the row, as in SqueezeNet's, or rows of whole vectors), rows
// of three window rows read whole vectors past the row's end (what they read
// there reaches only outputs past the row's end) and store whole vectors
// (what they write past the row is a later row's of the same task, which
// overwrites it); the other rows load and store under masks. Masked loads
// and stores cost: on a Zen 5, one thread, 256x27x27 10.6 us against 19.2,
// 128x55x55 20.3 against 31.3 alone; in SqueezeNet on two threads 9.3
// against 16.4 and 17.8 against 24.5.
constexpr int64_t kMaxRegisterRows = 64;  // the most window rows it holds pointers to

bool columns_stride_2(const PoolShape& p) {
  return (p.kw == 2 || p.kw == 3) && p.sw == 2 && p.pl == 0 && p.kh <= kMaxRegisterRows && !p.whole_plane;
}

// The maxima of 16 windows kColumns wide at column stride 2 from the window
// rows' maxima over three consecutive vectors of columns.
template <int kColumns>
V stride_2_windows(V a, V b, V c) {
  const __m512i even = veven_lanes();
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  V m = vmax_nan({_mm512_permutex2var_ps(a.v, even, b.v)}, {_mm512_permutex2var_ps(a.v, odd, b.v)});
  if constexpr (kColumns == 3)
    m = vmax_nan(m, {_mm512_permutex2var_ps(
                        _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(b.v), _mm512_castps_si512(a.v), 2)),
                        even,
                        _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(c.v), _mm512_castps_si512(b.v), 2)))});
  return m;
}

// One output row at dst from three window rows at r0, r0 + w and r0 + 2 w,
// read as whole vectors; stored as whole vectors where they end at
// `store_end` or before.
template <int kColumns>
void three_rows_unmasked(const float* r0, int64_t w, int64_t ow, float* dst, const float* store_end) {
  const int64_t read = ceil_div(w, W);
  const auto column = [&](int64_t k) {
    if (k >= read) return vset1(-std::numeric_limits<float>::infinity());
    return vmax_nan(vmax_nan(vload(r0 + k * W), vload(r0 + w + k * W)), vload(r0 + 2 * w + k * W));
  };
  V a = column(0);
  for (int64_t ox = 0, k = 1; ox < ow; ox += W, k += 2) {
    const V c = column(k + 1), m = stride_2_windows<kColumns>(a, column(k), c);
    if (dst + ox + W <= store_end) vstore(dst + ox, m);
    else vstore_partial(dst + ox, m, int(ow - ox));
    a = c;
  }
}

void max_pool_columns_stride_2(ffi::ThreadPool& pool, const PoolShape& p, const float* x, float* out) {
  const V lowest = vset1(-std::numeric_limits<float>::infinity());
  const int64_t whole = p.w / W;  // a row's whole vectors
  const __mmask16 tail = vmask(int(p.w % W));
  const int64_t read = ceil_div(p.w, W);  // vectors a row's windows read
  const bool unmasked = 2 * (p.ow - 1) + p.kw <= p.w || p.w % W == 0;
  const float* x_end = x + p.planes * p.h * p.w;
  // The output row at dst from the window rows src, `rows()` of them (a
  // constant, or the count), under masks.
  auto output_row = [&](const float* const* src, float* dst, auto rows, auto columns) {
    // The window rows' maximum over the row's vector k, -inf past the row.
    auto column = [&](int64_t k) {
      if (rows() == 0 || k > whole || (k == whole && tail == 0)) return lowest;
      auto load = [&](int j) {
        return k < whole ? vload(src[j] + k * W) : V{_mm512_mask_loadu_ps(lowest.v, tail, src[j] + k * W)};
      };
      V v = load(0);
      for (int j = 1; j < rows(); ++j) v = vmax_nan(v, load(j));
      return v;
    };
    V a = column(0);
    for (int64_t ox = 0, k = 1; ox < p.ow; ox += W, k += 2) {
      const V c = column(k + 1), m = stride_2_windows<decltype(columns)::value>(a, column(k), c);
      if (ox + W <= p.ow) vstore(dst + ox, m);
      else vstore_partial(dst + ox, m, int(p.ow - ox));
      a = c;
    }
  };
  auto planes = [&](auto columns) {
    plane_runs(pool, p.planes, [&](int64_t first, int64_t last) {
      const float* src[kMaxRegisterRows];
      const float* task_end = out + last * p.oh * p.ow;
      for (int64_t plane = first; plane < last; ++plane) {
        const float* in = x + plane * p.h * p.w;
        float* dst = out + plane * p.oh * p.ow;
        // Three window rows inside the plane, whole vectors read inside x.
        const auto whole_vectors = [&](int64_t oy) {
          const int64_t top = oy * p.sh - p.pt;
          return unmasked && p.kh == 3 && top >= 0 && top + 3 <= p.h && in + (top + 2) * p.w + read * W <= x_end;
        };
        const auto masked_row = [&](int64_t oy) {
          const int count = window_rows(p, in, oy, src);
          if (count == 3) output_row(src, dst + oy * p.ow, [] { return 3; }, columns);
          else if (count == 2) output_row(src, dst + oy * p.ow, [] { return 2; }, columns);
          else output_row(src, dst + oy * p.ow, [count] { return count; }, columns);
        };
        // The unmasked rows in a loop of their own (one loop testing each
        // row took 1.3x the time).
        int64_t oy = 0;
        for (; oy < p.oh && !whole_vectors(oy); ++oy) masked_row(oy);
        for (; oy < p.oh && whole_vectors(oy); ++oy)
          three_rows_unmasked<decltype(columns)::value>(in + (oy * p.sh - p.pt) * p.w, p.w, p.ow, dst + oy * p.ow,
                                                        task_end);
        for (; oy < p.oh; ++oy) masked_row(oy);
      }
    });
  };
  if (p.kw == 2) planes(std::integral_constant<int, 2>{});
  else planes(std::integral_constant<int, 3>{});
}
#endif

// out[plane] = finish(reduction of the plane's `size` values by `combine`,
// lanes first, then across the lanes in order): global pooling, and a window
// that is the whole plane (a 7x7 average over a 7x7 map), where sweeping rows
// would spend a partial vector on every tap. Tasks take runs of planes.
template <typename Combine, typename Finish>
void reduce_planes(ffi::ThreadPool& pool, int64_t planes, int64_t size, const float* in, float* out,
                   float init, Combine combine, Finish finish) {
  parallel_for(pool, planes, [&](int64_t plane) {
    const float* p = in + plane * size;
    V acc = vset1(init);
    int64_t i = 0;
    for (; i + W <= size; i += W) acc = combine(acc, vload(p + i));
    float lanes[W];
    vstore(lanes, acc);
    float total = init;
    for (float v : lanes) total = combine(total, v);
    for (; i < size; ++i) total = combine(total, p[i]);
    out[plane] = finish(total);
  });
}

// The sum as `combine` for pool_rows and reduce_planes.
struct Sum {
  float operator()(float a, float v) const { return a + v; }
  V operator()(V a, V v) const { return vadd(a, v); }
};

// x as it is: the transform of every max pool and of an average pool without a prologue.
constexpr auto as_read = [](int64_t) { return [](V v) { return v; }; };

// Number of window taps of output index o that fall inside [0, size).
int64_t taps_inside(int64_t o, int64_t stride, int64_t k, int64_t pad, int64_t size) {
  int64_t start = o * stride - pad;
  return std::max<int64_t>(0, std::min(start + k, size) - std::max<int64_t>(start, 0));
}

ffi::Error MaxPool(ffi::ThreadPool pool, F32Buffer x, ffi::Span<const int64_t> attr, F32Result y) {
  PoolShape p;
  if (auto e = decode_pool(x, attr, y, &p); e.failure()) return e;
  float* out = y->typed_data();
  struct {
    float operator()(float a, float v) const { return (v > a || std::isnan(v)) && !std::isnan(a) ? v : a; }
    V operator()(V a, V v) const { return vmax_nan(a, v); }
  } combine;
  constexpr float lowest = -std::numeric_limits<float>::infinity();
  if (p.whole_plane) {
    reduce_planes(pool, p.planes, p.h * p.w, x.typed_data(), out, lowest, combine, [](float m) { return m; });
    return ffi::Error::Success();
  }
  if (same_size_stride1(p)) {
    pool_flat_planes(pool, p, x.typed_data(), out, lowest, combine);
    return ffi::Error::Success();
  }
#if defined(__AVX512F__)
  if (columns_stride_2(p)) {
    max_pool_columns_stride_2(pool, p, x.typed_data(), out);
    return ffi::Error::Success();
  }
#endif
  pool_rows(pool, p, x.typed_data(), lowest, combine, as_read,
            [&](const float* acc, int64_t plane, int64_t oy) {
              float* dst = out + (plane * p.oh + oy) * p.ow;
              int64_t i = 0;
              for (; i + W <= p.ow; i += W) vstore(dst + i, vload(acc + i));
              if (i < p.ow) vstore_partial(dst + i, vload(acc + i), int(p.ow - i));
            });
  return ffi::Error::Success();
}

ffi::Error AvgPool(ffi::ThreadPool pool, F32Buffer x, F32Buffer shift, F32Buffer scale, F32Buffer bias,
                   ffi::Span<const int64_t> attr, int64_t count_include_pad, int64_t prologue_activation,
                   F32Result y) {
  PoolShape p;
  if (auto e = decode_pool(x, attr, y, &p); e.failure()) return e;
  const ChannelValues shifts(shift, 0.0f), scales(scale, 1.0f), biases(bias, 0.0f);
  const bool has_prologue = shifts.given() || scales.given() || biases.given() || prologue_activation != 0;
  const auto xd = x.dimensions();
  if (has_prologue && (xd.size() != 4 || !ChannelValues::fits(shift, xd[1]) || !ChannelValues::fits(scale, xd[1]) ||
                       !ChannelValues::fits(bias, xd[1]) || p.whole_plane))
    return ffi::Error::InvalidArgument(
        "jtile avg_pool2d: a prologue needs NCHW x, C values, one or none each of shift, scale and bias, and "
        "a window smaller than the plane");
  Epilogue act;
  if (auto e = make_epilogue(prologue_activation, 0.0f, 0.0f, 6.0f, &act); e.failure()) return e;
  float* out = y->typed_data();
  const Sum combine;
  auto finish = [&](const float* acc, int64_t plane, int64_t oy) {
    float* dst = out + (plane * p.oh + oy) * p.ow;
    int64_t rows = taps_inside(oy, p.sh, p.kh, p.pt, p.h);
    for (int64_t ox = 0; ox < p.ow; ++ox) {
      int64_t count = count_include_pad ? p.kh * p.kw : rows * taps_inside(ox, p.sw, p.kw, p.pl, p.w);
      dst[ox] = acc[ox] / (float)count;
    }
  };
  if (has_prologue) {
    act.visit([&](auto f) {
      auto transform = [&](int64_t plane) {
        const int64_t c = plane % xd[1];
        const V m = vset1(shifts[c]), sc = vset1(scales[c]), b = vset1(biases[c]);
        return [=](V v) { return f(vadd(vmul(vsub(v, m), sc), b)); };
      };
      pool_rows(pool, p, x.typed_data(), 0.0f, combine, transform, finish);
    });
    return ffi::Error::Success();
  }
  if (p.whole_plane) {
    const float size = float(p.h * p.w);
    reduce_planes(pool, p.planes, p.h * p.w, x.typed_data(), out, 0.0f, combine, [size](float s) { return s / size; });
    return ffi::Error::Success();
  }
  pool_rows(pool, p, x.typed_data(), 0.0f, combine, as_read, finish);
  return ffi::Error::Success();
}

ffi::Error GlobalAvgPool(ffi::ThreadPool pool, F32Buffer x, F32Result y) {
  auto xd = x.dimensions();
  if (xd.size() < 2 || y->element_count() * xd[xd.size() - 2] * xd[xd.size() - 1] != x.element_count())
    return ffi::Error::InvalidArgument("jtile global_avg_pool2d: output must be (..., 1, 1)");
  const int64_t size = xd[xd.size() - 2] * xd[xd.size() - 1];
  const Sum add;
  reduce_planes(pool, (int64_t)y->element_count(), size, x.typed_data(), y->typed_data(), 0.0f, add,
                [size](float s) { return s / float(size); });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileMaxPool2d, jtile::MaxPool,
                     xla::ffi::Ffi::Bind()
                         .Ctx<xla::ffi::ThreadPool>()
                         .Arg<jtile::F32Buffer>()
                         .Attr<xla::ffi::Span<const int64_t>>("pool")
                         .Ret<jtile::F32Buffer>());
JTILE_DEFINE_HANDLER(JtileAvgPool2d, jtile::AvgPool,
                     xla::ffi::Ffi::Bind()
                         .Ctx<xla::ffi::ThreadPool>()
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Attr<xla::ffi::Span<const int64_t>>("pool")
                         .Attr<int64_t>("count_include_pad")
                         .Attr<int64_t>("prologue_activation")
                         .Ret<jtile::F32Buffer>());
JTILE_DEFINE_HANDLER(JtileGlobalAvgPool2d, jtile::GlobalAvgPool,
                     xla::ffi::Ffi::Bind()
                         .Ctx<xla::ffi::ThreadPool>()
                         .Arg<jtile::F32Buffer>()
                         .Ret<jtile::F32Buffer>());
