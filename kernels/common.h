// Shared helpers for the jtile FFI kernels: SIMD vectors, parallel-for on
// jtile's crew (as many threads as XLA's intra-op pool), fused epilogues
// (bias + activation), and the conv attribute decoding every conv algorithm
// shares.
//
// The vector width is chosen at build time: AVX-512 (16 lanes), AVX2+FMA
// (8 lanes), or a portable 8-lane struct the compiler vectorises as it can.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// JTILE_DEFINE_HANDLER(symbol, impl, binding): XLA_FFI_DEFINE_HANDLER_SYMBOL
// with the call timed while jtile.kernels.call_times records (kernels/call_times.cc).
namespace jtile::timing {
extern std::atomic<bool> enabled;
void record(const char* symbol, const XLA_FFI_CallFrame* frame, std::chrono::steady_clock::time_point start);
}  // namespace jtile::timing

#define JTILE_DEFINE_HANDLER(fn, impl, ...)                                                 \
  extern "C" XLA_FFI_Error* fn(XLA_FFI_CallFrame* call_frame) {                           \
    XLA_FFI_DEFINE_HANDLER(handler, impl, ##__VA_ARGS__);                                 \
    if (call_frame->stage != XLA_FFI_ExecutionStage_EXECUTE ||                            \
        !::jtile::timing::enabled.load(std::memory_order_relaxed))                        \
      return (*handler)(call_frame);                                                      \
    const auto start = std::chrono::steady_clock::now();                                  \
    XLA_FFI_Error* error = (*handler)(call_frame);                                        \
    ::jtile::timing::record(#fn, call_frame, start);                                      \
    return error;                                                                         \
  }

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
// The lanes whose bit is set in `lanes` from p, `fill` in the others (never read).
inline V vload_lanes(const float* p, uint32_t lanes, V fill) { return {_mm512_mask_loadu_ps(fill.v, (__mmask16)lanes, p)}; }
inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// max/min return the second operand when either is NaN: keep x second.
// (Masked forms of the same instructions: GCC 12's _mm512_max_ps and
// _mm512_min_ps warn that their own undefined operand is uninitialized where
// some loops inline them.)
inline V vclamp_lo(V x, float lo) { return {_mm512_mask_max_ps(x.v, 0xFFFF, _mm512_set1_ps(lo), x.v)}; }
inline V vclamp_hi(V x, float hi) { return {_mm512_mask_min_ps(x.v, 0xFFFF, _mm512_set1_ps(hi), x.v)}; }
inline V vleaky(V x, float alpha) {
  __mmask16 neg = _mm512_cmp_ps_mask(x.v, _mm512_setzero_ps(), _CMP_LT_OQ);
  return {_mm512_mask_mul_ps(x.v, neg, x.v, _mm512_set1_ps(alpha))};
}
// max(a, b) that is NaN when either is (jnp.maximum's rule).
inline V vmax_nan(V a, V b) {
  const __m512 m = _mm512_max_ps(b.v, a.v);  // a when either is NaN
  return {_mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(b.v, b.v, _CMP_UNORD_Q), b.v)};
}
inline V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V vdiv(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V vabs(V x) { return {_mm512_abs_ps(x.v)}; }
// Lanes where a < b (false for NaN) take `yes`, the others `no`.
inline V vselect_lt(V a, V b, V yes, V no) {
  return {_mm512_mask_mov_ps(no.v, _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ), yes.v)};
}
inline V vround(V x) { return {_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 2^n for integral n in [-126, 127].
inline V vpow2i(V n) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
inline float vfirst(V x) { return _mm512_cvtss_f32(x.v); }
// The permute index of the even lanes of two vectors (_mm512_permutex2var_ps).
inline __m512i veven_lanes() { return _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30); }
inline V vload_strided(const float* p, int64_t stride) {
  if (stride == 1) return vload(p);
  if (stride == 2) {  // even lanes of two vectors (reads one float past the last used)
    return {_mm512_permutex2var_ps(_mm512_loadu_ps(p), veven_lanes(), _mm512_maskz_loadu_ps(0x7fff, p + 16))};
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
inline V vload_lanes(const float* p, uint32_t lanes, V fill) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)lanes), bits), bits);
  return {_mm256_blendv_ps(fill.v, _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m))};
}
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
inline V vsub(V a, V b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline V vdiv(V a, V b) { return {_mm256_div_ps(a.v, b.v)}; }
inline V vabs(V x) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x.v)}; }
inline V vselect_lt(V a, V b, V yes, V no) {
  return {_mm256_blendv_ps(no.v, yes.v, _mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ))};
}
inline V vround(V x) { return {_mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V vpow2i(V n) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23))};
}
inline float vfirst(V x) { return _mm256_cvtss_f32(x.v); }
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
inline V vload_lanes(const float* p, uint32_t lanes, V fill) { JTILE_LANES(lanes >> i & 1u ? p[i] : fill.v[i]); }
inline V vadd(V a, V b) { JTILE_LANES(a.v[i] + b.v[i]); }
inline V vmul(V a, V b) { JTILE_LANES(a.v[i] * b.v[i]); }
inline V vfma(V a, V b, V c) { JTILE_LANES(a.v[i] * b.v[i] + c.v[i]); }
inline V vclamp_lo(V x, float lo) { JTILE_LANES(x.v[i] < lo ? lo : x.v[i]); }
inline V vclamp_hi(V x, float hi) { JTILE_LANES(x.v[i] > hi ? hi : x.v[i]); }
inline V vleaky(V x, float alpha) { JTILE_LANES(x.v[i] < 0.0f ? alpha * x.v[i] : x.v[i]); }
inline V vmax_nan(V a, V b) { JTILE_LANES(a.v[i] != a.v[i] || b.v[i] > a.v[i] || b.v[i] != b.v[i] ? (a.v[i] != a.v[i] ? a.v[i] : b.v[i]) : a.v[i]); }
inline V vload_strided(const float* p, int64_t stride) { JTILE_LANES(p[i * stride]); }
inline V vsub(V a, V b) { JTILE_LANES(a.v[i] - b.v[i]); }
inline V vdiv(V a, V b) { JTILE_LANES(a.v[i] / b.v[i]); }
inline V vabs(V x) { JTILE_LANES(std::fabs(x.v[i])); }
inline V vselect_lt(V a, V b, V yes, V no) { JTILE_LANES(a.v[i] < b.v[i] ? yes.v[i] : no.v[i]); }
inline V vround(V x) { JTILE_LANES(std::nearbyint(x.v[i])); }
inline V vpow2i(V n) {
  V r;
  for (int i = 0; i < W; ++i) {
    const int32_t k = n.v[i] == n.v[i] ? (int32_t)n.v[i] : 0;  // NaN: any scale keeps it NaN
    const uint32_t bits = (uint32_t)(k + 127) << 23;
    std::memcpy(&r.v[i], &bits, sizeof(float));
  }
  return r;
}
inline float vfirst(V x) { return x.v[0]; }
#undef JTILE_LANES
#endif

// Two floats as the bits of one double, to broadcast as a pair.
inline double load_pair(const float* p) {
  double pair;
  std::memcpy(&pair, p, sizeof(pair));
  return pair;
}

// Lane l is p[l % G]: G consecutive floats repeated across the vector (the
// grouped conv's broadcast when a vector holds G groups' channels).
template <int G>
inline V vbroadcast_lanes(const float* p) {
  static_assert(G >= 1 && W % G == 0, "G must divide the vector width");
  if constexpr (G == 1) return vset1(*p);
#if defined(__AVX512F__)
  else if constexpr (G == 2) return {_mm512_castpd_ps(_mm512_set1_pd(load_pair(p)))};
  else if constexpr (G == 4) return {_mm512_broadcast_f32x4(_mm_loadu_ps(p))};
  else return {_mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(p))))};
#elif defined(__AVX2__) && defined(__FMA__)
  else if constexpr (G == 2) return {_mm256_castpd_ps(_mm256_set1_pd(load_pair(p)))};
  else if constexpr (G == 4) return {_mm256_castpd_ps(_mm256_broadcast_pd(reinterpret_cast<const __m128d*>(p)))};
  else return vload(p);
#else
  else {
    V r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i % G];
    return r;
  }
#endif
}

// Lane l is x's lane idx[l].
inline V vpermute(V x, const int32_t* idx) {
#if defined(__AVX512F__)
  return {_mm512_permutexvar_ps(_mm512_loadu_si512(idx), x.v)};
#elif defined(__AVX2__) && defined(__FMA__)
  return {_mm256_permutevar8x32_ps(x.v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx)))};
#else
  V r;
  for (int i = 0; i < W; ++i) r.v[i] = x.v[idx[i]];
  return r;
#endif
}

// `n` floats at p, the vector's other lanes `fill`.
inline V vload_partial_or(const float* p, int n, float fill) {
  alignas(64) static constexpr float lane[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  static_assert(W <= 16);
  return vselect_lt(vload(lane), vset1((float)n), vload_partial(p, n), vset1(fill));
}

// x's lanes folded by `op` (a lanewise V op), in a tree of halves with AVX-512.
template <typename Op>
inline float vfold_lanes(V x, Op op) {
#if defined(__AVX512F__)
  x = op(x, V{_mm512_maskz_shuffle_f32x4(0xffff, x.v, x.v, _MM_SHUFFLE(1, 0, 3, 2))});
  x = op(x, V{_mm512_maskz_shuffle_f32x4(0xffff, x.v, x.v, _MM_SHUFFLE(2, 3, 0, 1))});
  x = op(x, V{_mm512_maskz_permute_ps(0xffff, x.v, _MM_SHUFFLE(1, 0, 3, 2))});
  return vfirst(op(x, V{_mm512_maskz_permute_ps(0xffff, x.v, _MM_SHUFFLE(2, 3, 0, 1))}));
#else
  alignas(64) float lanes[W];
  vstore(lanes, x);
  V r = vset1(lanes[0]);
  for (int i = 1; i < W; ++i) r = op(r, vset1(lanes[i]));
  return vfirst(r);
#endif
}

// dst[e] = src[e * stride] for e < count.
inline void copy_strided(float* dst, const float* src, int64_t count, int64_t stride) {
  int64_t e = 0;
  for (; e + W <= count; e += W) vstore(dst + e, vload_strided(src + e * stride, stride));
  for (; e < count; ++e) dst[e] = src[e * stride];
}

// The sum of x's lanes.
inline float vsum_lanes(V x) { return vfold_lanes(x, vadd); }

// The largest of x's lanes, NaN if one is NaN.
inline float vmax_lanes(V x) { return vfold_lanes(x, vmax_nan); }

// ---------------------------------------------------------------------------
// parallel_for(pool, n, fn): call fn(i) (or fn(i, worker)) for i in [0, n) on
// the calling thread (worker 0) and up to pool.num_threads() - 1 helpers
// (workers 1, 2, ...: the threads of jtile's crew, kernels/crew.cc, one per
// core beside the caller's, as XLA's pool has). No two calls with the same
// worker run at once, so a worker may own buffers (see Workspace). Indices are
// claimed from shared counters, so the result is correct whether a helper
// joins at once, late, or never. The caller waits only for indices that were
// claimed; a helper that starts after all work is done touches nothing but
// the shared counters it co-owns.

inline int workers(ffi::ThreadPool& pool) { return (int)std::max<int64_t>(1, pool.num_threads()); }

namespace detail {
// Indices are claimed in guided chunks (a 2 * parties-th of what is left, at
// least one): a kernel of many tiny tasks (a global pool over 1280 planes of
// 7x7) pays for a few dozen contended atomics instead of two per index, and
// the last chunks stay small enough to balance uneven tasks. The caller
// claims from the front, helpers from the back, so on two cores each keeps
// its end of the index range from call to call, and a layer's tasks tend to
// read what the same core wrote (on a 2-core Xeon, in alternating rounds of
// one process, each model's median ratio to ONNX Runtime against one shared
// front: SqueezeNet 0.892 against 0.870, MobileNetV2 0.939 against 0.917,
// DeepLabV3 0.917 against 0.887, ResNet-50 0.937 against 0.915,
// MobileNetV3 and EfficientNet-B0 +0.01). The range lives in one word, its
// front in the low half, so a claim is one compare-exchange.
struct ForState {
  static constexpr int64_t kMaxIndices = int64_t(1) << 31;  // parallel_for splits longer ranges
  std::atomic<uint64_t> range{0};
  std::atomic<int64_t> done{0};
  int64_t parties = 1;
  void (*call)(void*, int64_t, int) = nullptr;
  void* fn = nullptr;

  void start(int64_t n) { range.store(uint64_t(n) << 32, std::memory_order_relaxed); }

  void drain(int worker) {
    const bool from_back = worker > 0;
    for (uint64_t r = range.load(std::memory_order_relaxed);;) {
      const int64_t front = int64_t(uint32_t(r)), back = int64_t(r >> 32);
      if (front >= back) return;
      const int64_t take = std::max<int64_t>(1, (back - front) / (2 * parties));
      const int64_t first = from_back ? back - take : front;
      const uint64_t rest = from_back ? uint64_t(first) << 32 | uint64_t(front) : uint64_t(back) << 32 | uint64_t(front + take);
      if (!range.compare_exchange_weak(r, rest, std::memory_order_relaxed)) continue;
      for (int64_t i = first; i < first + take; ++i) call(fn, i, worker);
      done.fetch_add(take, std::memory_order_release);
      r = range.load(std::memory_order_relaxed);
    }
  }
};

// Has crew member i (1..helpers) drain `state` as worker i (kernels/crew.cc).
void crew_offer(const std::shared_ptr<ForState>& state, int helpers);
}  // namespace detail

template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F&& fn) {
  if (n <= 0) return;
  int64_t base = 0;  // of the section running: ForState counts at most kMaxIndices
  auto invoke = [&fn, &base](int64_t i, int worker) {
    if constexpr (std::is_invocable_v<F&, int64_t, int>) fn(base + i, worker);
    else fn(base + i);
  };
  const int helpers = (int)std::min<int64_t>(workers(pool) - 1, n - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) invoke(i, 0);
    return;
  }
  using Invoke = decltype(invoke);
  for (; base < n; base += detail::ForState::kMaxIndices) {
    const int64_t count = std::min(n - base, detail::ForState::kMaxIndices);
    auto state = std::make_shared<detail::ForState>();
    state->start(count);
    state->parties = helpers + 1;
    state->fn = &invoke;
    state->call = [](void* f, int64_t i, int worker) { (*static_cast<Invoke*>(f))(i, worker); };
    detail::crew_offer(state, helpers);
    state->drain(0);
    while (state->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
  }
}

// ---------------------------------------------------------------------------
// Scratch memory, taken per call and released when the call returns:
// `make_scratch(count)` for one zeroed buffer, a `Workspace` for buffers owned
// by the workers of parallel_for. Blocks come from a process-wide cache of
// released blocks that keeps at most kScratchKeepBytes; a block released
// beyond that goes back to the system at once (blocks of kMapBytes or more
// are mmap'd, so that really shrinks the process). Memory held between calls
// is thus bounded whatever the layer or batch, and small layers, whose blocks
// stay cached, do not pay for fresh pages on every call. Under
// AddressSanitizer nothing is cached and every block is malloc'd at its exact
// size, so ASan sees each buffer's bounds.

#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kScratchKeepBytes = 0;
#else
constexpr size_t kScratchKeepBytes = size_t(32) << 20;  // benchmarks/bench_memory.py says 32 MB
#endif

namespace detail {
class BlockCache {
 public:
  static constexpr size_t kMapBytes = size_t(256) << 10;

  // A 64-byte aligned block of at least `bytes`; *size is its size, *zero
  // whether it is known to hold zeros (fresh pages).
  void* acquire(size_t bytes, size_t* size, bool* zero) {
    bytes = std::max<size_t>(64, (bytes + 63) / 64 * 64);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i)  // the smallest block that fits, at most twice the size
        if (free_[i].size >= bytes && free_[i].size <= 2 * bytes &&
            (best == free_.size() || free_[i].size < free_[best].size))
          best = i;
      if (best != free_.size()) {
        const Block b = free_[best];
        free_[best] = free_.back();
        free_.pop_back();
        kept_ -= b.size;
        *size = b.size, *zero = false;
        return b.p;
      }
    }
    void* p = nullptr;
    if (bytes >= kMapBytes && kScratchKeepBytes > 0) {
      bytes = (bytes + 4095) / 4096 * 4096;
      p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      *zero = true;
    } else {
      p = std::aligned_alloc(64, bytes);
      if (p == nullptr) throw std::bad_alloc();
      *zero = false;
    }
    *size = bytes;
    return p;
  }

  void release(void* p, size_t size) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_ + size <= kScratchKeepBytes) {
        free_.push_back(Block{p, size});
        kept_ += size;
        return;
      }
    }
    if (size >= kMapBytes && kScratchKeepBytes > 0) munmap(p, size);
    else std::free(p);
  }

 private:
  struct Block { void* p; size_t size; };
  std::mutex mutex_;
  std::vector<Block> free_;
  size_t kept_ = 0;
};

// Never destroyed: a pool thread may still release a block while the process exits.
inline BlockCache& block_cache() {
  static BlockCache* cache = new BlockCache;
  return *cache;
}
}  // namespace detail

// A float buffer from the cache, returned to it when destroyed.
class Scratch {
 public:
  Scratch() = default;
  Scratch(int64_t count, bool zero) {
    const size_t bytes = (size_t)std::max<int64_t>(count, 1) * sizeof(float);
    bool is_zero;
    p_ = static_cast<float*>(detail::block_cache().acquire(bytes, &size_, &is_zero));
    if (zero && !is_zero) std::memset(p_, 0, bytes);
  }
  Scratch(Scratch&& o) noexcept : p_(std::exchange(o.p_, nullptr)), size_(o.size_) {}
  Scratch& operator=(Scratch&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~Scratch() { if (p_) detail::block_cache().release(p_, size_); }
  float* get() const { return p_; }
  float& operator[](int64_t i) const { return p_[i]; }
  int64_t capacity() const { return p_ ? int64_t(size_ / sizeof(float)) : 0; }

 private:
  float* p_ = nullptr;
  size_t size_ = 0;
};

// `count` zeroed floats (64-byte aligned) for the rest of the call.
inline Scratch make_scratch(int64_t count) { return Scratch(count, true); }

// Buffers of one kernel call: `slots` per worker of parallel_for, each grown
// on demand (contents are kept while it does not grow) and all released when
// the Workspace is destroyed.
class Workspace {
 public:
  Workspace(ffi::ThreadPool& pool, int slots) : slots_(slots), bufs_((size_t)workers(pool) * slots) {}
  // Room for `count` floats in buffer `slot` of `worker`, zeroed if `zero`.
  float* get(int worker, int slot, int64_t count, bool zero = false) {
    Scratch& b = bufs_[(size_t)worker * slots_ + slot];
    if (b.capacity() < count) b = Scratch(count, zero);
    else if (zero) std::memset(b.get(), 0, (size_t)count * sizeof(float));
    return b.get();
  }

 private:
  int slots_;
  std::vector<Scratch> bufs_;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------
// Transcendental activations on vectors, written once over the V operations
// above. NaN stays NaN, +-Inf gives the limits jnp gives (sigmoid(-Inf) = 0
// exactly, so silu(-Inf) = -Inf * 0 = NaN as in x * jax.nn.sigmoid(x)).

// exp(z) for z <= 0: Cephes' expf (z = n ln2 + r with |r| <= ln2 / 2, a
// degree-6 polynomial for exp(r), times 2^n), flushed to 0 below -87.34 where
// exp(z) is subnormal. About 1 ulp.
inline V vexp_nonpositive(V z) {
  const float lowest = -87.33654f;  // log of the smallest normal float
  const V zc = vclamp_lo(z, lowest);
  const V n = vround(vmul(zc, vset1(1.44269504088896341f)));
  V r = vfma(n, vset1(-0.693359375f), zc);
  r = vfma(n, vset1(2.12194440e-4f), r);
  V p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vselect_lt(z, vset1(lowest), vzero(), vmul(p, vpow2i(n)));
}

// 1 / (1 + exp(-x)) as (x < 0 ? e : 1) / (1 + e) with e = exp(-|x|) <= 1: no overflow.
inline V vsigmoid(V x) {
  const V e = vexp_nonpositive(vsub(vzero(), vabs(x)));
  const V one = vset1(1.0f);
  return vdiv(vselect_lt(x, vzero(), e, one), vadd(one, e));
}

// x * Phi(x), Phi the normal CDF = (1 + erf(x / sqrt 2)) / 2, with erf from
// Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): for a = |x| / sqrt 2,
// q = 1 - erf(a) = t (a1 + t (a2 + ...)) exp(-a^2), t = 1 / (1 + p a), and
// Phi(x) = q / 2 for x < 0, 1 - q / 2 otherwise.
inline V vgelu(V x) {
  const V a = vmul(vabs(x), vset1(0.70710678118654752f));
  const V t = vdiv(vset1(1.0f), vfma(a, vset1(0.3275911f), vset1(1.0f)));
  V poly = vset1(1.061405429f);
  poly = vfma(poly, t, vset1(-1.453152027f));
  poly = vfma(poly, t, vset1(1.421413741f));
  poly = vfma(poly, t, vset1(-0.284496736f));
  poly = vfma(poly, t, vset1(0.254829592f));
  const V half_q = vmul(vmul(poly, t), vmul(vset1(0.5f), vexp_nonpositive(vsub(vzero(), vmul(a, a)))));
  return vmul(x, vselect_lt(x, vzero(), half_q, vsub(vset1(1.0f), half_q)));
}

// ---------------------------------------------------------------------------
// Epilogue: y = act(y + bias). Activation codes match jtile/kernels.py. The
// hard ones take a slope and an offset: hard_sigmoid(x) = clip(alpha x + beta,
// 0, 1), hard_swish(x) = x hard_sigmoid(x), with beta passed as `lo`.

enum Activation : int64_t {
  kIdentity = 0, kRelu = 1, kClip = 2, kLeakyRelu = 3, kSigmoid = 4, kSilu = 5,
  kHardSigmoid = 6, kHardSwish = 7, kGelu = 8, kGeluTanh = 9,
  kScale = 10,  // alpha x: not an activation code, the matmul's "scale" (attention's 1 / sqrt(d))
};

struct Epilogue {
  int64_t kind = kIdentity;
  float alpha = 0.0f, lo = 0.0f, hi = 0.0f;

  float operator()(float x) const {
    switch (kind) {
      case kIdentity: return x;
      case kRelu: return x < 0.0f ? 0.0f : x;
      case kClip: return x < lo ? lo : (x > hi ? hi : x);
      case kLeakyRelu: return x < 0.0f ? alpha * x : x;
      case kHardSigmoid: return hard_sigmoid(x);
      case kHardSwish: return x * hard_sigmoid(x);
      default: return vfirst((*this)(vset1(x)));  // the vector path's bits, whichever path a value takes
    }
  }
  V operator()(V x) const {
    switch (kind) {
      case kRelu: return vclamp_lo(x, 0.0f);
      case kClip: return vclamp_hi(vclamp_lo(x, lo), hi);
      case kLeakyRelu: return vleaky(x, alpha);
      case kSigmoid: return vsigmoid(x);
      case kSilu: return vmul(x, vsigmoid(x));
      case kHardSigmoid: return hard_sigmoid(x);
      case kHardSwish: return vmul(x, hard_sigmoid(x));
      case kGelu: return vgelu(x);
      case kGeluTanh:  // x (1 + tanh(u)) / 2 = x sigmoid(2 u), u = sqrt(2/pi) (x + 0.044715 x^3)
        return vmul(x, vsigmoid(vmul(x, vfma(vmul(x, x), vset1(0.0713548162726f), vset1(1.5957691216057f)))));
      case kScale: return vmul(x, vset1(alpha));
      default: return x;
    }
  }

  // Identity, ReLU and clip as one clamp to [*lo_out, *hi_out], with the
  // bits of their own paths (a NaN stays: vclamp_lo and vclamp_hi return x
  // when a comparison with it fails); false for the other kinds.
  bool as_clamp(float* lo_out, float* hi_out) const {
    constexpr float inf = std::numeric_limits<float>::infinity();
    if (kind != kIdentity && kind != kRelu && kind != kClip) return false;
    *lo_out = kind == kIdentity ? -inf : kind == kRelu ? 0.0f : lo;
    *hi_out = kind == kClip ? hi : inf;
    return true;
  }

  // f(act) with act a callable V -> V equal to (*this) on vectors, resolved
  // at compile time for the common kinds, so that a loop over a tile does not
  // branch on the kind at every vector.
  template <typename F>
  void visit(F&& f) const {
    switch (kind) {
      case kIdentity: return f([](V x) { return x; });
      case kRelu: return f([](V x) { return vclamp_lo(x, 0.0f); });
      case kClip: return f([lo = lo, hi = hi](V x) { return vclamp_hi(vclamp_lo(x, lo), hi); });
      case kHardSwish: return f([this](V x) { return vmul(x, hard_sigmoid(x)); });
      case kSilu: return f([](V x) { return vmul(x, vsigmoid(x)); });
      default: return f([this](V x) { return (*this)(x); });
    }
  }

 private:
  V hard_sigmoid(V x) const { return vclamp_hi(vclamp_lo(vfma(x, vset1(alpha), vset1(lo)), 0.0f), 1.0f); }
  float hard_sigmoid(float x) const {  // the same bits: one rounding in the fma, NaN kept by the clamps
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    const float t = std::fma(x, alpha, lo);
#else
    const float t = x * alpha + lo;  // as the portable vfma
#endif
    return t < 0.0f ? 0.0f : (t > 1.0f ? 1.0f : t);
  }
};

inline ffi::Error make_epilogue(int64_t kind, float alpha, float lo, float hi, Epilogue* out) {
  if (kind < kIdentity || kind > kGeluTanh)
    return ffi::Error::InvalidArgument("jtile: unknown activation code " + std::to_string(kind));
  *out = Epilogue{kind, alpha, lo, hi};
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Convolution geometry, NCHW input, OIHW weight (O, C/groups, KH, KW).
// Attribute "conv" = [stride_h, stride_w, pad_top, pad_bottom, pad_left,
// pad_right, dilation_h, dilation_w, groups].

// Whether x and y are channel-blocked, NCHWc: (N, ceil(C / W), H, W_img, W),
// the W channels of one position in one vector, as ONNX Runtime's NCHWc
// layout with its block the kernels' vector width (the last block's lanes past
// C are padding, which no real channel's result reads). Otherwise NCHW.
struct Layouts {
  bool x = false, y = false;
};

// The NCHW dimensions of a buffer in either layout (NCHWc: its padded
// channels), false if it has neither's rank.
inline bool nchw_dims(ffi::Span<const int64_t> d, bool nchwc, int64_t (&out)[4]) {
  if (d.size() != (nchwc ? 5u : 4u) || (nchwc && d[4] != W)) return false;
  out[0] = d[0], out[1] = nchwc ? d[1] * W : d[1], out[2] = d[2], out[3] = d[3];
  return true;
}

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

// A max pool over a conv's activated output, fused into the conv: attribute
// "max_pool" = [kh, kw, sh, sw, pad_top, pad_bottom, pad_left, pad_right] as
// the pool kernels' "pool", or empty for none. Padding counts as -inf.
struct FusedPool {
  int64_t kh = 0, kw = 0, sh = 1, sw = 1, pt = 0, pb = 0, pl = 0, pr = 0;
  bool active() const { return kh > 0; }
  int64_t out_h(int64_t h) const { return active() ? window_out(h, kh, sh, pt, pb) : h; }
  int64_t out_w(int64_t w) const { return active() ? window_out(w, kw, sw, pl, pr) : w; }
};

inline ffi::Error decode_fused_pool(ffi::Span<const int64_t> a, FusedPool* p) {
  if (a.size() == 0) return ffi::Error::Success();
  if (a.size() != 8 || std::min({a[0], a[1], a[2], a[3]}) < 1 || std::min({a[4], a[5], a[6], a[7]}) < 0)
    return ffi::Error::InvalidArgument("jtile conv: max_pool must be empty or [kh, kw, sh, sw, pt, pb, pl, pr] "
                                       "with windows and strides >= 1 and padding >= 0");
  *p = FusedPool{a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]};
  return ffi::Error::Success();
}

// A per-channel bias of n floats: b itself, or b's one float repeated (a
// constant bias comes as one float: XLA turns a constant of n equal floats
// into a broadcast op that runs before the kernels on every call, 90-140 us
// of thread wake-ups at MobileNetV3's start).
class Bias {
 public:
  Bias(const F32Buffer& b, int64_t n) {
    if ((int64_t)b.element_count() == n) {
      p_ = b.typed_data();
    } else if (b.element_count() == 1) {
      repeated_.assign(n, b.typed_data()[0]);
      p_ = repeated_.data();
    }
  }
  static bool fits(const F32Buffer& b, int64_t n) { return (int64_t)b.element_count() == n || b.element_count() == 1; }
  const float* data() const { return p_; }

 private:
  const float* p_ = nullptr;
  std::vector<float> repeated_;
};

// One per-channel operand of a prologue, act((x - shift) * scale + bias):
// C floats, one for every channel (a constant, as for Bias), or none (the
// step's identity).
class ChannelValues {
 public:
  ChannelValues(const F32Buffer& v, float identity)
      : p_(v.element_count() > 0 ? v.typed_data() : nullptr), step_(v.element_count() > 1), identity_(identity) {}
  static bool fits(const F32Buffer& v, int64_t c) {
    return v.element_count() <= 1 || (int64_t)v.element_count() == c;
  }
  bool given() const { return p_ != nullptr; }
  float operator[](int64_t c) const { return p_ ? p_[c * step_] : identity_; }

 private:
  const float* p_;
  int64_t step_;
  float identity_;
};

// The conv's geometry from x, the weight's (O, C/groups, KH, KW), b (O floats,
// or one: see Bias) and the
// "conv" attribute, checked against y (the conv's output, or with an active
// `pool` the pooled output), and its epilogue. With channel0 >= 0 the conv
// writes channels [channel0, channel0 + O) of a larger y of one image (a
// concatenation's buffer; see conv_output). With x_channels >= 0 the conv
// reads the first x_channels channels of an x of one image that may hold more
// (a concatenation's buffer that later parts extend). With `crops`, padding
// may be negative: the conv reads a window of x that starts or ends inside it.
inline ffi::Error decode_conv(ffi::Span<const int64_t> x_dims, const int64_t (&weight)[4], const F32Buffer& b,
                              ffi::Span<const int64_t> attr, F32Result& y, int64_t act,
                              float alpha, float lo, float hi, ConvShape* s, Epilogue* ep,
                              int64_t channel0 = -1, const FusedPool& pool = {}, int64_t x_channels = -1,
                              Layouts layouts = {}, bool crops = false) {
  int64_t xd[4], yd[4];
  if (!nchw_dims(x_dims, layouts.x, xd) || !nchw_dims(y->dimensions(), layouts.y, yd) || attr.size() != 9)
    return ffi::Error::InvalidArgument("jtile conv: expected x and y NCHW (or NCHWc where asked) and 9 conv attributes");
  // An NCHWc x holds C rounded up to whole blocks: C is what the weight reads.
  const int64_t c = x_channels >= 0 ? x_channels : layouts.x ? weight[1] * attr[8] : xd[1];
  *s = ConvShape{xd[0], c, xd[2], xd[3], weight[0], weight[1], weight[2], weight[3],
                 attr[0], attr[1], attr[2], attr[3], attr[4], attr[5], attr[6], attr[7], attr[8], 0, 0};
  const int64_t y_channels = layouts.y ? ceil_div(s->o, W) * W : s->o;
  bool ok = (layouts.x ? ceil_div(c, W) * W == xd[1] : c == xd[1] || (c < xd[1] && xd[0] == 1)) &&
            s->groups >= 1 && s->c == s->cg * s->groups && s->o % s->groups == 0 &&
            Bias::fits(b, s->o) && yd[0] == s->n &&
            (channel0 < 0 ? yd[1] == y_channels : s->n == 1 && channel0 + s->o <= yd[1] && !pool.active()) &&
            s->sh >= 1 && s->sw >= 1 && s->dh >= 1 && s->dw >= 1 &&
            (crops || std::min({s->pt, s->pb, s->pl, s->pr}) >= 0);
  if (ok) {
    s->oh = window_out(s->h, s->kh, s->sh, s->pt, s->pb, s->dh);
    s->ow = window_out(s->w, s->kw, s->sw, s->pl, s->pr, s->dw);
    ok = s->oh >= 0 && s->ow >= 0 && yd[2] == pool.out_h(s->oh) && yd[3] == pool.out_w(s->ow);
  }
  if (!ok) return ffi::Error::InvalidArgument("jtile conv: inconsistent shapes or attributes");
  return make_epilogue(act, alpha, lo, hi, ep);
}

// The same with the weight given as an OIHW buffer.
inline ffi::Error decode_conv(const F32Buffer& x, const F32Buffer& w, const F32Buffer& b,
                              ffi::Span<const int64_t> attr, F32Result& y, int64_t act,
                              float alpha, float lo, float hi, ConvShape* s, Epilogue* ep,
                              int64_t channel0 = -1, Layouts layouts = {}) {
  auto wd = w.dimensions();
  if (wd.size() != 4) return ffi::Error::InvalidArgument("jtile conv: expected an OIHW w");
  const int64_t weight[4] = {wd[0], wd[1], wd[2], wd[3]};
  return decode_conv(x.dimensions(), weight, b, attr, y, act, alpha, lo, hi, s, ep, channel0, {}, -1, layouts);
}

// Where the conv's own (N, O, OH, OW) output starts in y: y itself, or, in a
// concatenation's buffer (channel0 >= 0, one image), its channel channel0. The
// rest of such a buffer is left as it is: the other parts of the
// concatenation write it (the call's y aliases the buffer they wrote).
inline float* conv_output(const ConvShape& s, F32Result& y, int64_t channel0) {
  return y->typed_data() + std::max<int64_t>(channel0, 0) * s.oh * s.ow;
}
inline int64_t conv_output_size(const ConvShape& s) { return s.n * s.o * s.oh * s.ow; }

// A conv whose weight comes packed in the kernel's own layout: the OIHW
// geometry is `kernel` ([O, KH, KW]) with C / groups input channels a group,
// C the first x_channels of x's (all of them if negative; see decode_conv).
inline ffi::Error decode_packed_conv(const char* name, const F32Buffer& x, ffi::Span<const int64_t> kernel,
                                     const F32Buffer& b, ffi::Span<const int64_t> attr, F32Result& y,
                                     int64_t act, float alpha, float lo, float hi, ConvShape* s, Epilogue* ep,
                                     int64_t channel0 = -1, const FusedPool& pool = {}, int64_t x_channels = -1,
                                     Layouts layouts = {}, bool crops = false) {
  int64_t xd[4];
  if (!nchw_dims(x.dimensions(), layouts.x, xd) || attr.size() != 9 || attr[8] < 1 || kernel.size() != 3)
    return ffi::Error::InvalidArgument(std::string("jtile ") + name +
                                       ": expected NCHW (or NCHWc) x, 9 conv attributes (groups >= 1) and [O, KH, KW]");
  const int64_t weight[4] = {kernel[0], (x_channels < 0 ? xd[1] : x_channels) / attr[8], kernel[1], kernel[2]};
  return decode_conv(x.dimensions(), weight, b, attr, y, act, alpha, lo, hi, s, ep, channel0, pool, x_channels,
                     layouts, crops);
}

}  // namespace jtile

// The binding every conv algorithm uses: conv(x, w, b) -> y with the conv
// geometry and the epilogue as attributes (JTILE_CONV_ARGS without the result,
// for a kernel that binds more attributes). A conv kernel file defines
//   ffi::Error Impl(ffi::ThreadPool, F32Buffer x, F32Buffer w, F32Buffer b,
//                   ffi::Span<const int64_t> conv, int64_t activation,
//                   float alpha, float clip_lo, float clip_hi, F32Result y)
// and exports it with
//   JTILE_DEFINE_HANDLER(JtileConvName, Impl, JTILE_CONV_BINDING);
#define JTILE_EPILOGUE_ATTRS                                                  \
  Attr<int64_t>("activation").Attr<float>("alpha").Attr<float>("clip_lo").Attr<float>("clip_hi")
#define JTILE_CONV_ARGS                                                       \
  ::xla::ffi::Ffi::Bind()                                                     \
      .Ctx<::xla::ffi::ThreadPool>()                                          \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Attr<::xla::ffi::Span<const int64_t>>("conv")                          \
      .JTILE_EPILOGUE_ATTRS
#define JTILE_CONV_BINDING JTILE_CONV_ARGS.Ret<::jtile::F32Buffer>()
// The same with a fourth buffer, the residual (empty for none), a fifth, the
// concatenation buffer the result aliases (empty for none; its contents are
// not read), the "channel0" attribute (-1, or where in that buffer the conv's
// channels go: see conv_output), and without the result, so that a kernel may
// bind more attributes before it:
//   JTILE_CONV_RESIDUAL_BINDING.Ret<::jtile::F32Buffer>()
#define JTILE_CONV_RESIDUAL_BINDING                                           \
  ::xla::ffi::Ffi::Bind()                                                     \
      .Ctx<::xla::ffi::ThreadPool>()                                          \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Arg<::jtile::F32Buffer>()                                              \
      .Attr<::xla::ffi::Span<const int64_t>>("conv")                          \
      .JTILE_EPILOGUE_ATTRS                                                   \
      .Attr<int64_t>("channel0")
