// Dense layer y = act(x @ w + b), x (M, K), b (N,), w (K, N) row-major or,
// with transpose_w, (N, K) (PyTorch's Linear layout, y = x @ w.T).
// Unpacked w (few rows, jtile.kernels picks): matrix-vector paths that stream
// w once, in place. For (K, N): four rows of w at a time; tasks split K (so
// each reads long contiguous runs of w) and N blocks, accumulate into per-task
// partial rows, and a final pass sums the partials with bias and activation.
// The K split depends on the shape only, never on the thread count, and the
// partials are summed in a fixed order, so the bits are the same on any pool.
// For (N, K): each output is a dot product of a contiguous row of w with x,
// four rows at a time. Packed w (`packed`, as jtile.kernels.pack_gemm_weight
// lays it out): the GEMM of gemm.h, or for one row (a classifier at batch 1)
// a matrix-vector path that streams the strips several at a time.
//
// Matmul: batched products of two activations (attention's Q K^T and P V),
// y[b] = a[b] @ c[b], each operand a strided view of its buffer (so a head
// split or a transpose feeding the product need not be copied), every batch
// element one GEMM of gemm.h (gemm_batched: whole elements per worker),
// times `scale` as it is stored (attention's 1 / sqrt(d)). y is (B, M, N)
// row-major, or with `batch_inner` (M, B, N): the heads of attention's P V
// side by side per token, as the layer after the head merge reads them.
#include "gemm.h"

namespace jtile {
namespace {

constexpr int64_t GEMV_ACC_FLOATS = 4096;  // partial-sum floats per task (16 KB, L1)
constexpr int64_t GEMV_TASKS = 8;          // tasks the K split aims for (enough for 4 cores twice)

// acc[r][0:cols] += sum_{p in [k0, k1)} x[r][p] * w[p][0:cols] for r < m.
void gemv_block(int64_t m, int64_t k, int64_t n, int64_t cols, int64_t k0, int64_t k1,
                const float* x, const float* w, float* acc) {
  int64_t p = k0;
  for (; p + 4 <= k1; p += 4) {
    const float* w0 = w + p * n;
    for (int64_t j = 0; j < cols; j += W) {
      const int lanes = (int)std::min<int64_t>(W, cols - j);
      auto load = [&](const float* q) { return lanes == W ? vload(q + j) : vload_partial(q + j, lanes); };
      const V b0 = load(w0), b1 = load(w0 + n), b2 = load(w0 + 2 * n), b3 = load(w0 + 3 * n);
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * k + p;
        float* a = acc + r * cols + j;
        V s = lanes == W ? vload(a) : vload_partial(a, lanes);
        s = vfma(vset1(xr[0]), b0, s);
        s = vfma(vset1(xr[1]), b1, s);
        s = vfma(vset1(xr[2]), b2, s);
        s = vfma(vset1(xr[3]), b3, s);
        if (lanes == W) vstore(a, s); else vstore_partial(a, s, lanes);
      }
    }
  }
  for (; p < k1; ++p)
    for (int64_t r = 0; r < m; ++r) {
      const float xv = x[r * k + p];
      for (int64_t j = 0; j < cols; ++j) acc[r * cols + j] += xv * w[p * n + j];
    }
}

void gemv(ffi::ThreadPool& pool, int64_t m, int64_t k, int64_t n, const float* x, const float* w,
          const float* bias, const float* residual, const Epilogue& ep, float* y) {
  const int64_t block = std::max<int64_t>(W, GEMV_ACC_FLOATS / m / W * W);
  const int64_t nblocks = ceil_div(n, block);
  const int64_t kstep = std::max<int64_t>(64, ceil_div(k, ceil_div(GEMV_TASKS, nblocks)));
  const int64_t kchunks = std::max<int64_t>(1, ceil_div(k, kstep));
  // partial[chunk][block] holds m rows of that block's columns.
  Scratch partial = make_scratch(kchunks * m * n);
  parallel_for(pool, kchunks * nblocks, [&](int64_t task) {
    const int64_t c = task / nblocks, n0 = task % nblocks * block, cols = std::min(block, n - n0);
    gemv_block(m, k, n, cols, c * kstep, std::min(k, (c + 1) * kstep), x, w + n0,
               &partial[(c * n + n0) * m]);
  });
  parallel_for(pool, nblocks, [&](int64_t b) {
    const int64_t n0 = b * block, cols = std::min(block, n - n0);
    for (int64_t r = 0; r < m; ++r) {
      float* dst = y + r * n + n0;
      std::memcpy(dst, &partial[n0 * m + r * cols], cols * sizeof(float));
      for (int64_t c = 1; c < kchunks; ++c) {
        const float* src = &partial[(c * n + n0) * m + r * cols];
        for (int64_t j = 0; j < cols; ++j) dst[j] += src[j];
      }
      for (int64_t j = 0; j < cols; ++j) {
        float v = dst[j] + bias[n0 + j];
        if (residual) v += residual[r * n + n0 + j];
        dst[j] = ep(v);
      }
    }
  });
}

// y[r][n] = ep(dot(x[r], w[n]) + bias[n]) for w (N, K) row-major. w streams
// from memory once (a classifier's 5 MB, or a squeeze-excitation's 1 MB
// that the rest of the model pushed out of cache), so a task reads one
// contiguous run of rows, ROWS at a time, and prefetches ahead of what it
// reads. Short rows (240 floats) end before the hardware prefetcher has caught
// on: each group of rows first prefetches PREFETCH_FLOATS (8 KB) past its
// start. Measured streaming 37 MB of weights through 40 layers of 240x960:
// 1.4-1.5x; 960x1280: 1.1x. Rows of LONG_ROW floats or more (AlexNet's and
// VGG's 9216- and 4096-wide classifiers) would make that a burst of hundreds
// of prefetches ahead of the work; each row instead prefetches ROW_AHEAD
// floats ahead as it reads: 1.2-1.3x on 9216->4096 and 4096->4096 (two runs,
// interleaved in one process: 26.7 -> 31.7 and 32.8 -> 42.7 GB/s on the
// first shape, 25.7 -> 30.7 and 30.4 -> 36.5 on the second, 128 floats
// ahead). On a Zen 5 with more bandwidth, 512 floats ahead against 128 (two
// runs each): 9216->4096 47.5-48.1 against 41.2-42.9 GB/s, 4096->4096
// 56.4-56.7 against 44.5-44.9, and with the weights evicted before each call
// 2048->1000 197-202 against 211-223 us, 1280->1000 144-149 against 157-165,
// 4096->1000 322-360 against 404-406 (256 ahead: in between; 1024: slower).
void gemv_nk(ffi::ThreadPool& pool, int64_t m, int64_t k, int64_t n, const float* x,
             const float* w, const float* bias, const float* residual, const Epilogue& ep, float* y) {
  constexpr int64_t ROWS = 4, ROWS_PER_TASK = 64, PREFETCH_FLOATS = 2048, LONG_ROW = 1024, ROW_AHEAD = 512;
  const bool long_rows = k >= LONG_ROW;
  parallel_for(pool, ceil_div(n, ROWS_PER_TASK), [&](int64_t task) {
    const int64_t end = std::min(n, (task + 1) * ROWS_PER_TASK);
    for (int64_t n0 = task * ROWS_PER_TASK; n0 < end; n0 += ROWS) {
      const int64_t rows = std::min(ROWS, end - n0);
      if (!long_rows)
        for (int64_t i = n0 * k + PREFETCH_FLOATS; i < std::min(n * k, (n0 + rows) * k + PREFETCH_FLOATS); i += 64 / (int64_t)sizeof(float))
          __builtin_prefetch(w + i);
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * k;
        V acc[ROWS] = {vzero(), vzero(), vzero(), vzero()};
        for (int64_t p = 0; p < k; p += W) {
          const int lanes = (int)std::min<int64_t>(W, k - p);
          const V xv = lanes == W ? vload(xr + p) : vload_partial(xr + p, lanes);
          const bool ahead = long_rows && r == 0 && p + ROW_AHEAD < k;
          for (int64_t i = 0; i < rows; ++i) {
            const float* wi = w + (n0 + i) * k + p;
            if (ahead) __builtin_prefetch(wi + ROW_AHEAD);
            acc[i] = vfma(xv, lanes == W ? vload(wi) : vload_partial(wi, lanes), acc[i]);
          }
        }
        for (int64_t i = 0; i < rows; ++i) {
          float lane[W];
          vstore(lane, acc[i]);
          float total = 0.0f;
          for (float v : lane) total += v;
          float v = total + bias[n0 + i];
          if (residual) v += residual[r * n + n0 + i];
          y[r * n + n0 + i] = ep(v);
        }
      }
    }
  });
}

// y = ep(x @ w + bias) for one row x and w pre-packed as the GEMM's B: strip j
// holds columns [j * NR, (j + 1) * NR) as K rows of NR floats, one contiguous
// run. One row has no reuse of w, so the product is the speed at which w
// streams from memory, and that needs several streams in flight per core: a
// task reads PACKED_STREAMS strips side by side, each prefetching
// PACKED_AHEAD floats ahead (reading 151 MB on this Zen 5, 2 threads: 37 GB/s
// with one stream a thread, 64 with two, 75 with four and 2 KB prefetched
// ahead; the GEMM, one strip at a time, 46). Few strips are split along K as
// well, by the shape only, and the partial sums added in a fixed order.
constexpr int PACKED_STREAMS = 4;

// Strips [first, first + G) of w over k in [k0, k1): w at strip first, row
// k0 (each strip kc x NR floats, k-major), `stride` floats between strips.
template <int G>
void gemv_strips(int64_t kc, const float* x, const float* w, int64_t stride, float* out) {
  constexpr int64_t PACKED_AHEAD = 512;
  V acc[G][GEMM_NV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < GEMM_NV; ++v) acc[g][v] = vzero();
  for (int64_t p = 0; p < kc; ++p) {
    const V xv = vset1(x[p]);
    for (int g = 0; g < G; ++g) {
      const float* row = w + g * stride + p * GEMM_NR;
      for (int l = 0; l < GEMM_NR; l += 64 / sizeof(float)) __builtin_prefetch(row + PACKED_AHEAD + l);
      for (int v = 0; v < GEMM_NV; ++v) acc[g][v] = vfma(xv, vload(row + v * W), acc[g][v]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < GEMM_NV; ++v) vstore(out + g * GEMM_NR + v * W, acc[g][v]);
}

void gemv_packed(ffi::ThreadPool& pool, int64_t k, int64_t n, const float* x, const Prepacked& w, const float* bias,
                 const float* residual, const Epilogue& ep, float* y) {
  constexpr int G = PACKED_STREAMS;
  const int64_t strips = ceil_div(n, GEMM_NR), groups = ceil_div(strips, G);
  const int64_t kchunks = std::clamp<int64_t>(ceil_div(GEMV_TASKS, groups), 1, std::max<int64_t>(1, k / 256));
  const int64_t kstep = ceil_div(k, kchunks);
  // partial[c] holds chunk c's sums of every (padded) column.
  Scratch partial = make_scratch(kchunks * groups * G * GEMM_NR);
  parallel_for(pool, groups * kchunks, [&](int64_t task) {
    const int64_t g = task / kchunks, c = task % kchunks, first = g * G, count = std::min<int64_t>(G, strips - first);
    const int64_t k0 = c * kstep, kc = std::min(k, k0 + kstep) - k0;
    int64_t stride;
    const float* wg = w.packed(k0, first * GEMM_NR, &stride);
    float* out = &partial[(c * groups * G + first) * GEMM_NR];
    switch (count) {
      case 4: gemv_strips<4>(kc, x + k0, wg, stride, out); break;
      case 3: gemv_strips<3>(kc, x + k0, wg, stride, out); break;
      case 2: gemv_strips<2>(kc, x + k0, wg, stride, out); break;
      default: gemv_strips<1>(kc, x + k0, wg, stride, out); break;
    }
  });
  const int64_t padded = groups * G * GEMM_NR;
  for (int64_t j = 0; j < n; ++j) {
    float v = partial[j];
    for (int64_t c = 1; c < kchunks; ++c) v += partial[c * padded + j];
    v += bias[j];
    if (residual) v += residual[j];
    y[j] = ep(v);
  }
}

ffi::Error Dense(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b, F32Buffer res, int64_t act,
                 float alpha, float lo, float hi, int64_t transpose_w, int64_t packed, F32Result y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const int64_t wk = transpose_w ? 1 : 0;
  const bool shapes = xd.size() == 2 && yd.size() == 2 && yd[0] == xd[0] &&
                      Bias::fits(b, yd[1]) &&
                      (packed ? wd.size() == 4 && wd[0] == 1 && wd[1] == ceil_div(yd[1], GEMM_NR) &&
                                    wd[2] == xd[1] && wd[3] == GEMM_NR
                              : wd.size() == 2 && xd[1] == wd[wk] && yd[1] == wd[1 - wk]);
  if (!shapes || (res.element_count() != 0 && res.element_count() != y->element_count()))
    return ffi::Error::InvalidArgument(
        "jtile dense: expected x (M, K), w (K, N), (N, K) or packed (1, strips, K, NR), b (N,) or (1,), "
        "the residual empty or (M, N), y (M, N)");
  Epilogue ep;
  if (auto e = make_epilogue(act, alpha, lo, hi, &ep); e.failure()) return e;
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  if (m == 0 || n == 0) return ffi::Error::Success();
  const Bias bias(b, n);
  const float *xs = x.typed_data(), *ws = w.typed_data(), *bs = bias.data();
  const float* rs = res.element_count() ? res.typed_data() : nullptr;
  float* ys = y->typed_data();
  if (packed && m == 1)
    gemv_packed(pool, k, n, xs, Prepacked(ws, k, GEMM_NR), bs, rs, ep, ys);
  else if (packed)
    gemm(pool, m, n, k, Rows(xs, k), Prepacked(ws, k, GEMM_NR), GemmOutput{ys, n, nullptr, bs, ep, rs});
  else if (transpose_w)
    gemv_nk(pool, m, k, n, xs, ws, bs, rs, ep, ys);
  else
    gemv(pool, m, k, n, xs, ws, bs, rs, ep, ys);
  return ffi::Error::Success();
}

// One operand of a batched product as `rows` x K views of its buffer: element
// (batch, row, p) at offset + batch * batch_stride + row * row_stride + p *
// k_stride. Either rows or K must be contiguous (stride 1): the view is then
// Rows or Columns of gemm.h.
struct View {
  const float* data;
  int64_t offset, batch_stride, row_stride, k_stride;

  bool valid(int64_t batch, int64_t rows, int64_t k, int64_t count) const {
    if (std::min({offset, batch_stride, row_stride, k_stride}) < 0 || (row_stride != 1 && k_stride != 1)) return false;
    const int64_t last = offset + (batch - 1) * batch_stride + (rows - 1) * row_stride + (k - 1) * k_stride;
    return last < count;
  }
};

ffi::Error Matmul(ffi::ThreadPool pool, F32Buffer a, F32Buffer c, ffi::Span<const int64_t> dims,
                  ffi::Span<const int64_t> a_view, ffi::Span<const int64_t> c_view, float scale,
                  int64_t batch_inner, F32Result y) {
  if (dims.size() != 4 || a_view.size() != 4 || c_view.size() != 4)
    return ffi::Error::InvalidArgument(
        "jtile matmul: expected dims [B, M, N, K] and, per operand, [offset, batch, row, k strides]");
  const int64_t batch = dims[0], m = dims[1], n = dims[2], k = dims[3];
  const View av{a.typed_data(), a_view[0], a_view[1], a_view[2], a_view[3]};
  const View cv{c.typed_data(), c_view[0], c_view[1], c_view[2], c_view[3]};
  if (std::min({batch, m, n, k}) < 1 || (int64_t)y->element_count() != batch * m * n ||
      !av.valid(batch, m, k, (int64_t)a.element_count()) || !cv.valid(batch, n, k, (int64_t)c.element_count()))
    return ffi::Error::InvalidArgument(
        "jtile matmul: dims [B, M, N, K] must be positive, y must hold B*M*N floats, and each operand "
        "view must lie inside its buffer with its rows or its K axis contiguous");
  float* ys = y->typed_data();
  const Epilogue ep = scale == 1.0f ? Epilogue{} : Epilogue{kScale, scale};
  gemm_batched(pool, batch, m, n, k, [&](int64_t i, const GemmCompute& compute) {
    auto operand = [&](const View& v, auto&& use) {
      const float* p = v.data + v.offset + i * v.batch_stride;
      if (v.k_stride == 1) use(Rows(p, v.row_stride));
      else use(Columns(p, v.k_stride));
    };
    operand(av, [&](const Operand& lhs) {
      operand(cv, [&](const Operand& rhs) {
        compute(lhs, rhs, batch_inner ? GemmOutput{ys + i * n, batch * n, nullptr, nullptr, ep}
                                      : GemmOutput{ys + i * m * n, n, nullptr, nullptr, ep});
      });
    });
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileDense, jtile::Dense,
                     xla::ffi::Ffi::Bind()
                         .Ctx<xla::ffi::ThreadPool>()
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .JTILE_EPILOGUE_ATTRS
                         .Attr<int64_t>("transpose_w")
                         .Attr<int64_t>("packed")
                         .Ret<jtile::F32Buffer>());

JTILE_DEFINE_HANDLER(JtileMatmul, jtile::Matmul,
                     xla::ffi::Ffi::Bind()
                         .Ctx<xla::ffi::ThreadPool>()
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Attr<xla::ffi::Span<const int64_t>>("dims")
                         .Attr<xla::ffi::Span<const int64_t>>("a_view")
                         .Attr<xla::ffi::Span<const int64_t>>("c_view")
                         .Attr<float>("scale")
                         .Attr<int64_t>("batch_inner")
                         .Ret<jtile::F32Buffer>());
