// Row-wise normalisations over the last axis of a row-major x: softmax
// (attention's probabilities) and layer norm (a transformer block's two).
// XLA runs each as several loops over the whole tensor (a reduction, a
// broadcast subtraction, a second reduction, a scaling: ViT-B/16's softmax
// over 12 x 197 x 197 took about 480 us there); here a task takes whole rows,
// and a row of up to a few thousand floats stays in L1 across its passes.
//
// softmax: exp(x - max) / sum, the max and the sum per row, NaN propagating
// (a NaN, or +inf beside +inf, makes the row NaN as in jnp). layer_norm:
// (x - mean) / sqrt(var + epsilon) * scale + bias, the biased variance of
// the centred row (two passes, never E[x^2] - E[x]^2).
#include <cmath>
#include <limits>

#include "common.h"

namespace jtile {
namespace {

// The partial vector at the end of a row of n: `lanes` (0 if none) floats at `tail`.
struct Tail {
  int64_t tail;
  int lanes;
  explicit Tail(int64_t n) : tail(n - n % W), lanes((int)(n % W)) {}
};

// Rows [0, rows) of `n` floats in tasks of about 16K floats.
template <typename F>
void for_rows(ffi::ThreadPool& pool, int64_t rows, int64_t n, F&& f) {
  const int64_t per_task = std::max<int64_t>(1, (int64_t(16) << 10) / std::max<int64_t>(n, 1));
  parallel_for(pool, ceil_div(rows, per_task), [&](int64_t task) {
    for (int64_t r = task * per_task; r < std::min(rows, (task + 1) * per_task); ++r) f(r);
  });
}

ffi::Error check_rows(const char* name, const F32Buffer& x, F32Result& y, int64_t* rows, int64_t* n) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() < 1 || xd.size() != yd.size() || !std::equal(xd.begin(), xd.end(), yd.begin()))
    return ffi::Error::InvalidArgument(std::string("jtile ") + name + ": y must have x's shape, of rank 1 or more");
  *n = xd.back();
  *rows = *n == 0 ? 0 : (int64_t)x.element_count() / *n;
  return ffi::Error::Success();
}

ffi::Error Softmax(ffi::ThreadPool pool, F32Buffer x, F32Result y) {
  int64_t rows, n;
  if (auto e = check_rows("softmax", x, y, &rows, &n); e.failure()) return e;
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  const Tail t(n);
  const float none = -std::numeric_limits<float>::infinity();  // past the row: exp gives 0
  for_rows(pool, rows, n, [&](int64_t r) {
    const float* in = xs + r * n;
    float* out = ys + r * n;
    V m = vset1(none);
    for (int64_t i = 0; i < t.tail; i += W) m = vmax_nan(m, vload(in + i));
    if (t.lanes) m = vmax_nan(m, vload_partial_or(in + t.tail, t.lanes, none));
    const V top = vset1(vmax_lanes(m));
    V sum = vzero();
    for (int64_t i = 0; i < t.tail; i += W) {
      const V e = vexp_nonpositive(vsub(vload(in + i), top));
      vstore(out + i, e);
      sum = vadd(sum, e);
    }
    V last = vzero();
    if (t.lanes) {
      last = vexp_nonpositive(vsub(vload_partial_or(in + t.tail, t.lanes, none), top));
      sum = vadd(sum, last);
    }
    const V inverse = vset1(1.0f / vsum_lanes(sum));
    for (int64_t i = 0; i < t.tail; i += W) vstore(out + i, vmul(vload(out + i), inverse));
    if (t.lanes) vstore_partial(out + t.tail, vmul(last, inverse), t.lanes);
  });
  return ffi::Error::Success();
}

ffi::Error LayerNorm(ffi::ThreadPool pool, F32Buffer x, F32Buffer scale, F32Buffer bias, float epsilon,
                     F32Result y) {
  int64_t rows, n;
  if (auto e = check_rows("layer_norm", x, y, &rows, &n); e.failure()) return e;
  if (!Bias::fits(scale, n) || !Bias::fits(bias, n))
    return ffi::Error::InvalidArgument("jtile layer_norm: scale and bias must hold one float or one per column");
  const Bias gamma(scale, n), beta(bias, n);
  const float *xs = x.typed_data(), *g = gamma.data(), *b = beta.data();
  float* ys = y->typed_data();
  const Tail t(n);
  for_rows(pool, rows, n, [&](int64_t r) {
    const float* in = xs + r * n;
    float* out = ys + r * n;
    V acc = vzero();
    for (int64_t i = 0; i < t.tail; i += W) acc = vadd(acc, vload(in + i));
    if (t.lanes) acc = vadd(acc, vload_partial(in + t.tail, t.lanes));
    const float mu = vsum_lanes(acc) / (float)n;
    const V mean = vset1(mu);
    acc = vzero();
    for (int64_t i = 0; i < t.tail; i += W) {
      const V c = vsub(vload(in + i), mean);
      acc = vfma(c, c, acc);
    }
    if (t.lanes) {
      const V c = vsub(vload_partial_or(in + t.tail, t.lanes, mu), mean);
      acc = vfma(c, c, acc);
    }
    const V inv = vset1(1.0f / std::sqrt(vsum_lanes(acc) / (float)n + epsilon));
    for (int64_t i = 0; i < t.tail; i += W)
      vstore(out + i, vadd(vmul(vmul(vsub(vload(in + i), mean), inv), vload(g + i)), vload(b + i)));
    if (t.lanes) {
      const int64_t i = t.tail;
      const V normed = vmul(vsub(vload_partial(in + i, t.lanes), mean), inv);
      vstore_partial(out + i, vadd(vmul(normed, vload_partial(g + i, t.lanes)), vload_partial(b + i, t.lanes)), t.lanes);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileSoftmax, jtile::Softmax,
                     xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>().Arg<jtile::F32Buffer>().Ret<jtile::F32Buffer>());
JTILE_DEFINE_HANDLER(JtileLayerNorm, jtile::LayerNorm,
                     xla::ffi::Ffi::Bind()
                         .Ctx<xla::ffi::ThreadPool>()
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Attr<float>("epsilon")
                         .Ret<jtile::F32Buffer>());
