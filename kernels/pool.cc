// Pooling over the last two axes of x (NCHW, or any leading axes): max,
// average (padding counted or not in the divisor) and global average. Each
// task is one (n, c) plane; an output row is built by sweeping the window
// taps over a row buffer, so the inner loop runs along contiguous output.
// Attribute "pool" = [kh, kw, sh, sw, pad_top, pad_bottom, pad_left, pad_right].
#include <limits>
#include <vector>

#include "common.h"

namespace jtile {
namespace {

struct PoolShape {
  int64_t planes, h, w, kh, kw, sh, sw, pt, pl, oh, ow;
};

ffi::Error decode_pool(const F32Buffer& x, ffi::Span<const int64_t> a, F32Result& y, PoolShape* p) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() < 2 || yd.size() != xd.size() || a.size() != 8)
    return ffi::Error::InvalidArgument("jtile pool: bad ranks or pool attribute");
  int64_t r = xd.size();
  *p = PoolShape{(int64_t)x.element_count() / (xd[r - 2] * xd[r - 1]), xd[r - 2], xd[r - 1],
                 a[0], a[1], a[2], a[3], a[4], a[6], yd[r - 2], yd[r - 1]};
  if (p->oh != window_out(p->h, p->kh, p->sh, a[4], a[5]) || p->ow != window_out(p->w, p->kw, p->sw, a[6], a[7]))
    return ffi::Error::InvalidArgument("jtile pool: output shape does not match the attributes");
  return ffi::Error::Success();
}

// For each output row of each plane: acc[ox] = reduce over the window taps
// inside the input, starting from `init`; then finish(acc, oy, plane_out).
// `combine` takes (float, float) and (V, V); the sweep along a row is
// vectorised, W output columns at a time, the last few through a small
// buffer. Tasks take runs of planes, so that small planes (7x7 at 832
// channels) do not cost a task each.
template <typename Combine, typename Finish>
void pool_rows(ffi::ThreadPool& pool, const PoolShape& p, const float* x, float init,
               Combine combine, Finish finish) {
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_task = std::max<int64_t>(1, p.planes / (8 * workers));
  parallel_for(pool, ceil_div(p.planes, per_task), [&](int64_t task) {
    std::vector<float> buffer(ceil_div(p.ow, W) * W);
    float* acc = buffer.data();
    for (int64_t plane = task * per_task; plane < std::min(p.planes, (task + 1) * per_task); ++plane) {
      const float* in = x + plane * p.h * p.w;
      for (int64_t oy = 0; oy < p.oh; ++oy) {
        std::fill(acc, acc + p.ow, init);
        for (int64_t ky = 0; ky < p.kh; ++ky) {
          int64_t iy = oy * p.sh + ky - p.pt;
          if (iy < 0 || iy >= p.h) continue;
          const float* row = in + iy * p.w;
          for (int64_t kx = 0; kx < p.kw; ++kx) {
            // ox such that 0 <= ox*sw + kx - pl < w
            int64_t off = kx - p.pl;
            int64_t lo = off >= 0 ? 0 : ceil_div(-off, p.sw);
            int64_t hi = std::min(p.ow, p.w - off > 0 ? ceil_div(p.w - off, p.sw) : 0);
            const float* base = row + off;
            int64_t ox = lo;
            // A vector reads inputs up to (W - 1) * sw past its first: keep them in the row.
            for (; ox + W <= hi && (ox + W - 1) * p.sw + off < p.w; ox += W)
              vstore(acc + ox, combine(vload(acc + ox), vload_strided(base + ox * p.sw, p.sw)));
            if (ox < hi) {
              const int n = int(hi - ox);
              alignas(64) float gathered[W];
              if (p.sw > 1)
                for (int e = 0; e < n; ++e) gathered[e] = base[(ox + e) * p.sw];
              const float* src = p.sw > 1 ? gathered : base + ox;
              const V v = combine(vload_partial(acc + ox, n), vload_partial(src, n));
              vstore_partial(acc + ox, v, n);
            }
          }
        }
        finish(acc, plane, oy);
      }
    }
  });
}

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
  pool_rows(pool, p, x.typed_data(), -std::numeric_limits<float>::infinity(), combine,
            [&](const float* acc, int64_t plane, int64_t oy) {
              std::memcpy(out + (plane * p.oh + oy) * p.ow, acc, p.ow * sizeof(float));
            });
  return ffi::Error::Success();
}

ffi::Error AvgPool(ffi::ThreadPool pool, F32Buffer x, ffi::Span<const int64_t> attr,
                   int64_t count_include_pad, F32Result y) {
  PoolShape p;
  if (auto e = decode_pool(x, attr, y, &p); e.failure()) return e;
  float* out = y->typed_data();
  struct {
    float operator()(float a, float v) const { return a + v; }
    V operator()(V a, V v) const { return vadd(a, v); }
  } combine;
  pool_rows(pool, p, x.typed_data(), 0.0f, combine, [&](const float* acc, int64_t plane, int64_t oy) {
    float* dst = out + (plane * p.oh + oy) * p.ow;
    int64_t rows = taps_inside(oy, p.sh, p.kh, p.pt, p.h);
    for (int64_t ox = 0; ox < p.ow; ++ox) {
      int64_t count = count_include_pad ? p.kh * p.kw : rows * taps_inside(ox, p.sw, p.kw, p.pl, p.w);
      dst[ox] = acc[ox] / (float)count;
    }
  });
  return ffi::Error::Success();
}

ffi::Error GlobalAvgPool(ffi::ThreadPool pool, F32Buffer x, F32Result y) {
  auto xd = x.dimensions();
  if (xd.size() < 2 || y->element_count() * xd[xd.size() - 2] * xd[xd.size() - 1] != x.element_count())
    return ffi::Error::InvalidArgument("jtile global_avg_pool2d: output must be (..., 1, 1)");
  const int64_t size = xd[xd.size() - 2] * xd[xd.size() - 1];
  const float* in = x.typed_data();
  float* out = y->typed_data();
  parallel_for(pool, (int64_t)y->element_count(), [&](int64_t plane) {
    const float* p = in + plane * size;
    V acc = vzero();
    int64_t i = 0;
    for (; i + W <= size; i += W) acc = vadd(acc, vload(p + i));
    if (i < size) acc = vadd(acc, vload_partial(p + i, int(size - i)));
    float lanes[W];
    vstore(lanes, acc);
    float total = 0.0f;
    for (float v : lanes) total += v;
    out[plane] = total / (float)size;
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtileMaxPool2d, jtile::MaxPool,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<jtile::F32Buffer>()
                                  .Attr<xla::ffi::Span<const int64_t>>("pool")
                                  .Ret<jtile::F32Buffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JtileAvgPool2d, jtile::AvgPool,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<jtile::F32Buffer>()
                                  .Attr<xla::ffi::Span<const int64_t>>("pool")
                                  .Attr<int64_t>("count_include_pad")
                                  .Ret<jtile::F32Buffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JtileGlobalAvgPool2d, jtile::GlobalAvgPool,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<jtile::F32Buffer>()
                                  .Ret<jtile::F32Buffer>());
