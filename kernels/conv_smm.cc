// Convolution as GEMM ("smm", as ai3 calls it) on weights packed ahead of
// time (jtile.kernels.pack_gemm_weight), per group, in one of two
// orientations:
// - channel rows: out (O/g x OH*OW) = w (O/g x C/g*KH*KW) times im2col(x),
//   one image at a time; output pixels are the vector lanes. Suits large
//   images.
// - pixel rows: out^T (N*OH*OW x O/g) = im2col(x)^T times w^T over the whole
//   batch; output channels are the vector lanes and the result is written
//   back transposed. Suits small images with many channels, where a row of
//   pixels would fill few lanes.
// The im2col matrix is never materialised: its operand gathers it straight
// into packed strips. A 1x1, stride-1, unpadded conv in channel rows needs no
// gathering at all (a strided one copies the pixels it reads first, then runs
// at stride 1 on the copy): x itself is the B matrix, read in place, unless it
// has a prologue (the "shift", "scale" and "bias" buffers, each one value per input
// channel, one for all or none: see ChannelValues; and the
// "prologue_activation" attribute): then each value is packed as
// act((x - shift) * scale + bias), the folded batch norm and ReLU that
// DenseNet applies to every concatenation before its 1x1 conv, so that they
// cost no pass of their own. In pixel rows (one image) x is then packed as A.
//
// Padding may be negative (a window of x that starts or ends inside it: a
// conv reading a crop of x in place), read by the im2col gather.
//
// In pixel rows, x and y may be channel-blocked, NCHWc (one image;
// attributes "x_nchwc" and "y_nchwc"): the GEMM then reads a
// 1x1 conv's x in place, each (pixel, channel) broadcast from its block, and
// stores each vector of output channels straight into its block, with neither
// the packing of x nor the transposed write-back of y.
#include "gemm.h"

namespace jtile {
namespace {

// im2col of the group's channels: row i is output position i = (image,
// oy, ox) of the batch, column k = (c, ky, kx). A strip's rows are split into
// runs that stay in one output row; for each k a run is then one strided (at
// stride 1, contiguous) read of an input row, zero-filled in the padding.
struct Im2col final : Operand {
  const ConvShape& s;
  const float* x;  // first channel of the group in image 0
  Im2col(const ConvShape& s, const float* x) : s(s), x(x) {}

  struct Run {
    int q0, len;          // rows [q0, q0 + len) of the strip
    const float* image;   // the group's first channel in this run's image
    int64_t iy, ix;       // input position of the first row's (0, 0) tap
  };

  void pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int r, float* dst) const override {
    const int64_t pixels = s.oh * s.ow;
    Run runs[GEMM_MAX_STRIP];  // a run per row at most
    for (int64_t j = 0; j < count; j += r, dst += kc * r) {
      const int rows = (int)std::min<int64_t>(r, count - j);
#if defined(__AVX512F__)
      if (gather(k0, kc, i0 + j, rows, r, dst)) continue;
#endif
      int nruns = 0;
      for (int q = 0; q < rows;) {
        const int64_t i = i0 + j + q, img = i / pixels, p = i % pixels, oy = p / s.ow, ox = p % s.ow;
        const int len = (int)std::min<int64_t>(rows - q, s.ow - ox);
        runs[nruns++] = Run{q, len, x + img * s.c * s.h * s.w, oy * s.sh - s.pt, ox * s.sw - s.pl};
        q += len;
      }
      pack_runs(k0, kc, runs, nruns, r, rows, dst);
    }
  }

#if defined(__AVX512F__)
  // A strip of at most W rows (pixel rows): each k is one masked gather of
  // the rows' inputs at that tap; the mask of each tap marks which rows read
  // the input rather than the padding. False if offsets do not fit int32 or
  // the window has too many taps for the mask table.
  bool gather(int64_t k0, int64_t kc, int64_t i0, int rows, int r, float* dst) const {
    constexpr int64_t kMaxTaps = 256;
    const int64_t taps = s.kh * s.kw, plane = s.h * s.w, pixels = s.oh * s.ow;
    if (r > W || taps > kMaxTaps || s.n * s.c * plane >= (int64_t(1) << 31)) return false;
    alignas(64) int32_t base[W] = {};
    int64_t iy0[W], ix0[W];
    for (int q = 0; q < rows; ++q) {
      const int64_t i = i0 + q, img = i / pixels, p = i % pixels;
      iy0[q] = p / s.ow * s.sh - s.pt;
      ix0[q] = p % s.ow * s.sw - s.pl;
      base[q] = int32_t(img * s.c * plane + iy0[q] * s.w + ix0[q]);
    }
    __mmask16 masks[kMaxTaps];
    int32_t tap_offset[kMaxTaps];
    for (int64_t t = 0; t < taps; ++t) {
      const int64_t dy = t / s.kw * s.dh, dx = t % s.kw * s.dw;
      unsigned m = 0;
      for (int q = 0; q < rows; ++q) {
        const int64_t iy = iy0[q] + dy, ix = ix0[q] + dx;
        if (iy >= 0 && iy < s.h && ix >= 0 && ix < s.w) m |= 1u << q;
      }
      masks[t] = __mmask16(m);
      tap_offset[t] = int32_t(dy * s.w + dx);
    }
    const __mmask16 row_mask = vmask(r);
    // Rows in one output row at stride 1 read consecutive inputs: a masked
    // load (masked-off lanes are not read) instead of a gather.
    const bool contiguous = s.sw == 1 && base[rows - 1] - base[0] == rows - 1 &&
                            iy0[rows - 1] == iy0[0];
    const __m512i vbase = _mm512_load_si512(base);
    // k = (channel, tap), stepped rather than divided out (6% of a 3x3 128->32
    // at 14x14, whose packing is half its time).
    int64_t t = k0 % taps;
    int32_t channel = int32_t(k0 / taps * plane);
    for (int64_t kk = 0; kk < kc; ++kk) {
      const int32_t offset = channel + tap_offset[t];
      const __m512 v = contiguous
          ? _mm512_maskz_loadu_ps(masks[t], x + base[0] + offset)
          : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), masks[t],
                                     _mm512_add_epi32(vbase, _mm512_set1_epi32(offset)), x, 4);
      _mm512_mask_storeu_ps(dst + kk * r, row_mask, v);
      if (++t == taps) t = 0, channel += int32_t(plane);
    }
    return true;
  }
#endif

  void pack_runs(int64_t k0, int64_t kc, const Run* runs, int nruns, int r, int rows, float* dst) const {
    const int64_t taps = s.kh * s.kw;
    int64_t c = k0 / taps, ky = k0 % taps / s.kw, kx = k0 % s.kw;  // k = (c, ky, kx), stepped
    for (int64_t kk = 0; kk < kc; ++kk) {
      const int64_t dy = ky * s.dh, dx = kx * s.dw;
      float* d = dst + kk * r;
      std::fill(d + rows, d + r, 0.0f);
      for (int q = 0; q < nruns; ++q) {
        const Run& run = runs[q];
        float* out = d + run.q0;
        const int64_t iy = run.iy + dy, ix = run.ix + dx;
        if (iy < 0 || iy >= s.h) {
          std::fill(out, out + run.len, 0.0f);
          continue;
        }
        // Rows e with 0 <= ix + e * sw < w read the input, the rest are padding.
        const int64_t lo = std::min<int64_t>(run.len, ix >= 0 ? 0 : ceil_div(-ix, s.sw));
        const int64_t hi = std::max(lo, std::min<int64_t>(run.len, ix < s.w ? ceil_div(s.w - ix, s.sw) : 0));
        const float* in = run.image + (c * s.h + iy) * s.w + ix;
        std::fill(out, out + lo, 0.0f);
        if (s.sw == 1) {
          // Runs are short (an output row of a strip, often under 32 floats):
          // inline vector copies, not a memcpy call per run (which took 7% of a
          // 5x5 64->192 conv at 27x27).
          int64_t e = lo;
          for (; e + W <= hi; e += W) vstore(out + e, vload(in + e));
          if (e < hi) vstore_partial(out + e, vload_partial(in + e, int(hi - e)), int(hi - e));
        } else {
          copy_strided(out + lo, in + lo * s.sw, hi - lo, s.sw);
        }
        std::fill(out + hi, out + run.len, 0.0f);
      }
      if (++kx == s.kw) {
        kx = 0;
        if (++ky == s.kh) ky = 0, ++c;
      }
    }
  }
};

// x of a pointwise conv (K channels x N pixels, row-major) packed with the
// per-channel prologue, in the order the batch norm computes it: B in channel
// rows. (In pixel rows, A's strips of MR pixels took partial vectors a channel
// each, so ConvSmm applies the prologue to a copy of x, `apply` a channel at a
// time, and A reads the copy in place.)
struct PrologueColumns final : Operand {
  const float* x;
  int64_t ldx;
  ChannelValues shift, scale, bias;
  Epilogue act;
  PrologueColumns(const float* x, int64_t ldx, const ChannelValues& shift, const ChannelValues& scale,
                  const ChannelValues& bias, Epilogue act)
      : x(x), ldx(ldx), shift(shift), scale(scale), bias(bias), act(act) {}

  // Channel q's values [i0, i0 + count) with the prologue into dst.
  void apply(int64_t q, int64_t i0, int64_t count, float* dst) const {
    const float* src = x + q * ldx + i0;
    act.visit([&](auto f) {
      const V m = vset1(shift[q]), sc = vset1(scale[q]), b = vset1(bias[q]);
      for (int64_t v = 0; v < count; v += W) {
        const int lanes = (int)std::min<int64_t>(W, count - v);
        const V out = f(vadd(vmul(vsub(lanes == W ? vload(src + v) : vload_partial(src + v, lanes), m), sc), b));
        if (lanes == W) vstore(dst + v, out); else vstore_partial(dst + v, out, lanes);
      }
    });
  }

  void pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int r, float* dst) const override {
    for (int64_t s = 0; s < count; s += r, dst += kc * r) {
      const int64_t cols = std::min<int64_t>(r, count - s);
      for (int64_t q = 0; q < kc; ++q) {
        apply(k0 + q, i0 + s, cols, dst + q * r);
        std::fill(dst + q * r + cols, dst + (q + 1) * r, 0.0f);  // columns past the end
      }
    }
  }
};

// Channel rows' pre-packed weight (an A of R-row strips) with each column k,
// an input channel's weights, multiplied by scale[k] as the GEMM packs it once
// up front: a prologue that only scales x (a squeeze-excitation's), applied to
// the O x C weights instead of to x, which the GEMM then reads in place.
struct ScaledWeights final : Operand {
  const float* p;
  int64_t k;
  ChannelValues scale;
  ScaledWeights(const float* p, int64_t k, const ChannelValues& scale) : p(p), k(k), scale(scale) {}

  void pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int r, float* dst) const override {
    for (int64_t s = 0; s < count; s += r, dst += kc * r) {
      const float* src = p + (i0 + s) / r * k * r + k0 * r;
      for (int64_t q = 0; q < kc; ++q) {
        const V sc = vset1(scale[k0 + q]);
        for (int j = 0; j < r; j += W) {
          const int lanes = std::min(W, r - j);
          const float* from = src + q * r + j;
          const V v = vmul(lanes == W ? vload(from) : vload_partial(from, lanes), sc);
          if (lanes == W) vstore(dst + q * r + j, v); else vstore_partial(dst + q * r + j, v, lanes);
        }
      }
    }
  }
};

ffi::Error ConvSmm(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b, F32Buffer res, F32Buffer,
                   ffi::Span<const int64_t> attr, int64_t act, float alpha, float lo, float hi, int64_t channel0,
                   ffi::Span<const int64_t> kernel, int64_t pixel_rows, F32Buffer x_shift, F32Buffer x_scale,
                   F32Buffer x_bias, int64_t prologue_activation, int64_t x_channels, int64_t x_nchwc, int64_t y_nchwc,
                   F32Result y) {
  auto wd = w.dimensions();
  ConvShape s;
  Epilogue ep;
  if (auto e = decode_packed_conv("smm", x, kernel, b, attr, y, act, alpha, lo, hi, &s, &ep, channel0, {}, x_channels,
                                   Layouts{x_nchwc != 0, y_nchwc != 0}, /*crops=*/true);
      e.failure())
    return e;
  const int64_t og = s.og(), taps = s.cg * s.kh * s.kw, pixels = s.oh * s.ow;
  // Pixel rows: B is the weight, in strips of the wide tile's NR columns;
  // channel rows: A is the weight, in strips of the tall tile's MR rows.
  const int r = pixel_rows ? GEMM_NR : GEMM_TALL_MR;
  if (wd.size() != 4 || wd[0] != s.groups || wd[1] != ceil_div(og, r) || wd[2] != taps || wd[3] != r)
    return ffi::Error::InvalidArgument(
        "jtile smm: the packed w (groups, strips, K, R) does not match the conv and the GEMM tile");
  const bool has_residual = res.element_count() > 0;
  if (has_residual && (int64_t)res.element_count() != (y_nchwc ? (int64_t)y->element_count() : conv_output_size(s)))
    return ffi::Error::InvalidArgument("jtile smm: the residual must be empty or have the output's shape");
  const ChannelValues shift(x_shift, 0.0f), scale(x_scale, 1.0f), offset(x_bias, 0.0f);
  const bool has_prologue = shift.given() || scale.given() || offset.given() || prologue_activation != 0;
  const bool unpadded_1x1 = s.kh == 1 && s.kw == 1 && s.pt == 0 && s.pb == 0 && s.pl == 0 && s.pr == 0;
  const float* xs = x.typed_data();
  // A strided 1x1 conv reads every sh-th row and sw-th column of x: those
  // pixels are copied once, by all workers, and the conv runs at stride 1 on
  // the copy, which the GEMM reads in place (or a prologue packs).
  Scratch subsampled;
  if (unpadded_1x1 && (s.sh > 1 || s.sw > 1) && !x_nchwc) {
    subsampled = Scratch(s.n * s.c * s.oh * s.ow, false);
    parallel_for(pool, s.n * s.c, [&](int64_t plane) {
      for (int64_t oy = 0; oy < s.oh; ++oy)
        copy_strided(&subsampled[(plane * s.oh + oy) * s.ow], xs + (plane * s.h + oy * s.sh) * s.w, s.ow, s.sw);
    });
    xs = subsampled.get();
    s.h = s.oh, s.w = s.ow, s.sh = s.sw = 1;
  }
  const bool pointwise = unpadded_1x1 && s.sh == 1 && s.sw == 1;
  // A prologue that only scales x, in channel rows with at least 4 pixels an
  // output channel: the weights are scaled instead, once, and x is read in
  // place. Per call in the model, us (EfficientNet-B0): 32->16 at 112x112 46.5
  // against 64.0, 144->24 at 56x56 54.9 against 73.7, 240->40 at 28x28 42.2
  // against 48.6; the model 0.993x best of rounds (0.983x median). With fewer
  // pixels (480->112 at 14x14: 68.6 against 63.5; 672->160 at 7x7: 61.3
  // against 46.2) packing the scaled x cost less, and pixel rows, which scale
  // a copy of x, less still: jtile.kernels.smm_pixel_rows sends those there.
  const bool scales_only = !pixel_rows && pixels >= 4 * og && scale.given() && !shift.given() && !offset.given() &&
                           prologue_activation == 0;
  Epilogue prologue_act;
  if (auto e = make_epilogue(prologue_activation, 0.0f, 0.0f, 6.0f, &prologue_act); e.failure()) return e;
  if (has_prologue && (!pointwise || (pixel_rows && s.n != 1) || s.groups != 1 ||
                       !ChannelValues::fits(x_shift, s.c) || !ChannelValues::fits(x_scale, s.c) ||
                       !ChannelValues::fits(x_bias, s.c)))
    return ffi::Error::InvalidArgument(
        "jtile smm: a prologue needs a pointwise conv (of one image in pixel rows), one group, and C values, "
        "one or none each of shift, scale and bias");
  if (((x_nchwc || y_nchwc) && (!pixel_rows || s.groups != 1 || s.n != 1 || channel0 >= 0)) ||
      (x_nchwc && has_prologue))
    return ffi::Error::InvalidArgument(
        "jtile smm: NCHWc x or y needs pixel rows, one group, one image and no concatenation buffer, and an "
        "NCHWc x no prologue");
  if (x_nchwc && !pointwise)
    return ffi::Error::InvalidArgument("jtile smm: an NCHWc x needs a 1x1, stride-1, unpadded conv");
  // GEMM i: group i / images, and image i % images in channel rows (pixel
  // rows take the whole batch at once).
  const int64_t images = pixel_rows ? 1 : s.n, count = s.groups * images;
  const Bias bias_of(b, s.o);
  auto run = [&](int64_t i, bool serial) {
    const int64_t g = i / images, n = i % images;
    const Prepacked wg(w.typed_data() + g * wd[1] * taps * r, taps, r);
    const float* bias = bias_of.data() + g * og;
    float* yg = conv_output(s, y, channel0) + g * og * pixels;
    const float* rg = has_residual ? res.typed_data() + g * og * pixels : nullptr;
    if (pixel_rows) {
      GemmOutput out = y_nchwc ? GemmOutput{yg, W, nullptr, bias, ep, rg, 0, 0, pixels * W}
                               : GemmOutput{yg, pixels, nullptr, bias, ep, rg, pixels, s.o * pixels};
      if (x_nchwc)
        gemm(pool, pixels, og, taps, NchwcRows(xs, pixels), wg, out, serial);
      else if (has_prologue) {  // x with the prologue, a channel a task, then read in place
        // (MobileNetV3's squeeze-excitation scales before its 960->160 at 7x7:
        // 88 us in the model with the prologue packed into A's strips, 51 so)
        const PrologueColumns prologue(xs, pixels, shift, scale, offset, prologue_act);
        Scratch applied(s.c * pixels, false);
        parallel_for(pool, s.c, [&](int64_t q) { prologue.apply(q, 0, pixels, &applied[q * pixels]); });
        gemm(pool, pixels, og, taps, Columns(&applied[0], pixels), wg, out, serial);
      }
      else if (pointwise && s.n == 1)  // x's channel rows are A's columns: read in place
        gemm(pool, pixels, og, taps, Columns(xs + g * s.cg * pixels, pixels), wg, out, serial);
      else
        gemm(pool, s.n * pixels, og, taps, Im2col(s, xs + g * s.cg * s.h * s.w), wg, out, serial);
      return;
    }
    const float* xg = xs + (n * s.c + g * s.cg) * s.h * s.w;
    GemmOutput out{yg + n * s.o * pixels, pixels, bias, nullptr, ep, rg ? rg + n * s.o * pixels : nullptr};
    if (scales_only)
      gemm(pool, og, pixels, taps, ScaledWeights(wg.p, taps, scale), Columns(xg, pixels), out, serial,
           GemmShape::kTall);
    else if (has_prologue)
      gemm(pool, og, pixels, taps, wg,
           PrologueColumns(xg, pixels, shift, scale, offset, prologue_act),
           out, serial, GemmShape::kTall);
    else if (pointwise)
      gemm(pool, og, pixels, taps, wg, Columns(xg, pixels), out, serial, GemmShape::kTall);
    else
      gemm(pool, og, pixels, taps, wg, Im2col(s, xg), out, serial, GemmShape::kTall);
  };
  // Many GEMMs (grouped convs): one a task, each on one thread, since a
  // group's GEMM is too small to pay for spreading it over the workers
  // (ResNeXt's 32 groups at 14x14: 16x196x144 each). Few: each over the workers.
  if (count >= 2 * workers(pool))
    parallel_for(pool, count, [&](int64_t i) { run(i, true); });
  else
    for (int64_t i = 0; i < count; ++i) run(i, false);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileConvSmm, jtile::ConvSmm,
                     JTILE_CONV_RESIDUAL_BINDING.Attr<xla::ffi::Span<const int64_t>>("kernel")
                         .Attr<int64_t>("pixel_rows")
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Arg<jtile::F32Buffer>()
                         .Attr<int64_t>("prologue_activation")
                         .Attr<int64_t>("x_channels")
                         .Attr<int64_t>("x_nchwc")
                         .Attr<int64_t>("y_nchwc")
                         .Ret<jtile::F32Buffer>());
