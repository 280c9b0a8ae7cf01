// GEMM in the BLIS arrangement: A in MR-row strips per K block (packed once up
// front, pre-packed, or read in place: channel-blocked, column-major, or a
// row-major x when C is narrow, see ROWS_IN_PLACE_STRIPS); C split into tasks
// of (M chunk x NC columns), each of which takes its KC x NC slice of B per K
// block (packed into an L2-resident buffer, pre-packed, or read in place where
// B's rows are contiguous: x of a 1x1 conv, 1.02-1.27x faster than packing it,
// most with few channels) and sweeps MR x NR micro-tiles whose accumulators
// live in registers. Bias and activation are applied when the last K block is
// stored; a transposed C is accumulated in a per-task buffer and written out
// with its epilogue at the end.
#include "gemm.h"

#include <array>
#include <utility>

#include "blocked.h"

namespace jtile {
namespace {

// The longest K block. Rotated per round in one process on the Zen 5 (20
// rounds, median ms, KC_MAX 256 / 768 / 1024 / 1536): ResNet-50 24.4 / 23.5 /
// 23.1 / 23.1, ViT-B/16 102.6 / 98.5 / 98.3 / 98.3, DenseNet-121 20.1 / 18.5
// / 16.4 / 16.7; MobileNetV3, EfficientNet-B0 and RegNet-Y within noise. Alone,
// ViT's 197 x 3072 -> 768 dense took 2170 us at 768 against 2241-2291 at 256.
#ifdef JTILE_GEMM_KC_TUNING  // for tuning experiments: JtileSetKc sets it at run time
int64_t KC_MAX = 1024;
extern "C" void JtileSetKc(int64_t kc) { KC_MAX = kc; }
#else
constexpr int64_t KC_MAX = 1024;
#endif

// The K block of a product over k: as few blocks as KC_MAX allows, of even
// length, a multiple of W (a blocked A is read a whole block of W channels at
// a time).
int64_t k_block(int64_t k) {
  const int64_t blocks = std::max<int64_t>(1, ceil_div(k, KC_MAX));
  return ceil_div(ceil_div(k, blocks), W) * W;
}
constexpr int64_t kLineFloats = 64 / sizeof(float);  // a cache line
constexpr int64_t NC_STRIPS = 8;       // most B strips per task
// A row-major A (a dense layer's x) is read in place, not packed, when C has
// at most this many B strips: packing pays off only over many. In ViT-B/16
// (3 pairs of alternating processes, each call's time relative to the
// unchanged 768 -> 3072 dense of the same run) 197 x 3072 -> 768 took
// 0.97-1.01x where packed took 1.08-1.14x, attention's P V 0.070-0.081x
// against 0.096-0.106x; 768 -> 768 level. Read in place for every width,
// 768 -> 3072 and 768 -> 2304 were level to 3% slower.
constexpr int64_t ROWS_IN_PLACE_STRIPS = 16;
constexpr int64_t MC_STRIPS = 24;      // most A strips per task

struct Tile {
  float* c;
  int64_t ldc;
  int rows, cols;                      // valid part of the MR x NR tile
  bool accumulate, last;
  const float* row_bias;               // already offset to the tile, or null
  const float* col_bias;
  const Epilogue* ep;
  const float* residual;               // at the tile, as c, or null
  int64_t vstride = W;                 // from one vector of columns to the next
};

// Stores the usual tile (one K block, full vectors) from acc, adding bias
// and residual and applying `act` with the last K block, unrolled so that
// the accumulators stay in registers: small-K layers (1x1 convs over 16
// channels) spend as long storing a tile as computing it. The sums run in
// store_any_tile's order, so the bits are the same.
template <int R, int N, typename Act>
inline void store_full_tile(const V (&acc)[R][N], const Tile& t, Act act) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < N; ++v) {
      V x = acc[r][v];
      if (t.last) {
        if (t.row_bias) x = vadd(x, vset1(t.row_bias[r]));
        if (t.col_bias) x = vadd(x, vload(t.col_bias + v * W));
        if (t.residual) x = vadd(x, vload(t.residual + r * t.ldc + v * t.vstride));
        x = act(x);
      }
      vstore(t.c + r * t.ldc + v * t.vstride, x);
    }
  }
}

// Stores an R x N-vector block of accumulators into the tile (rows < R
// and columns < t.cols; the last vector may be partial), adding what was
// there (later K blocks) and, with the last K block, bias, residual and the
// activation. Out of line: store_tile's general case.
template <int R, int N>
[[gnu::noinline]] void store_any_tile(const V (&acc)[R][N], const Tile& t) {
  // The activation is chosen once per tile, not once per vector.
  t.ep->visit([&](auto act) {
    if (!t.accumulate && t.cols == N * W) return store_full_tile<R, N>(acc, t, act);
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < N; ++v) {
        const int lanes = t.cols >= (v + 1) * W ? W : t.cols - v * W;
        float* p = t.c + r * t.ldc + v * t.vstride;
        V x = acc[r][v];
        if (t.accumulate) x = vadd(x, lanes == W ? vload(p) : vload_partial(p, lanes));
        if (t.last) {
          if (t.row_bias) x = vadd(x, vset1(t.row_bias[r]));
          if (t.col_bias)
            x = vadd(x, lanes == W ? vload(t.col_bias + v * W) : vload_partial(t.col_bias + v * W, lanes));
          if (t.residual) {
            const float* q = t.residual + r * t.ldc + v * t.vstride;
            x = vadd(x, lanes == W ? vload(q) : vload_partial(q, lanes));
          }
          x = act(x);
        }
        if (lanes == W) {
          vstore(p, x);
        } else if (t.vstride != W) {  // NCHWc: the block's padding lanes are written as zeros
          alignas(64) float padded[W] = {};
          vstore_partial(padded, x, lanes);
          vstore(p, vload(padded));
        } else {
          vstore_partial(p, x, lanes);
        }
      }
  });
}

// store_any_tile, with the usual tile under no activation or a clamp
// stored in line. Out of line, every tile's accumulators went through the
// stack (ResNet-50's 64->256 1x1 at 56x56 254 against 271 us a call;
// MobileNetV2 0.95-0.99x the time). The bits are the same.
template <int R, int N>
inline void store_tile(const V (&acc)[R][N], const Tile& t) {
  float lo = 0.0f, hi = 0.0f;
  if (!t.accumulate && t.cols == N * W && (!t.last || t.ep->as_clamp(&lo, &hi)))
    return store_full_tile<R, N>(acc, t, [lo, hi](V x) { return vclamp_hi(vclamp_lo(x, lo), hi); });
  // A copy for the call, so that the accumulators themselves never need a
  // home on the stack (the compiler zeroed one at every micro-kernel call).
  V spilled[R][N];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < N; ++v) spilled[r][v] = acc[r][v];
  store_any_tile<R, N>(spilled, t);
}

// How the micro-kernel finds A (see micro_kernel).
enum ALayout { STRIPS, BLOCKED, ROWS, A_LAYOUTS };

// acc = a_strip (kc x R, row r of k at a[k * a_step + r]: packed, a_step = MR,
// or read in place; BLOCKED, at a[k / W * a_step + r * W + k % W]; ROWS, a
// row-major A read in place, at a[r * a_step + k]) times b_strip (kc x NR), for
// the first R rows and N vectors of columns only (a tile at the edge of C
// computes just what it keeps: the last 4 of 196 columns take one vector, not
// four), stored into the tile; meanwhile `next_len` floats of packed weights
// read next (at `next`, or null: part of the next B strip, or in channel rows
// the next A strip) are fetched into L2, spread evenly over the kc steps, so
// that weights streaming from memory arrive early. Channel rows' A prefetch,
// cold caches between calls, alone: ResNet-50's 256->1024 at 14x14 0.24 against
// 0.26-0.30 ms (ORT 0.22); whole models in alternating processes, median:
// ResNet-50 19.1 against 19.5 ms, DenseNet-121 15.0 against 15.4,
// EfficientNet-B0 3.51 against 3.62.
template <int R, int N, int LAYOUT>
void micro_kernel(int64_t kc, const float* __restrict a, int64_t a_step, const float* __restrict b, int64_t bk,
                  const float* next, int64_t next_len, const Tile& t) {
  V acc[R][N];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < N; ++v) acc[r][v] = vzero();
  int64_t fetched = 0, due = 0;  // floats of `next` fetched; next_len * steps so far, against fetched * kc
  // The residual the store adds, fetched now (64->256 at 56x56 with its
  // residual: 247 against 254 us a call).
  if (t.last && t.residual != nullptr)
    for (int r = 0; r < t.rows; ++r)
      for (int v = 0; v < N; ++v) __builtin_prefetch(t.residual + r * t.ldc + v * t.vstride, 0, 3);
  for (int64_t p = 0; p < kc; ++p, b += bk) {
    if (next != nullptr)
      for (due += next_len; fetched * kc < due; fetched += kLineFloats) __builtin_prefetch(next + fetched, 0, 2);
    V bv[N];
#pragma GCC unroll 4
    for (int v = 0; v < N; ++v) bv[v] = vload(b + v * W);
    const float* ak = LAYOUT == BLOCKED ? a + p / W * a_step + p % W : LAYOUT == ROWS ? a + p : a + p * a_step;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V ar = vset1(ak[LAYOUT == BLOCKED ? r * W : LAYOUT == ROWS ? r * a_step : r]);
#pragma GCC unroll 4
      for (int v = 0; v < N; ++v) acc[r][v] = vfma(ar, bv[v], acc[r][v]);
    }
  }
  store_tile<R, N>(acc, t);
}

// KERNELS<MR, NV>[layout][rows - 1][vectors - 1]: the micro-kernel for a
// tile of that many rows and vectors of columns of the MR x NV register
// tile, A in that ALayout.
using MicroKernel = void (*)(int64_t, const float*, int64_t, const float*, int64_t, const float*, int64_t,
                             const Tile&);
template <int MR, int NV>
using KernelTable = std::array<std::array<MicroKernel, NV>, MR>;

template <int L, int NV, int R, int... N>
constexpr std::array<MicroKernel, NV> row_kernels(std::integer_sequence<int, N...>) {
  return {&micro_kernel<R, N + 1, L>...};
}

template <int L, int MR, int NV, int... R>
constexpr KernelTable<MR, NV> kernel_table(std::integer_sequence<int, R...>) {
  return {row_kernels<L, NV, R + 1>(std::make_integer_sequence<int, NV>{})...};
}

template <int MR, int NV, int... L>
constexpr std::array<KernelTable<MR, NV>, A_LAYOUTS> layout_tables(std::integer_sequence<int, L...>) {
  return {kernel_table<L, MR, NV>(std::make_integer_sequence<int, MR>{})...};
}

template <int MR, int NV>
constexpr std::array<KernelTable<MR, NV>, A_LAYOUTS> KERNELS =
    layout_tables<MR, NV>(std::make_integer_sequence<int, A_LAYOUTS>{});

// How C is cut into tasks of up to MC_STRIPS x NC_STRIPS micro-tiles: the
// cut with the shortest makespan on `workers` threads, counting a task's tiles
// plus the B strips it packs (free when B is pre-packed).
struct Grid {
  int64_t m_strips, n_strips;            // strips per task
  int64_t m_chunks, n_blocks;
};

Grid plan_grid(int64_t strips_m, int64_t strips_n, int64_t workers, bool b_packed) {
  Grid best{};
  double best_cost = 0;
  for (int64_t ms = 1; ms <= std::min(MC_STRIPS, strips_m); ++ms)
    for (int64_t ns = 1; ns <= std::min(NC_STRIPS, strips_n); ++ns) {
      const int64_t chunks = ceil_div(strips_m, ms), blocks = ceil_div(strips_n, ns);
      const double task = double(ms * ns) + (b_packed ? 0.0 : 0.3 * ns) + 0.5;
      const double cost = double(ceil_div(chunks * blocks, workers)) * task;
      if (best.m_strips == 0 || cost < best_cost) {
        best = Grid{ms, ns, chunks, blocks};
        best_cost = cost;
      }
    }
  return best;
}

// Writes a task's accumulated block (rows [i0, i0 + rows), columns [j0, j0 +
// cols), leading dimension ldb in buf) to the transposed output with its
// epilogue, W rows by W columns at a time, transposed in registers: each
// column's run of rows (consecutive pixels of one output plane) is one vector
// store. The sums run in the order of the scalar definition, buf + row bias +
// column bias + residual.
void write_transposed(const float* buf, int64_t ldb, int64_t i0, int64_t rows, int64_t j0,
                      int64_t cols, const GemmOutput& out) {
  out.ep.visit([&](auto act) {
    for (int64_t i = 0; i < rows;) {
      const int64_t row = i0 + i;
      const int n = (int)std::min<int64_t>({W, rows - i, out.block - row % out.block});  // within one block
      const int64_t at = row / out.block * out.block_stride + row % out.block;
      auto load = [n](const float* p) { return n == W ? vload(p) : vload_partial(p, n); };
      const V rb = out.row_bias ? load(out.row_bias + row) : vzero();
      for (int64_t j = 0; j < cols; j += W) {
        V r[W];
        for (int q = 0; q < W; ++q) r[q] = q < n ? vload(buf + (i + q) * ldb + j) : vzero();  // ldb: whole vectors
        transpose(r);
        for (int c = 0; c < std::min<int64_t>(W, cols - j); ++c) {
          const int64_t offset = at + (j0 + j + c) * out.ldc;
          V x = vadd(vadd(r[c], rb), out.col_bias ? vset1(out.col_bias[j0 + j + c]) : vzero());
          if (out.residual) x = vadd(x, load(out.residual + offset));
          x = act(x);
          if (n == W) vstore(out.c + offset, x); else vstore_partial(out.c + offset, x, n);
        }
      }
      i += n;
    }
  });
}

}  // namespace

// W rows by W k at a time, transposed in registers (the scalar copy wrote
// each float to its own cache line: 5 us a head of attention's K).
void Rows::pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int r, float* dst) const {
  for (int64_t s = 0; s < count; s += r, dst += kc * r)
    for (int q0 = 0; q0 < r; q0 += W) {
      const int n = std::min(W, r - q0);  // rows of this block in the strip
      for (int64_t p0 = 0; p0 < kc; p0 += W) {
        const int ks = (int)std::min<int64_t>(W, kc - p0);
        V v[W];
        for (int q = 0; q < W; ++q) {
          const float* row = a + (i0 + s + q0 + q) * lda + k0 + p0;
          v[q] = q < n && s + q0 + q < count ? (ks == W ? vload(row) : vload_partial(row, ks)) : vzero();
        }
        transpose(v);
        for (int p = 0; p < ks; ++p) {
          float* d = dst + (p0 + p) * r + q0;
          if (n == W) vstore(d, v[p]); else vstore_partial(d, v[p], n);
        }
      }
    }
}

void Columns::pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int r, float* dst) const {
  for (int64_t s = 0; s < count; s += r, dst += kc * r) {
    const int64_t cols = std::min<int64_t>(r, count - s);
    const float* src = b + k0 * ldb + i0 + s;
    for (int64_t p = 0; p < kc; ++p, src += ldb)
      for (int v = 0; v < r; v += W) {
        const int lanes = (int)std::clamp<int64_t>(cols - v, 0, std::min(W, r - v));
        const V x = lanes == W ? vload(src + v) : vload_partial(src + v, lanes);
        if (r - v >= W) vstore(dst + p * r + v, x); else vstore_partial(dst + p * r + v, x, r - v);
      }
  }
}

void NchwcRows::pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int r, float* dst) const {
  for (int64_t s = 0; s < count; s += r, dst += kc * r)
    for (int64_t p = 0; p < kc; ++p)
      for (int q = 0; q < r; ++q) {
        const int64_t i = i0 + s + q, k = k0 + p;
        dst[p * r + q] = s + q < count ? x[k / W * positions * W + i * W + k % W] : 0.0f;
      }
}

void Prepacked::pack(int64_t k0, int64_t kc, int64_t i0, int64_t count, int, float* dst) const {
  for (int64_t s = 0; s < count; s += r, dst += kc * r)
    std::memcpy(dst, p + (i0 + s) / r * k * r + k0 * r, kc * r * sizeof(float));
}

namespace {

// Where one GEMM's loops run and its scratch lives: spread over the pool
// (`run` is parallel_for), or inline on one worker of an enclosing
// parallel_for (a batched GEMM's element). Scratch slots per worker: B strips,
// transposed C block, packed A (shared by all workers of the GEMM).
struct Runner {
  virtual ~Runner() = default;
  virtual int64_t workers() const = 0;
  virtual void run(int64_t n, const std::function<void(int64_t, int)>& fn) = 0;
  virtual float* scratch(int worker, int slot, int64_t count) = 0;
  virtual float* shared_scratch(int slot, int64_t count) = 0;
};

struct PoolRunner final : Runner {
  ffi::ThreadPool& pool;
  Workspace ws;
  explicit PoolRunner(ffi::ThreadPool& pool) : pool(pool), ws(pool, 3) {}
  int64_t workers() const override { return std::max<int64_t>(1, pool.num_threads()); }
  void run(int64_t n, const std::function<void(int64_t, int)>& fn) override { parallel_for(pool, n, fn); }
  float* scratch(int worker, int slot, int64_t count) override { return ws.get(worker, slot, count); }
  float* shared_scratch(int slot, int64_t count) override { return ws.get(0, slot, count); }
};

struct InlineRunner final : Runner {
  Workspace& ws;
  int worker;
  InlineRunner(Workspace& ws, int worker) : ws(ws), worker(worker) {}
  int64_t workers() const override { return 1; }
  void run(int64_t n, const std::function<void(int64_t, int)>& fn) override {
    for (int64_t i = 0; i < n; ++i) fn(i, worker);
  }
  float* scratch(int, int slot, int64_t count) override { return ws.get(worker, slot, count); }
  float* shared_scratch(int slot, int64_t count) override { return ws.get(worker, slot, count); }
};

template <int MR, int NV>
void gemm_on(Runner& runner, int64_t m, int64_t n, int64_t k, const Operand& a, const Operand& b,
             const GemmOutput& out) {
  constexpr int NR = NV * W;
  if (m <= 0 || n <= 0) return;
  const int64_t strips_m = ceil_div(m, MR), strips_n = ceil_div(n, NR);
  const int64_t KC = k_block(k), kblocks = std::max<int64_t>(1, ceil_div(k, KC));
  // A strip s of K block starting at k0 (kc deep).
  // A pre-packed, read in place (a_step floats from one k to the next, or
  // blocked), or packed here.
  int64_t a_stride = 0, a_step = MR;
  float* a_buffer = nullptr;
  const bool a_packed = a.packed(0, 0, &a_stride) != nullptr;
  const bool a_blocked = !a_packed && a.blocked(0, 0, &a_step) != nullptr;
  const bool a_direct = !a_packed && !a_blocked && a.direct(0, 0, &a_step) != nullptr;
  const bool a_rows = !a_packed && !a_blocked && !a_direct && strips_n <= ROWS_IN_PLACE_STRIPS &&
                      a.rows(0, 0, &a_step) != nullptr;
  const ALayout a_layout = a_blocked ? BLOCKED : a_rows ? ROWS : STRIPS;
  if (!a_packed && !a_blocked && !a_direct && !a_rows) {
    a_buffer = runner.shared_scratch(2, strips_m * MR * k);
    runner.run(strips_m, [&](int64_t s, int) {
      for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = std::min(KC, k - k0);
        a.pack(k0, kc, s * MR, std::min<int64_t>(MR, m - s * MR), MR,
               a_buffer + k0 * strips_m * MR + s * kc * MR);
      }
    });
  }
  auto a_strip = [&](int64_t k0, int64_t kc, int64_t s) -> const float* {
    int64_t stride;
    if (a_packed) return a.packed(k0, s * MR, &stride);
    if (a_blocked) return a.blocked(k0, s * MR, &stride);
    if (a_direct) return a.direct(k0, s * MR, &stride);
    if (a_rows) return a.rows(k0, s * MR, &stride);
    return a_buffer + k0 * strips_m * MR + s * kc * MR;
  };

  int64_t unused;
  const Grid grid = plan_grid(strips_m, strips_n, runner.workers(),
                              b.packed(0, 0, &unused) != nullptr || b.direct(0, 0, &unused) != nullptr);
  runner.run(grid.m_chunks * grid.n_blocks, [&](int64_t task, int worker) {
    const int64_t s0 = task % grid.m_chunks * grid.m_strips;
    const int64_t s1 = std::min(strips_m, s0 + grid.m_strips);
    const int64_t n0 = task / grid.m_chunks * grid.n_strips * NR;
    const int64_t nc = std::min(grid.n_strips * NR, n - n0);
    const int64_t nc_strips = ceil_div(nc, NR);
    // Transposed output: accumulate here, rows (s - s0) * MR, columns j.
    const int64_t ldb = nc_strips * NR;
    float* cbuf = out.transposed() ? runner.scratch(worker, 1, (s1 - s0) * MR * ldb) : nullptr;
    float* bbuf = nullptr;
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const int64_t k0 = kb * KC, kc = std::min(KC, k - k0);
      int64_t b_stride = kc * NR, bk = NR;
      // B read in place (x itself in a 1x1 conv): full strips need no packing.
      const float* bd = b.direct(k0, n0, &bk);
      const float* bp = bd ? nullptr : b.packed(k0, n0, &b_stride);
      if (bd == nullptr && bp == nullptr) {
        if (bbuf == nullptr) bbuf = runner.scratch(worker, 0, KC * ldb);
        b.pack(k0, kc, n0, nc, NR, bbuf);
        bp = bbuf;
      }
      for (int64_t j = 0; j < nc_strips; ++j) {
        const int64_t col = n0 + j * NR;
        const int cols = (int)std::min<int64_t>(NR, n - col);
        const float* bj = bp ? bp + j * b_stride : bd + j * NR;
        int64_t bj_k = bp ? NR : bk;
        if (bd != nullptr && cols < NR) {  // the last, partial strip: packed, so no load runs past B
          if (bbuf == nullptr) bbuf = runner.scratch(worker, 0, KC * NR);
          b.pack(k0, kc, col, cols, NR, bbuf);
          bj = bbuf;
          bj_k = NR;
        }
        // Pre-packed B: the strip after this one, in the order this task
        // reads them, fetched a part during each of its A strips (all of it
        // during the first took, cold caches between calls, 512->2048 1x1 at
        // 7x7 252-257 against 237-239 us best; ResNet-50 in alternating
        // processes 19.25-19.56 against 18.97-19.30 ms best, 7 pairs).
        const float* next = nullptr;
        if (bp != nullptr && bp != bbuf && j + 1 < nc_strips) next = bp + (j + 1) * b_stride;
        else if (bp != nullptr && bp != bbuf && kb + 1 < kblocks) next = b.packed(k0 + KC, n0, &b_stride);
        for (int64_t s = s0; s < s1; ++s) {
          const int64_t row = s * MR;
          const int rows = (int)std::min<int64_t>(MR, m - row);
          Tile t = out.transposed()
              ? Tile{cbuf + (s - s0) * MR * ldb + j * NR, ldb, rows, cols, kb > 0, false,
                     nullptr, nullptr, &out.ep, nullptr}
              : Tile{out.c + row * out.ldc + out.column(col), out.ldc, rows, cols, kb > 0, kb == kblocks - 1,
                     out.row_bias ? out.row_bias + row : nullptr,
                     out.col_bias ? out.col_bias + col : nullptr, &out.ep,
                     out.residual ? out.residual + row * out.ldc + out.column(col) : nullptr, out.vector_stride};
          const int64_t part = ceil_div(ceil_div(kc * NR, s1 - s0), kLineFloats) * kLineFloats;
          int64_t ahead_len = std::min(part, kc * NR - (s - s0) * part);
          const float* ahead = next != nullptr && ahead_len > 0 ? next + (s - s0) * part : nullptr;
          // Otherwise, pre-packed A (weights in channel rows) on its first
          // pass: the next A strip.
          if (ahead == nullptr && a_packed && j == 0 && s + 1 < s1) ahead = a_strip(k0, kc, s + 1), ahead_len = kc * MR;
          KERNELS<MR, NV>[a_layout][rows - 1][ceil_div(cols, W) - 1](kc, a_strip(k0, kc, s), a_step, bj, bj_k,
                                                                     ahead, ahead_len, t);
        }
      }
    }
    if (out.transposed())
      write_transposed(cbuf, ldb, s0 * MR, std::min(m, s1 * MR) - s0 * MR, n0, nc, out);
  });
}

}  // namespace

void gemm(ffi::ThreadPool& pool, int64_t m, int64_t n, int64_t k, const Operand& a,
          const Operand& b, const GemmOutput& out, bool serial, GemmShape shape) {
  const auto on = shape == GemmShape::kTall ? gemm_on<GEMM_TALL_MR, GEMM_TALL_NV> : gemm_on<GEMM_MR, GEMM_NV>;
  if (!serial) {
    PoolRunner runner(pool);
    return on(runner, m, n, k, a, b, out);
  }
  Workspace ws(pool, 3);  // serial: every task on the calling thread, as worker 0 of its own workspace
  InlineRunner one(ws, 0);
  on(one, m, n, k, a, b, out);
}

void gemm_batched(ffi::ThreadPool& pool, int64_t batch, int64_t m, int64_t n, int64_t k,
                  const GemmElement& element) {
  PoolRunner runner(pool);
  if (batch < runner.workers()) {
    for (int64_t i = 0; i < batch; ++i)
      element(i, [&](const Operand& a, const Operand& b, const GemmOutput& out) {
        gemm_on<GEMM_MR, GEMM_NV>(runner, m, n, k, a, b, out);
      });
    return;
  }
  parallel_for(pool, batch, [&](int64_t i, int worker) {
    InlineRunner one(runner.ws, worker);
    element(i, [&](const Operand& a, const Operand& b, const GemmOutput& out) {
      gemm_on<GEMM_MR, GEMM_NV>(one, m, n, k, a, b, out);
    });
  });
}

}  // namespace jtile

// The GEMM's register tiles, so that Python packs weights to match: [MR, NR]
// of the wide tile, then of the tall one.
extern "C" void JtileGemmTile(int64_t* tile) {
  tile[0] = jtile::GEMM_MR;
  tile[1] = jtile::GEMM_NR;
  tile[2] = jtile::GEMM_TALL_MR;
  tile[3] = jtile::GEMM_TALL_NV * jtile::W;
}
