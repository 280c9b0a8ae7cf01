// Winograd F(4x4, 3x3) convolution: 3x3 kernel, stride 1, dilation 1,
// groups 1, any padding, any batch, NCHW input, OIHW weight.
//
// Each 4x4 output tile is computed from a 6x6 input tile as
//   Y = A^T [ (G g G^T) . (B^T d B) ] A,
// so the 3x3 * Ci * Co multiply-adds of a tile become 36 independent GEMMs
// (Co x Ci) by (Ci x tiles) in the transformed domain: 4x fewer multiplies
// than direct convolution. Tiles are numbered over (batch, tile row, tile
// column) and processed in blocks of up to 3 W "slots"; the transforms work on
// W tiles at once (one vector lane per tile), and the GEMM micro-kernel keeps
// 8 output channels by up to 3 vectors of tiles (or 24 channels by 1 vector)
// of results in registers.
//
// Two ways to split the work over threads:
// - many tile blocks (large images): the weights are transformed once, then
//   each task takes one block through input transform, GEMMs and output
//   transform while it is in cache;
// - few tile blocks (small images, usually many channels): the input of all
//   blocks is transformed first, then each task owns 24 output channels and
//   transforms their weights 64 input channels at a time, so the transformed
//   weights (36x the size of the block they come from) never leave the cache.
//
// The transformed weights are not cached between calls (a pointer is no
// identity for weight values). Scratch memory is taken per call from the
// bounded cache of common.h and released when the call returns.
//
// Numerics: the transforms scale values by up to ~100 (B and A have entries
// 4, 5 and 8), so float32 rounding errors are about 1e-5 relative to the
// output's magnitude rather than to each element (see jtile/kernels.py).
// Non-finite values: a NaN or Inf anywhere in a tile's 6x6 input window (or
// in the weights) makes some of the tile's transformed outputs non-finite, and
// the transforms would spread it over the whole 4x4 tile. So the output
// transform checks each tile of each output channel (one add per output, one
// multiply per tile: the sum times zero is NaN exactly when a value is not
// finite, or the sum overflowed) and recomputes a flagged tile directly, taps
// over padding included, as lax.conv_general_dilated does: Inf, NaN and their
// signs come out where XLA's convolution has them.
#include "common.h"

namespace jtile {
namespace {

constexpr int kPos = 36;    // 6x6 transformed positions
constexpr int kMR = 8;      // output channels per GEMM row panel
constexpr int kMaxNV = 3;   // slot vectors per GEMM micro-kernel call
constexpr int64_t kBlock = kMaxNV * W;  // most slots per tile block, where there are several

// B^T d: six values -> six values (also used for the rows, as (B^T d) B).
inline void input_1d(const V d[6], V v[6]) {
  const V m4 = vset1(-4.0f), m5 = vset1(-5.0f), p4 = vset1(4.0f), two = vset1(2.0f);
  V t0 = vfma(m4, d[2], d[4]), t1 = vfma(m4, d[1], d[3]);
  V t2 = vsub(d[4], d[2]), t3 = vmul(two, vsub(d[3], d[1]));
  v[0] = vfma(p4, d[0], vfma(m5, d[2], d[4]));
  v[1] = vadd(t0, t1);
  v[2] = vsub(t0, t1);
  v[3] = vadd(t2, t3);
  v[4] = vsub(t2, t3);
  v[5] = vfma(p4, d[1], vfma(m5, d[3], d[5]));
}

// A^T m: six values -> four values.
inline void output_1d(const V m[6], V y[4]) {
  V a = vadd(m[1], m[2]), b = vsub(m[1], m[2]), c = vadd(m[3], m[4]), d = vsub(m[3], m[4]);
  y[0] = vadd(vadd(m[0], a), c);
  y[1] = vfma(vset1(2.0f), d, b);
  y[2] = vfma(vset1(4.0f), c, a);
  y[3] = vadd(vfma(vset1(8.0f), d, b), m[5]);
}

// d[j] lane t = p[4 t + j], j = 0..5: the six columns of W consecutive tiles
// read from a row that holds 4 W + 2 (+ slack) values.
inline void deinterleave6(const float* p, V d[6]) {
#if defined(__AVX512F__)
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 a0 = _mm512_loadu_ps(p), a1 = _mm512_loadu_ps(p + 16), a2 = _mm512_loadu_ps(p + 32),
         a3 = _mm512_loadu_ps(p + 48);
  for (int j = 0; j < 4; ++j) {
    __m512i ij = _mm512_add_epi32(idx, _mm512_set1_epi32(j));
    __m512 lo = _mm512_permutex2var_ps(a0, ij, a1), hi = _mm512_permutex2var_ps(a2, ij, a3);
    d[j].v = _mm512_shuffle_f32x4(lo, hi, 0x44);
  }
  d[4].v = _mm512_castsi512_ps(_mm512_alignr_epi32(
      _mm512_castps_si512(_mm512_loadu_ps(p + 64)), _mm512_castps_si512(d[0].v), 1));
  d[5].v = _mm512_castsi512_ps(_mm512_alignr_epi32(
      _mm512_castps_si512(_mm512_loadu_ps(p + 65)), _mm512_castps_si512(d[1].v), 1));
#else
  alignas(64) float t[6][W];
  for (int j = 0; j < 6; ++j)
    for (int l = 0; l < W; ++l) t[j][l] = p[4 * l + j];
  for (int j = 0; j < 6; ++j) d[j] = vload(t[j]);
#endif
}

// Inverse of the first four phases: p[4 t + j] = ep(o[j] lane t + res[4 t + j]),
// `count` of the 4 W values (res may be null).
inline void store_interleaved4(const V o[4], float* p, int64_t count, const Epilogue& ep,
                               const float* res) {
#if defined(__AVX512F__)
  alignas(64) static const int pair_lo[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static const int quad0[16] = {0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23};
  const __m512i lo = _mm512_load_si512(pair_lo), hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  const __m512i q0 = _mm512_load_si512(quad0), q1 = _mm512_add_epi32(q0, _mm512_set1_epi32(8));
  __m512 ab_lo = _mm512_permutex2var_ps(o[0].v, lo, o[1].v);
  __m512 ab_hi = _mm512_permutex2var_ps(o[0].v, hi, o[1].v);
  __m512 cd_lo = _mm512_permutex2var_ps(o[2].v, lo, o[3].v);
  __m512 cd_hi = _mm512_permutex2var_ps(o[2].v, hi, o[3].v);
  V z[4] = {{_mm512_permutex2var_ps(ab_lo, q0, cd_lo)}, {_mm512_permutex2var_ps(ab_lo, q1, cd_lo)},
            {_mm512_permutex2var_ps(ab_hi, q0, cd_hi)}, {_mm512_permutex2var_ps(ab_hi, q1, cd_hi)}};
#else
  alignas(64) float t[4][W];
  for (int j = 0; j < 4; ++j) vstore(t[j], o[j]);
  V z[4];
  for (int q = 0; q < 4; ++q) {
    alignas(64) float u[W];
    for (int l = 0; l < W; ++l) u[l] = t[(q * W + l) % 4][(q * W + l) / 4];
    z[q] = vload(u);
  }
#endif
  for (int q = 0; q < 4; ++q) {
    int64_t n = std::min<int64_t>(count - q * W, W);
    if (n <= 0) break;
    V v = z[q];
    if (res) v = vadd(v, n >= W ? vload(res + q * W) : vload_partial(res + q * W, int(n)));
    v = ep(v);
    if (n >= W) vstore(p + q * W, v);
    else vstore_partial(p + q * W, v, int(n));
  }
}

struct Plan {
  ConvShape s;
  const float *x, *w;             // input and weight, for the direct fallback
  int64_t th, tw, tiles;          // tile grid
  int64_t bs, blocks;             // blocks of bs tile slots (<= kBlock if more than one)
  int64_t panels;                 // output channels in panels of kMR
  bool by_block;                  // tasks own tile blocks (else panel groups)

  int64_t v_size() const { return kPos * s.c * bs; }  // one block's V
  int64_t m_size(int64_t npanels) const { return kPos * npanels * kMR * bs + W; }
  int64_t t_stride() const { return 4 * ceil_div(std::min(bs, tw), W) * W + 96; }  // a T row with read slack
  int64_t slots(int64_t b) const { return std::min(bs, tiles - b * bs); }
};

// Transformed weights U[k][panel][ci][kMR]: panels of kMR output channels,
// input channels [c0, c0 + cn). The k stride is one cache line more than
// needed so that the 36 streams of the transform do not share cache sets.
struct WeightView {
  float* u;
  int64_t c0, cn, npanels;
  int64_t panel_stride() const { return cn * kMR; }
  int64_t k_stride() const { return npanels * cn * kMR + 16; }
  int64_t size() const { return kPos * k_stride(); }
};

// Calls f(n, tile_row, first_tile_col, count, first_slot) for the runs of
// consecutive tiles of block b that lie in one tile row.
template <typename F>
void for_segments(const Plan& p, int64_t b, F&& f) {
  const int64_t end = b * p.bs + p.slots(b), per_image = p.th * p.tw;
  for (int64_t q = b * p.bs; q < end;) {
    const int64_t n = q / per_image, r = q % per_image / p.tw, t = q % p.tw;
    const int64_t count = std::min(p.tw - t, end - q);
    f(n, r, t, count, q - b * p.bs);
    q += count;
  }
}

// Buffers of one call (Workspace slots): tasks use 0 (T rows), 1 (zeros),
// 2 (V or a U chunk) and 3 (M) of their worker; the calling thread holds 4
// (all of U) or 5 (all of V) of worker 0 while the tasks run, on itself too.
constexpr int kSlots = 6;

// G g: three values -> six values (applied to columns, then to rows).
inline void weight_1d(V a, V b, V c, V r[6]) {
  const V sum = vadd(a, c), sixth = vset1(-1.0f / 6), b12 = vmul(b, vset1(1.0f / 12));
  const V t = vfma(a, vset1(1.0f / 24), vmul(c, vset1(1.0f / 6)));
  r[0] = vmul(a, vset1(0.25f));
  r[1] = vmul(vadd(sum, b), sixth);
  r[2] = vmul(vsub(sum, b), sixth);
  r[3] = vadd(t, b12);
  r[4] = vsub(t, b12);
  r[5] = c;
}

// Panel `local` of `u` = (G g G^T) for output channels (first_panel + local) * kMR
// + lane; one vector holds W / kMR consecutive input channels of the panel.
void transform_weights(const Plan& p, const float* w, int64_t first_panel, int64_t local,
                       const WeightView& u) {
  static_assert(W % kMR == 0, "a vector must hold whole panels");
  constexpr int per = W / kMR;
  const int64_t c = p.s.c, panel = first_panel + local, c1 = u.c0 + u.cn;
  for (int64_t ci0 = u.c0; ci0 < c1; ci0 += per) {
    V g[9];
#if defined(__AVX512F__)
    // Lane l reads output channel panel * kMR + l % kMR, input channel ci0 + l / kMR.
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(int(c * 9))),
                                         _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9, 9, 9, 9, 9));
    const __mmask16 outs = vmask(int(std::min<int64_t>(kMR, p.s.o - panel * kMR)));
    const __mmask16 valid = c1 - ci0 > 1 ? __mmask16(outs | outs << kMR) : outs;
    const float* base = w + (panel * kMR * c + ci0) * 9;
    for (int i = 0; i < 9; ++i)
      g[i].v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, idx, base + i, 4);
#else
    alignas(64) float t[9][W];
    for (int l = 0; l < W; ++l) {
      const int64_t o = panel * kMR + l % kMR, ci = ci0 + l / kMR;
      for (int i = 0; i < 9; ++i) t[i][l] = o < p.s.o && ci < c1 ? w[(o * c + ci) * 9 + i] : 0.0f;
    }
    for (int i = 0; i < 9; ++i) g[i] = vload(t[i]);
#endif
    V cols[3][6], rows[6][6];
    for (int j = 0; j < 3; ++j) weight_1d(g[j], g[3 + j], g[6 + j], cols[j]);
    for (int i = 0; i < 6; ++i) weight_1d(cols[0][i], cols[1][i], cols[2][i], rows[i]);
    const int lanes = int(std::min<int64_t>(per, c1 - ci0)) * kMR;
    for (int k = 0; k < kPos; ++k) {
      float* dst = u.u + k * u.k_stride() + local * u.panel_stride() + (ci0 - u.c0) * kMR;
      if (lanes == W) vstore(dst, rows[k / 6][k % 6]);
      else vstore_partial(dst, rows[k / 6][k % 6], lanes);
    }
  }
}

// V[k][ci][slot] = (B^T d B)[k] of each tile of block b, for ci in [c0, c1).
void transform_input(const Plan& p, const float* x, int64_t b, int64_t c0, int64_t c1, float* v,
                     float* trows, const float* zeros) {
  const ConvShape& s = p.s;
  const int64_t ts = p.t_stride(), valid = p.slots(b), padded = ceil_div(valid, W) * W;
  for (int64_t ci = c0; ci < c1; ++ci) {
    for_segments(p, b, [&](int64_t n, int64_t r, int64_t t0, int64_t count, int64_t s0) {
      // Columns 4 t0 - pl ... of rows 4 r - pt + m; T = B^T d along the rows.
      const int64_t col0 = 4 * t0 - s.pl, width = 4 * count + 2;
      const int64_t lo = std::clamp<int64_t>(-col0, 0, width);
      const int64_t hi = std::clamp<int64_t>(s.w - col0, lo, width);
      const float* rows[6];
      for (int m = 0; m < 6; ++m) {
        const int64_t y = 4 * r - s.pt + m;
        rows[m] = (y >= 0 && y < s.h) ? x + ((n * s.c + ci) * s.h + y) * s.w + col0 : zeros - lo;
      }
      for (int i = 0; i < 6; ++i) {
        std::fill(trows + i * ts, trows + i * ts + lo, 0.0f);
        std::fill(trows + i * ts + hi, trows + i * ts + width, 0.0f);
      }
      const int64_t plane = ci + 1 < c1 ? s.h * s.w : 0;  // prefetch the next channel's rows
      for (int64_t c = lo; c < hi; c += W) {
        const int n_c = int(std::min<int64_t>(W, hi - c));
        V d[6], t[6];
        for (int m = 0; m < 6; ++m) {
          d[m] = n_c == W ? vload(rows[m] + c) : vload_partial(rows[m] + c, n_c);
          if (rows[m] != zeros - lo) __builtin_prefetch(rows[m] + c + plane);
        }
        input_1d(d, t);
        for (int i = 0; i < 6; ++i) {
          if (n_c == W) vstore(trows + i * ts + c, t[i]);
          else vstore_partial(trows + i * ts + c, t[i], n_c);
        }
      }
      // (B^T d) B along the columns, W tiles at a time.
      for (int64_t g = 0; g < count; g += W) {
        const int n_t = int(std::min<int64_t>(W, count - g));
        for (int i = 0; i < 6; ++i) {
          V d[6], o[6];
          deinterleave6(trows + i * ts + 4 * g, d);
          input_1d(d, o);
          for (int l = 0; l < 6; ++l) {
            float* dst = v + ((i * 6 + l) * s.c + ci) * p.bs + s0 + g;
            if (n_t == W) vstore(dst, o[l]);
            else vstore_partial(dst, o[l], n_t);
          }
        }
      }
    });
    if (padded > valid)
      for (int k = 0; k < kPos; ++k)
        std::fill(v + (k * s.c + ci) * p.bs + valid, v + (k * s.c + ci) * p.bs + padded, 0.0f);
  }
}

// m[NP panels][kMR][ldm] (+)= u (NP panels of [K][kMR]) x v[K][ldv], NV vectors of slots.
template <int NP, int NV>
inline void gemm_kernel(int64_t K, const float* u, int64_t u_panel, const float* v, int64_t ldv,
                        float* m, int64_t ldm, int64_t m_panel, bool accumulate) {
  V acc[NP][kMR][NV];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < kMR; ++r)
      for (int j = 0; j < NV; ++j)
        acc[q][r][j] = accumulate ? vload(m + q * m_panel + r * ldm + j * W) : vzero();
  for (int64_t k = 0; k < K; ++k) {
    V bv[NV];
    for (int j = 0; j < NV; ++j) {
      bv[j] = vload(v + k * ldv + j * W);
      __builtin_prefetch(v + (k + 8) * ldv + j * W);  // V streams from L2/L3
    }
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < kMR; ++r) {
        const V a = vset1(u[q * u_panel + k * kMR + r]);
        for (int j = 0; j < NV; ++j) acc[q][r][j] = vfma(a, bv[j], acc[q][r][j]);
      }
  }
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < kMR; ++r)
      for (int j = 0; j < NV; ++j) vstore(m + q * m_panel + r * ldm + j * W, acc[q][r][j]);
}

// M[k][panel][kMR][bs] (+)= U[k] V[k] over the input channels of `u`, for
// every panel of `u` and the slots of block b (v is the block's V).
void multiply(const Plan& p, const WeightView& u, const float* v, int64_t b, float* m,
              bool accumulate) {
  const int64_t nvec = ceil_div(p.slots(b), W), up = u.panel_stride(), mp = kMR * p.bs;
  for (int k = 0; k < kPos; ++k) {
    const float* uk = u.u + k * u.k_stride();
    const float* vk = v + (k * p.s.c + u.c0) * p.bs;
    float* mk = m + k * u.npanels * mp;
    int64_t q = 0;
    if (nvec == 1) {  // few tiles: block several panels instead
      for (; q + 3 <= u.npanels; q += 3)
        gemm_kernel<3, 1>(u.cn, uk + q * up, up, vk, p.bs, mk + q * mp, p.bs, mp, accumulate);
      if (u.npanels - q == 2)
        gemm_kernel<2, 1>(u.cn, uk + q * up, up, vk, p.bs, mk + q * mp, p.bs, mp, accumulate);
      if (u.npanels - q == 1)
        gemm_kernel<1, 1>(u.cn, uk + q * up, up, vk, p.bs, mk + q * mp, p.bs, mp, accumulate);
      continue;
    }
    for (; q < u.npanels; ++q) {
      const float* uq = uk + q * up;
      float* mq = mk + q * mp;
      int64_t j = 0;
      for (; j + 3 <= nvec; j += 3)
        gemm_kernel<1, 3>(u.cn, uq, up, vk + j * W, p.bs, mq + j * W, p.bs, mp, accumulate);
      if (nvec - j == 2)
        gemm_kernel<1, 2>(u.cn, uq, up, vk + j * W, p.bs, mq + j * W, p.bs, mp, accumulate);
      if (nvec - j == 1)
        gemm_kernel<1, 1>(u.cn, uq, up, vk + j * W, p.bs, mq + j * W, p.bs, mp, accumulate);
    }
  }
}

// The outputs of channel o in the 4x4 tile at (row0, col0) of image n, by the
// direct definition (the fallback for tiles with non-finite values).
void direct_tile(const Plan& p, int64_t n, int64_t o, int64_t row0, int64_t col0, float bias,
                 const float* res, const Epilogue& ep, float* y) {
  const ConvShape& s = p.s;
  const float* wo = p.w + o * s.c * 9;
  for (int64_t row = row0; row < std::min(row0 + 4, s.oh); ++row)
    for (int64_t col = col0; col < std::min(col0 + 4, s.ow); ++col) {
      float acc = 0.0f;
      for (int64_t ci = 0; ci < s.c; ++ci)
        for (int64_t ky = 0; ky < 3; ++ky)
          for (int64_t kx = 0; kx < 3; ++kx) {
            const int64_t iy = row - s.pt + ky, ix = col - s.pl + kx;
            const bool inside = iy >= 0 && iy < s.h && ix >= 0 && ix < s.w;
            const float v = inside ? p.x[((n * s.c + ci) * s.h + iy) * s.w + ix] : 0.0f;
            acc += v * wo[(ci * 3 + ky) * 3 + kx];
          }
      const int64_t at = ((n * s.o + o) * s.oh + row) * s.ow + col;
      y[at] = ep(acc + bias + (res ? res[at] : 0.0f));
    }
}

// y = act(A^T M A + bias + res) for output channels [p0 kMR, p1 kMR) of block b
// (res laid out as y, or null).
void transform_output(const Plan& p, const float* m, int64_t b, int64_t p0, int64_t p1,
                      const float* bias, const float* res, const Epilogue& ep, float* y) {
  const ConvShape& s = p.s;
  const int64_t rows_per_k = (p1 - p0) * kMR;
  const int64_t o_end = std::min(p1 * kMR, s.o);
  for (int64_t o = p0 * kMR; o < o_end; ++o) {
    const float* mo = m + (o - p0 * kMR) * p.bs;
    const V bo = vset1(bias[o]);
    for_segments(p, b, [&](int64_t n, int64_t r, int64_t t0, int64_t count, int64_t s0) {
      for (int64_t g = 0; g < count; g += W) {
        V q[4][6];
        for (int l = 0; l < 6; ++l) {
          V col[6], out[4];
          for (int i = 0; i < 6; ++i) col[i] = vload(mo + (i * 6 + l) * rows_per_k * p.bs + s0 + g);
          output_1d(col, out);
          for (int a = 0; a < 4; ++a) q[a][l] = out[a];
        }
        const int64_t col0 = 4 * (t0 + g), ncols = std::min(4 * std::min<int64_t>(W, count - g), s.ow - col0);
        V sum = vzero();
        for (int a = 0; a < 4; ++a) {
          const int64_t row = 4 * r + a;
          if (row >= s.oh) break;
          V out[4];
          output_1d(q[a], out);
          for (int j = 0; j < 4; ++j) sum = vadd(sum, out[j]), out[j] = vadd(out[j], bo);
          const int64_t at = ((n * s.o + o) * s.oh + row) * s.ow + col0;
          store_interleaved4(out, y + at, ncols, ep, res ? res + at : nullptr);
        }
        alignas(64) float flags[W];
        vstore(flags, vmul(sum, vzero()));
        for (int64_t t = 0; t < std::min<int64_t>(W, count - g); ++t)
          if (flags[t] != 0.0f) direct_tile(p, n, o, 4 * r, 4 * (t0 + g + t), bias[o], res, ep, y);
      }
    });
  }
}

ffi::Error ConvWinograd(ffi::ThreadPool pool, F32Buffer x, F32Buffer w, F32Buffer b, F32Buffer r, F32Buffer,
                        ffi::Span<const int64_t> attr, int64_t act, float alpha, float lo,
                        float hi, int64_t channel0, F32Result y) {
  Plan p;
  ConvShape& s = p.s;
  Epilogue ep;
  if (auto e = decode_conv(x, w, b, attr, y, act, alpha, lo, hi, &s, &ep, channel0); e.failure()) return e;
  if (s.kh != 3 || s.kw != 3 || s.sh != 1 || s.sw != 1 || s.dh != 1 || s.dw != 1 || s.groups != 1)
    return ffi::Error::InvalidArgument(
        "jtile winograd: needs a 3x3 kernel, stride 1, dilation 1 and groups 1");
  if (s.n * s.o * s.oh * s.ow == 0) return ffi::Error::Success();
  p.th = ceil_div(s.oh, 4), p.tw = ceil_div(s.ow, 4), p.tiles = s.n * p.th * p.tw;
  p.bs = std::min(kBlock, ceil_div(p.tiles, W) * W);
  p.blocks = ceil_div(p.tiles, p.bs);
  p.panels = ceil_div(s.o, kMR);
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  p.by_block = p.blocks >= 4 * workers || s.c == 0;  // (no input channels: y = act(bias))
  // Few blocks of more than two: one block of all tiles. At 56x56 (4 blocks
  // of 48 tiles and one of 4, the block edges cutting tile rows) one block
  // ran 5-12% faster alone (64->64 298-311 against 322-331 us, DenseNet's
  // 128->32 400-423 against 455-468, SqueezeNet's 16->64 at 55x55 92-97
  // against 102-105); at 27x27 and 28x28 (48 tiles and 1) it was level, or
  // 20% slower (32->128 at 27x27).
  if (!p.by_block && p.blocks > 2) p.bs = ceil_div(p.tiles, W) * W, p.blocks = 1;
  if (r.element_count() != 0 && (int64_t)r.element_count() != conv_output_size(s))
    return ffi::Error::InvalidArgument("jtile winograd: the residual must be empty or have the output's shape");
  const Bias bias_of(b, s.o);
  const float *xs = x.typed_data(), *ws = w.typed_data(), *bias = bias_of.data();
  p.x = xs, p.w = ws;
  const float* res = r.element_count() ? r.typed_data() : nullptr;
  float* ys = conv_output(s, y, channel0);
  const int64_t zeros_size = s.w + W;

  Workspace scratch(pool, kSlots);
  auto zeros = [&](int worker) { return scratch.get(worker, 1, zeros_size, true); };
  if (p.by_block) {
    // Many tile blocks: transform all weights once, then each task runs one
    // block through input transform, GEMMs and output transform in cache.
    WeightView u{scratch.get(0, 4, WeightView{nullptr, 0, s.c, p.panels}.size()), 0, s.c, p.panels};
    parallel_for(pool, p.panels, [&](int64_t q) { transform_weights(p, ws, 0, q, u); });
    parallel_for(pool, p.blocks, [&](int64_t blk, int worker) {
      float* v = scratch.get(worker, 2, p.v_size());
      transform_input(p, xs, blk, 0, s.c, v, scratch.get(worker, 0, 6 * p.t_stride()), zeros(worker));
      float* m = scratch.get(worker, 3, p.m_size(p.panels));
      multiply(p, u, v, blk, m, false);
      transform_output(p, m, blk, 0, p.panels, bias, res, ep, ys);
    });
    return ffi::Error::Success();
  }
  // Few tile blocks: transform the input of all blocks first; then each task
  // owns a group of at most 3 output-channel panels and transforms their
  // weights kCin input channels at a time, so the transformed weights stay in
  // cache. Groups are sized so the tasks come in a multiple of the workers,
  // all of one size where a size of at most 3 panels allows it: 4 panels
  // (32 channels) as 2 + 2, not 3 + 1, which left one of two workers a
  // quarter of the work (DenseNet-121's 128->32 at 56x56: 2.0 -> 1.0 ms); 16
  // (128 channels) as 8 tasks of 2, not 5 of 3 and one of 1 (ResNet's
  // 128->128 at 28x28 379-383 against 397-406 us, SqueezeNet's 32->128 at
  // 27x27 105-106 against 113-114).
  constexpr int64_t kCin = 64;
  int64_t kGroup = 0;
  for (int64_t g = 3; g >= 1 && !kGroup; --g)
    if (p.panels % g == 0 && p.panels / g % workers == 0) kGroup = g;
  if (!kGroup) {
    const int64_t tasks = ceil_div(std::max(ceil_div(p.panels, 3), std::min(workers, p.panels)), workers) * workers;
    kGroup = ceil_div(p.panels, std::min(tasks, p.panels));
  }
  float* shared_v = scratch.get(0, 5, p.blocks * p.v_size());
  const int64_t csplit = std::min(s.c, ceil_div(4 * workers, p.blocks)), cstep = ceil_div(s.c, csplit);
  parallel_for(pool, p.blocks * csplit, [&](int64_t task, int worker) {
    const int64_t blk = task / csplit, c0 = std::min(s.c, task % csplit * cstep);
    transform_input(p, xs, blk, c0, std::min(s.c, c0 + cstep), shared_v + blk * p.v_size(),
                    scratch.get(worker, 0, 6 * p.t_stride()), zeros(worker));
  });
  parallel_for(pool, ceil_div(p.panels, kGroup), [&](int64_t task, int worker) {
    const int64_t q0 = task * kGroup, nq = std::min(kGroup, p.panels - q0);
    float* m = scratch.get(worker, 3, p.blocks * p.m_size(nq));
    for (int64_t c0 = 0; c0 < s.c; c0 += kCin) {
      WeightView u{nullptr, c0, std::min(kCin, s.c - c0), nq};
      u.u = scratch.get(worker, 2, u.size());
      for (int64_t q = 0; q < nq; ++q) transform_weights(p, ws, q0, q, u);
      for (int64_t blk = 0; blk < p.blocks; ++blk)
        multiply(p, u, shared_v + blk * p.v_size(), blk, m + blk * p.m_size(nq), c0 > 0);
    }
    for (int64_t blk = 0; blk < p.blocks; ++blk)
      transform_output(p, m + blk * p.m_size(nq), blk, q0, q0 + nq, bias, res, ep, ys);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jtile

JTILE_DEFINE_HANDLER(JtileConvWinograd, jtile::ConvWinograd,
                     JTILE_CONV_RESIDUAL_BINDING.Ret<jtile::F32Buffer>());
