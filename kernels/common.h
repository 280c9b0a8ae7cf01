// Shared helpers for the jtile FFI kernels: SIMD vectors, parallel-for on
// XLA's intra-op thread pool, fused epilogues (bias + activation), and the
// conv attribute decoding every conv algorithm shares.
//
// The vector width is chosen at build time: AVX-512 (16 lanes), AVX2+FMA
// (8 lanes), or a portable 8-lane struct the compiler vectorises as it can.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jtile {

namespace ffi = xla::ffi;
using F32Buffer = ffi::Buffer<ffi::F32>;
using F32Result = ffi::ResultBuffer<ffi::F32>;

// ---------------------------------------------------------------------------
// SIMD vector of W floats. Every operation propagates NaN like jnp does.

#if defined(__AVX512F__)
constexpr int W = 16;
struct V { __m512 v; };
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset1(float x) { return {_mm512_set1_ps(x)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V x) { _mm512_storeu_ps(p, x.v); }
inline __mmask16 vmask(int n) { return (__mmask16)((1u << n) - 1u); }
inline V vload_partial(const float* p, int n) { return {_mm512_maskz_loadu_ps(vmask(n), p)}; }
inline void vstore_partial(float* p, V x, int n) { _mm512_mask_storeu_ps(p, vmask(n), x.v); }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// max/min return the second operand when either is NaN: keep x second.
inline V vclamp_lo(V x, float lo) { return {_mm512_max_ps(_mm512_set1_ps(lo), x.v)}; }
inline V vclamp_hi(V x, float hi) { return {_mm512_min_ps(_mm512_set1_ps(hi), x.v)}; }
inline V vleaky(V x, float alpha) {
  __mmask16 neg = _mm512_cmp_ps_mask(x.v, _mm512_setzero_ps(), _CMP_LT_OQ);
  return {_mm512_mask_mul_ps(x.v, neg, x.v, _mm512_set1_ps(alpha))};
}
// max(a, b) that is NaN when either is (jnp.maximum's rule).
inline V vmax_nan(V a, V b) {
  const __m512 m = _mm512_max_ps(b.v, a.v);  // a when either is NaN
  return {_mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(b.v, b.v, _CMP_UNORD_Q), b.v)};
}
inline V vload_strided(const float* p, int64_t stride) {
  if (stride == 1) return vload(p);
  if (stride == 2) {  // even lanes of two vectors (reads one float past the last used)
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return {_mm512_permutex2var_ps(_mm512_loadu_ps(p), even, _mm512_maskz_loadu_ps(0x7fff, p + 16))};
  }
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32((int)stride));
  return {_mm512_i32gather_ps(idx, p, 4)};
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
struct V { __m256 v; };
inline V vzero() { return {_mm256_setzero_ps()}; }
inline V vset1(float x) { return {_mm256_set1_ps(x)}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x.v); }
inline __m256i vmask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V vload_partial(const float* p, int n) { return {_mm256_maskload_ps(p, vmask(n))}; }
inline void vstore_partial(float* p, V x, int n) { _mm256_maskstore_ps(p, vmask(n), x.v); }
inline V vadd(V a, V b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline V vclamp_lo(V x, float lo) { return {_mm256_max_ps(_mm256_set1_ps(lo), x.v)}; }
inline V vclamp_hi(V x, float hi) { return {_mm256_min_ps(_mm256_set1_ps(hi), x.v)}; }
inline V vleaky(V x, float alpha) {
  __m256 neg = _mm256_cmp_ps(x.v, _mm256_setzero_ps(), _CMP_LT_OQ);
  return {_mm256_blendv_ps(x.v, _mm256_mul_ps(x.v, _mm256_set1_ps(alpha)), neg)};
}
inline V vmax_nan(V a, V b) {
  const __m256 m = _mm256_max_ps(b.v, a.v);  // a when either is NaN
  return {_mm256_blendv_ps(m, b.v, _mm256_cmp_ps(b.v, b.v, _CMP_UNORD_Q))};
}
inline V vload_strided(const float* p, int64_t stride) {
  if (stride == 1) return vload(p);
  const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                         _mm256_set1_epi32((int)stride));
  return {_mm256_i32gather_ps(p, idx, 4)};
}
#else
constexpr int W = 8;
struct V { float v[W]; };
#define JTILE_LANES(expr) \
  V r;                    \
  for (int i = 0; i < W; ++i) r.v[i] = (expr); \
  return r
inline V vzero() { JTILE_LANES(0.0f); }
inline V vset1(float x) { JTILE_LANES(x); }
inline V vload(const float* p) { JTILE_LANES(p[i]); }
inline void vstore(float* p, V x) { for (int i = 0; i < W; ++i) p[i] = x.v[i]; }
inline V vload_partial(const float* p, int n) { JTILE_LANES(i < n ? p[i] : 0.0f); }
inline void vstore_partial(float* p, V x, int n) { for (int i = 0; i < n; ++i) p[i] = x.v[i]; }
inline V vadd(V a, V b) { JTILE_LANES(a.v[i] + b.v[i]); }
inline V vmul(V a, V b) { JTILE_LANES(a.v[i] * b.v[i]); }
inline V vfma(V a, V b, V c) { JTILE_LANES(a.v[i] * b.v[i] + c.v[i]); }
inline V vclamp_lo(V x, float lo) { JTILE_LANES(x.v[i] < lo ? lo : x.v[i]); }
inline V vclamp_hi(V x, float hi) { JTILE_LANES(x.v[i] > hi ? hi : x.v[i]); }
inline V vleaky(V x, float alpha) { JTILE_LANES(x.v[i] < 0.0f ? alpha * x.v[i] : x.v[i]); }
inline V vmax_nan(V a, V b) { JTILE_LANES(a.v[i] != a.v[i] || b.v[i] > a.v[i] || b.v[i] != b.v[i] ? (a.v[i] != a.v[i] ? a.v[i] : b.v[i]) : a.v[i]); }
inline V vload_strided(const float* p, int64_t stride) { JTILE_LANES(p[i * stride]); }
#undef JTILE_LANES
#endif

// ---------------------------------------------------------------------------
// Aligned scratch memory (64-byte aligned, zero-initialised).

struct FreeDeleter { void operator()(float* p) const { std::free(p); } };
using Scratch = std::unique_ptr<float[], FreeDeleter>;

inline Scratch make_scratch(int64_t count) {
  size_t bytes = ((size_t)std::max<int64_t>(count, 1) * sizeof(float) + 63) / 64 * 64;
  float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return Scratch(p);
}

// ---------------------------------------------------------------------------
// parallel_for(pool, n, fn): call fn(i) for i in [0, n) on the calling thread
// and up to pool.num_threads() - 1 pool tasks (the pool has a thread per
// core and the calling thread computes too, so no core is oversubscribed). Indices are claimed from a shared
// counter, so the result is correct whether the pool runs tasks concurrently,
// later, or inline inside Schedule. The caller waits only for indices that
// were claimed; a task that starts after all work is done touches nothing but
// the shared counters it co-owns.

namespace detail {
struct ForState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n = 0;
  void (*call)(void*, int64_t) = nullptr;
  void* fn = nullptr;

  void drain() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      call(fn, i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};
}  // namespace detail

template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F&& fn) {
  if (n <= 0) return;
  int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  auto state = std::make_shared<detail::ForState>();
  state->n = n;
  state->fn = const_cast<void*>(static_cast<const void*>(&fn));
  state->call = [](void* f, int64_t i) { (*static_cast<Fn*>(f))(i); };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->drain(); });
  state->drain();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------
// Epilogue: y = act(y + bias). Activation codes match jtile/kernels.py.

enum Activation : int64_t { kIdentity = 0, kRelu = 1, kClip = 2, kLeakyRelu = 3 };

struct Epilogue {
  int64_t kind = kIdentity;
  float alpha = 0.0f, lo = 0.0f, hi = 0.0f;

  float operator()(float x) const {
    switch (kind) {
      case kRelu: return x < 0.0f ? 0.0f : x;
      case kClip: return x < lo ? lo : (x > hi ? hi : x);
      case kLeakyRelu: return x < 0.0f ? alpha * x : x;
      default: return x;
    }
  }
  V operator()(V x) const {
    switch (kind) {
      case kRelu: return vclamp_lo(x, 0.0f);
      case kClip: return vclamp_hi(vclamp_lo(x, lo), hi);
      case kLeakyRelu: return vleaky(x, alpha);
      default: return x;
    }
  }
};

inline ffi::Error make_epilogue(int64_t kind, float alpha, float lo, float hi, Epilogue* out) {
  if (kind < kIdentity || kind > kLeakyRelu)
    return ffi::Error::InvalidArgument("jtile: unknown activation code " + std::to_string(kind));
  *out = Epilogue{kind, alpha, lo, hi};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Convolution geometry, NCHW input, OIHW weight (O, C/groups, KH, KW).
// Attribute "conv" = [stride_h, stride_w, pad_top, pad_bottom, pad_left,
// pad_right, dilation_h, dilation_w, groups].

struct ConvShape {
  int64_t n, c, h, w;          // input
  int64_t o, cg, kh, kw;       // weight: cg = input channels per group
  int64_t sh, sw, pt, pb, pl, pr, dh, dw, groups;
  int64_t oh, ow;              // output
  int64_t og() const { return o / groups; }  // output channels per group
};

// Output length of a sliding window along one axis (jtile._regions.SlidingWindow.out_size).
inline int64_t window_out(int64_t in, int64_t k, int64_t stride, int64_t lo, int64_t hi,
                          int64_t dilation = 1) {
  return (in + lo + hi - dilation * (k - 1) - 1) / stride + 1;
}

// The conv's geometry from x, the weight's (O, C/groups, KH, KW), b, the
// "conv" attribute and y, checked for consistency, and its epilogue.
inline ffi::Error decode_conv(const F32Buffer& x, const int64_t (&weight)[4], const F32Buffer& b,
                              ffi::Span<const int64_t> attr, F32Result& y, int64_t act,
                              float alpha, float lo, float hi, ConvShape* s, Epilogue* ep) {
  auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 4 || yd.size() != 4 || attr.size() != 9)
    return ffi::Error::InvalidArgument("jtile conv: expected NCHW x and y and 9 conv attributes");
  *s = ConvShape{xd[0], xd[1], xd[2], xd[3], weight[0], weight[1], weight[2], weight[3],
                 attr[0], attr[1], attr[2], attr[3], attr[4], attr[5], attr[6], attr[7], attr[8],
                 yd[2], yd[3]};
  bool ok = s->groups >= 1 && s->c == s->cg * s->groups && s->o % s->groups == 0 &&
            (int64_t)b.element_count() == s->o && yd[0] == s->n && yd[1] == s->o &&
            s->sh >= 1 && s->sw >= 1 && s->dh >= 1 && s->dw >= 1 &&
            std::min({s->pt, s->pb, s->pl, s->pr}) >= 0 &&
            s->oh == window_out(s->h, s->kh, s->sh, s->pt, s->pb, s->dh) &&
            s->ow == window_out(s->w, s->kw, s->sw, s->pl, s->pr, s->dw);
  if (!ok) return ffi::Error::InvalidArgument("jtile conv: inconsistent shapes or attributes");
  return make_epilogue(act, alpha, lo, hi, ep);
}

// The same with the weight given as an OIHW buffer.
inline ffi::Error decode_conv(const F32Buffer& x, const F32Buffer& w, const F32Buffer& b,
                              ffi::Span<const int64_t> attr, F32Result& y, int64_t act,
                              float alpha, float lo, float hi, ConvShape* s, Epilogue* ep) {
  auto wd = w.dimensions();
  if (wd.size() != 4) return ffi::Error::InvalidArgument("jtile conv: expected an OIHW w");
  const int64_t weight[4] = {wd[0], wd[1], wd[2], wd[3]};
  return decode_conv(x, weight, b, attr, y, act, alpha, lo, hi, s, ep);
}

}  // namespace jtile

// The binding every conv algorithm uses: conv(x, w, b) -> y with the conv
// geometry and the epilogue as attributes. A conv kernel file defines
//   ffi::Error Impl(ffi::ThreadPool, F32Buffer x, F32Buffer w, F32Buffer b,
//                   ffi::Span<const int64_t> conv, int64_t activation,
//                   float alpha, float clip_lo, float clip_hi, F32Result y)
// and exports it with
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(JtileConvName, Impl, JTILE_CONV_BINDING);
#define JTILE_EPILOGUE_ATTRS                                                  \
  Attr<int64_t>("activation").Attr<float>("alpha").Attr<float>("clip_lo").Attr<float>("clip_hi")
#define JTILE_CONV_BINDING                                                    \
  ::xla::ffi::Ffi::Bind()                                                     \
      .Ctx<::xla::ffi::ThreadPool>()                                          \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Attr<::xla::ffi::Span<const int64_t>>("conv")                          \
      .JTILE_EPILOGUE_ATTRS                                                   \
      .Ret<::jtile::F32Buffer>()
// The same with a fourth buffer, the residual (empty for none), and without
// the result, so that a kernel may bind more attributes before it:
//   JTILE_CONV_RESIDUAL_BINDING.Ret<::jtile::F32Buffer>()
#define JTILE_CONV_RESIDUAL_BINDING                                           \
  ::xla::ffi::Ffi::Bind()                                                     \
      .Ctx<::xla::ffi::ThreadPool>()                                          \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Attr<::xla::ffi::Span<const int64_t>>("conv")                          \
      .JTILE_EPILOGUE_ATTRS
