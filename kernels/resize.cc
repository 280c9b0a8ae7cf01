// Separable resize of the last two axes of x (NCHW, or any leading axes), as
// jtile._resize computes it (ONNX Resize: nearest, linear, cubic): output row
// oy is sum_t x[rows[oy][t]] * row_weights[oy][t] over the row taps, and
// column ox of that row is sum_t row[cols[ox][t]] * col_weights[ox][t]; the
// taps' indices (already clamped to the input) and weights are computed in
// Python, once. Taps are summed in order (a product, then fused
// multiply-adds), so results match the jnp path to rounding, not bit for bit;
// a zero weight still multiplies its input (0 * inf is NaN there too). Each task is a run of planes; each output row is first
// built along H into a row buffer, then gathered along W, a vector of W
// outputs per tap (a permute when the input row fits in two vectors).
// Attributes: "taps" = [row taps, column taps]; "rows" / "row_weights" (OH x
// row taps); "cols" / "col_weights" (OW x column taps).
#include <vector>

#include "common.h"

namespace jtile {
namespace {

struct Axis {
  ffi::Span<const int64_t> index;
  ffi::Span<const float> weight;
  int64_t taps;
};

ffi::Error Resize(ffi::ThreadPool pool, F32Buffer x, ffi::Span<const int64_t> taps,
                  ffi::Span<const int64_t> rows, ffi::Span<const float> row_weights,
                  ffi::Span<const int64_t> cols, ffi::Span<const float> col_weights, F32Result y) {
  auto xd = x.dimensions(), yd = y->dimensions();
  const size_t r = xd.size();
  if (r < 2 || yd.size() != r || taps.size() != 2 || taps[0] < 1 || taps[1] < 1)
    return ffi::Error::InvalidArgument("jtile resize: bad ranks or taps attribute");
  for (size_t d = 0; d + 2 < r; ++d)
    if (xd[d] != yd[d]) return ffi::Error::InvalidArgument("jtile resize: only the last two axes may change");
  const int64_t h = xd[r - 2], w = xd[r - 1], oh = yd[r - 2], ow = yd[r - 1];
  const Axis ay{rows, row_weights, taps[0]}, ax{cols, col_weights, taps[1]};
  if ((int64_t)rows.size() != oh * ay.taps || (int64_t)row_weights.size() != oh * ay.taps ||
      (int64_t)cols.size() != ow * ax.taps || (int64_t)col_weights.size() != ow * ax.taps)
    return ffi::Error::InvalidArgument("jtile resize: tap tables do not match the output shape");
  for (int64_t i : rows)
    if (i < 0 || i >= h) return ffi::Error::InvalidArgument("jtile resize: a row tap is outside the input");
  for (int64_t i : cols)
    if (i < 0 || i >= w) return ffi::Error::InvalidArgument("jtile resize: a column tap is outside the input");
  const int64_t planes = h * w == 0 ? 0 : (int64_t)x.element_count() / (h * w);
  if (planes == 0 || oh * ow == 0) return ffi::Error::Success();

  // Column taps as int32 lane indices, a vector of W outputs per (vector, tap).
  const int64_t vectors = ceil_div(ow, W);
  std::vector<int32_t> lane_index(vectors * W * ax.taps, 0);
  std::vector<float> lane_weight(vectors * W * ax.taps, 0.0f);
  for (int64_t o = 0; o < ow; ++o)
    for (int64_t t = 0; t < ax.taps; ++t) {
      lane_index[(o / W * ax.taps + t) * W + o % W] = (int32_t)ax.index[o * ax.taps + t];
      lane_weight[(o / W * ax.taps + t) * W + o % W] = ax.weight[o * ax.taps + t];
    }
  const float* xs = x.typed_data();
  float* ys = y->typed_data();
  const int64_t per_task = std::max<int64_t>(1, planes / (8 * workers(pool)));
  parallel_for(pool, ceil_div(planes, per_task), [&](int64_t task) {
    std::vector<float> buffer(std::max<int64_t>(w, 2 * W), 0.0f);  // two vectors at least, for the permute
    float* row = buffer.data();
    for (int64_t plane = task * per_task; plane < std::min(planes, (task + 1) * per_task); ++plane) {
      const float* in = xs + plane * h * w;
      for (int64_t oy = 0; oy < oh; ++oy) {
        // Along H: row = sum_t in[rows[oy][t]] * row_weights[oy][t].
        for (int64_t i = 0; i < w; i += W) {
          const int lanes = (int)std::min<int64_t>(W, w - i);
          V acc = vzero();
          for (int64_t t = 0; t < ay.taps; ++t) {
            const float* src = in + ay.index[oy * ay.taps + t] * w + i;
            const V in_v = lanes == W ? vload(src) : vload_partial(src, lanes), wv = vset1(ay.weight[oy * ay.taps + t]);
            acc = t == 0 ? vmul(in_v, wv) : vfma(in_v, wv, acc);
          }
          if (lanes == W) vstore(row + i, acc); else vstore_partial(row + i, acc, lanes);
        }
        // Along W: out[ox] = sum_t row[cols[ox][t]] * col_weights[ox][t].
        float* out = ys + (plane * oh + oy) * ow;
        for (int64_t v = 0; v < vectors; ++v) {
          V acc = vzero();
          for (int64_t t = 0; t < ax.taps; ++t) {
            const int32_t* idx = &lane_index[(v * ax.taps + t) * W];
            V picked;
#if defined(__AVX512F__)
            const __m512i lanes_at = _mm512_loadu_si512(idx);
            picked = w <= 2 * W ? V{_mm512_permutex2var_ps(_mm512_loadu_ps(row), lanes_at, _mm512_loadu_ps(row + W))}
                                : V{_mm512_i32gather_ps(lanes_at, row, 4)};
#else
            alignas(64) float g[W];
            for (int l = 0; l < W; ++l) g[l] = row[idx[l]];
            picked = vload(g);
#endif
            const V wv = vload(&lane_weight[(v * ax.taps + t) * W]);
            acc = t == 0 ? vmul(picked, wv) : vfma(picked, wv, acc);
          }
          const int lanes = (int)std::min<int64_t>(W, ow - v * W);
          if (lanes == W) vstore(out + v * W, acc); else vstore_partial(out + v * W, acc, lanes);
        }
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileResize2d, jtile::Resize,
                     xla::ffi::Ffi::Bind()
                         .Ctx<xla::ffi::ThreadPool>()
                         .Arg<jtile::F32Buffer>()
                         .Attr<xla::ffi::Span<const int64_t>>("taps")
                         .Attr<xla::ffi::Span<const int64_t>>("rows")
                         .Attr<xla::ffi::Span<const float>>("row_weights")
                         .Attr<xla::ffi::Span<const int64_t>>("cols")
                         .Attr<xla::ffi::Span<const float>>("col_weights")
                         .Ret<jtile::F32Buffer>());
