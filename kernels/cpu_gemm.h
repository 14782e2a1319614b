// The fused CPU layer's GEMMs (cpu_decode.cpp): 4-bit weights in pairs of Q4_1
// blocks or in VNNI tiles, the int8 model's weights in tiles, and the int8 output
// head, against fp32 or 8-bit activations; each over the layer's own threads.
// (One header past ~300 lines: the weight layouts, the activations' quantization
// and the kernels that read them change together.)

#pragma once

#include <torch/extension.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_workers.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

// The one condition for every AVX512-VNNI path: the tiled GEMMs (and so whether
// tiled weights are taken: the build's tiles_available()) and dpbusd over pairs.
// cpu_levels.py's `tiles` says the same per level; cpu_decode.py checks they agree.
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512VL__)
#define COMPLETER_TILES 1
#else
#define COMPLETER_TILES 0
#endif

namespace cpu_decode {

constexpr int QK = 32;          // weights per block (a scale and a minimum each)
constexpr int PAIR_BYTES = 40;  // two blocks: fp16 d0 d1, fp16 m0 m1, 32 bytes of nibbles
// Byte j of a pair's nibbles holds q[j] (low) and q[j + 32] (high): one 256-bit load, a shift and a
// mask give all 64 weights in order, so the activations need no shuffling.

// With 8-bit activations on AVX512-VNNI the weights are laid out in tiles of 16
// rows instead: per block of 32 weights, the 16 rows' fp16 scales, their fp16
// minimums, then 4 x 64 bytes whose 32-bit lane i holds 4 consecutive weights of
// row i (low nibbles: weights 4h..4h+3 of vector h, high: 4h+16..4h+19). One
// dpbusd multiplies 4 weights of 16 rows by 4 broadcast activations, so the
// sums land per output row with no horizontal reduction, and a tile's unpacked
// weights serve several activation rows (a prefill) from registers.
// The int8 model's weights take the same tiles, a byte a weight (w + 128, unsigned), the
// rows' fp32 scales once at the tile's start: [n / 16, 64 + k / 32 * 512], 1.0 byte a weight
// against Q8_0's 1.06.
constexpr int TILE_ROWS = 16;
constexpr int TILE_BYTES = 64 + 256;        // per block of a 4-bit tile
constexpr int I8_TILE_BYTES = 512;          // per block of an 8-bit tile (after the tile's 64 bytes of scales)

enum class Layout { Pairs, Tiles4, Tiles8 };

struct Q4Matrix {
  const uint8_t* data;  // pairs [n, k / 64, PAIR_BYTES], tiles [n / 16, k / 32, TILE_BYTES] or [n / 16, 64 + k / 32 * 512]
  const float* bias;    // [n] or null
  int64_t n, k;
  Layout layout;
};

// Activations of m rows quantized per block of 32: qx int8, dx its scale, sx the exact sum of x.
// Or (q8 false) kept in fp32, with the sums.
struct Activations {
  bool q8 = false;
  std::vector<int8_t> q;
  std::vector<float> d, s, f;
  int64_t m = 0, k = 0;

  void quantize(const float* x, int64_t rows, int64_t width) {
    m = rows;
    k = width;
    const int64_t g = width / QK;
    s.resize(rows * g);
    if (!q8) {
      f.assign(x, x + rows * width);
      for (int64_t i = 0; i < rows * g; ++i) {
        float sum = 0.f;
        for (int j = 0; j < QK; ++j) sum += x[i * QK + j];
        s[i] = sum;
      }
      return;
    }
    q.resize(rows * width);
    d.resize(rows * g);
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < rows * g; ++i) {  // a block is two vectors
      const __m512 x0 = _mm512_loadu_ps(x + i * QK), x1 = _mm512_loadu_ps(x + i * QK + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const float scale = amax / 127.f;
      const __m512 inv = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
      // round to nearest even, as nearbyint: values are within +-127, so the narrowing never saturates
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + i * QK),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + i * QK + 16),
                       _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv))));
      d[i] = scale;
      s[i] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    }
#endif
    for (; i < rows * g; ++i) {
      const float* xb = x + i * QK;
      float amax = 0.f, sum = 0.f;
      for (int j = 0; j < QK; ++j) {
        amax = std::max(amax, std::fabs(xb[j]));
        sum += xb[j];
      }
      const float scale = amax / 127.f;
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      int8_t* qb = q.data() + i * QK;
      for (int j = 0; j < QK; ++j) qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
      d[i] = scale;
      s[i] = sum;
    }
  }
};

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

#if defined(__AVX2__)
inline float hsum256(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

// Both rows below without SIMD: per block d * dx * sum(q x) + m * sx, where
// dx is the activation block's scale (none for fp32 activations) and the sum is
// taken in Acc (int32 for 8-bit activations, exact).
template <typename Acc, typename X>
inline float dot_row_portable(const uint8_t* w, const X* x, const float* dx, const float* sx, int64_t pairs) {
  float total = 0.f;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* pair = w + p * PAIR_BYTES;
    Acc low = 0, high = 0;
    for (int j = 0; j < 32; ++j) {
      low += (pair[8 + j] & 15) * x[p * 64 + j];
      high += (pair[8 + j] >> 4) * x[p * 64 + 32 + j];
    }
    const float d0 = dx ? dx[2 * p] : 1.f, d1 = dx ? dx[2 * p + 1] : 1.f;
    total += half_to_float(pair) * d0 * low + half_to_float(pair + 2) * d1 * high +
             half_to_float(pair + 4) * sx[2 * p] + half_to_float(pair + 6) * sx[2 * p + 1];
  }
  return total;
}

// One weight row against one quantized activation row: sum over pairs of blocks.
inline float dot_row(const uint8_t* w, const int8_t* qx, const float* dx, const float* sx, int64_t pairs) {
#if COMPLETER_TILES
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m128 mins = _mm_setzero_ps();
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  // lanes 0-7 take block 2i's scale, 8-15 block 2i + 1's
  const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* pair = w + p * PAIR_BYTES;
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 8));
    const __m512i q = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1), low_mask);
    const __m512i x = _mm512_loadu_si512(qx + p * 64);
    const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x);
    const __m128 halves = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(pair)));  // d0 d1 m0 m1
    const __m128 xs = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx + 2 * p)));    // dx0 dx1
    const __m128 sums = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(sx + 2 * p)));  // sx0 sx1
    const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(halves, xs)));
    acc[p & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale, acc[p & 1]);
    mins = _mm_fmadd_ps(_mm_movehl_ps(halves, halves), sums, mins);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + _mm_cvtss_f32(mins) +
         _mm_cvtss_f32(_mm_shuffle_ps(mins, mins, 1));
#elif defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.f;
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* pair = w + p * PAIR_BYTES;
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 8));
    const __m256i q[2] = {_mm256_and_si256(packed, low_mask), _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask)};
    for (int b = 0; b < 2; ++b) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + p * 64 + b * 32));
      // 15 * 127 * 2 fits in int16: maddubs cannot saturate here.
      const __m256i dots = _mm256_madd_epi16(_mm256_maddubs_epi16(q[b], x), ones);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(half_to_float(pair + 2 * b) * dx[2 * p + b]), acc);
      mins += half_to_float(pair + 4 + 2 * b) * sx[2 * p + b];
    }
  }
  return hsum256(acc) + mins;
#else
  return dot_row_portable<int32_t>(w, qx, dx, sx, pairs);
#endif
}

// The same row against fp32 activations x (sx: each block's sum of x), where
// AVX512 is missing: per block d * sum(q x) + m * sum(x), q widened to fp32.
inline float dot_row_f32(const uint8_t* w, const float* x, const float* sx, int64_t pairs) {
#if defined(__AVX2__)  // (AVX512 machines take dot_rows_f32 below)
  __m256 acc = _mm256_setzero_ps();
  float mins = 0.f;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* pair = w + p * PAIR_BYTES;
    for (int b = 0; b < 2; ++b) {
      __m256 s = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c) {  // 8 weights at a time
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(pair + 8 + 8 * c));
        const __m128i nib = _mm_and_si128(b == 0 ? bytes : _mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib)), _mm256_loadu_ps(x + p * 64 + 32 * b + 8 * c), s);
      }
      acc = _mm256_fmadd_ps(s, _mm256_set1_ps(half_to_float(pair + 2 * b)), acc);
      mins += half_to_float(pair + 4 + 2 * b) * sx[2 * p + b];
    }
  }
  return hsum256(acc) + mins;
#else
  return dot_row_portable<float>(w, x, nullptr, sx, pairs);
#endif
}

#if defined(__AVX512F__)
// R activation rows against one weight row at once (a prefill or verify pass):
// each pair of blocks is dequantized to fp32 (q * d + m) once for all R rows.
template <int R>
inline void dot_rows_f32(const uint8_t* w, const float* x, int64_t k, int64_t pairs, float* out, int64_t out_stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* pair = w + p * PAIR_BYTES;
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 8));
    const __m256i q[2] = {_mm256_and_si256(packed, low_mask), _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask)};
    const __m128 halves = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(pair)));  // d0 d1 m0 m1
    __m512 wf[4];
    for (int b = 0; b < 2; ++b) {
      const __m512 d = _mm512_broadcastss_ps(b == 0 ? halves : _mm_movehdup_ps(halves));
      const __m128 mh = _mm_movehl_ps(halves, halves);  // m0 m1
      const __m512 m = _mm512_broadcastss_ps(b == 0 ? mh : _mm_movehdup_ps(mh));
      wf[2 * b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q[b]))), d, m);
      wf[2 * b + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q[b], 1))), d, m);
    }
    for (int r = 0; r < R; ++r) {
      const float* xp = x + r * k + p * 64;
      for (int i = 0; i < 4; ++i) acc[r] = _mm512_fmadd_ps(wf[i], _mm512_loadu_ps(xp + 16 * i), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * out_stride] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#if COMPLETER_TILES
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R quantized activation rows against one tile (16 weight rows): y[r, 0..15].
// 4-bit tiles (INT8 false): per block d * dx * sum(q qx) + m * sum(x), q unsigned, qx signed.
// 8-bit tiles (the int8 model's weights w, a scale per row): the tile holds w + 128, so a
// block's sum(w qx) is dpbusd's sum minus 128 * sum(qx) (q128, per activation block, made by
// gemm_tiled for 8-bit tiles only); the row's scale multiplies once at the end.
template <bool INT8, int R>
inline void tile_rows_q8(const uint8_t* tile, const int8_t* qx, const float* dx, const float* sx, const int32_t* q128,
                         int64_t k, float* y, int64_t y_stride, const float* bias) {
  const int64_t blocks = k / QK;
  const __m512i low_mask = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512 row_scale = INT8 ? _mm512_loadu_ps(tile) : _mm512_set1_ps(1.f);
  const uint8_t* first = INT8 ? tile + 64 : tile;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = first + b * (INT8 ? I8_TILE_BYTES : TILE_BYTES);
    __m512 d, m;
    __m512i w[8];
    if constexpr (INT8) {
      for (int h = 0; h < 8; ++h) w[h] = _mm512_loadu_si512(block + 64 * h);
    } else {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
      for (int h = 0; h < 4; ++h) {
        const __m512i packed = _mm512_loadu_si512(block + 64 + 64 * h);
        w[h] = _mm512_and_si512(packed, low_mask);
        w[h + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_mask);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = qx + r * k + b * QK;
      // two chains of four: a block's integer sum is not one long dependency
      auto dp = [&](__m512i sum, int h) { return _mm512_dpbusd_epi32(sum, w[h], broadcast4(xb + 4 * h)); };
      __m512i s0 = dp(zero, 0), s1 = dp(zero, 4);
      for (int h = 1; h < 4; ++h) {
        s0 = dp(s0, h);
        s1 = dp(s1, h + 4);
      }
      __m512i sum = _mm512_add_epi32(s0, s1);
      if constexpr (INT8) {
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(q128[r * blocks + b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dx[r * blocks + b]), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * blocks + b])), acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * blocks + b]), acc[r]);
      }
    }
  }
  const __m512 bias16 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, _mm512_fmadd_ps(acc[r], row_scale, bias16));
}

// y[m, n] for a tiled matrix: each thread takes runs of tiles, all m rows at once (four at a time
// from registers; a tile's k / 32 blocks stay in L1 between the groups of four).
template <bool INT8>
void gemm_tiled(Workers& workers, const Activations& x, const Q4Matrix& w, float* y) {
  const int64_t blocks = w.k / QK, tiles = w.n / TILE_ROWS;
  const int64_t tile_bytes = INT8 ? 64 + blocks * I8_TILE_BYTES : blocks * TILE_BYTES;
  std::vector<int32_t> q128_all;  // 128 * each activation block's sum: what the 8-bit tiles' w + 128 add
  if constexpr (INT8) {
    q128_all.resize(x.m * blocks);
    for (int64_t i = 0; i < x.m * blocks; ++i) {
      int32_t total = 0;
      for (int j = 0; j < QK; ++j) total += x.q[i * QK + j];
      q128_all[i] = 128 * total;
    }
  }
  const int64_t grain = std::max<int64_t>(1, tiles / (4 * workers.threads()));
  workers.run(tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = w.data + t * tile_bytes;
      const float* bias = w.bias ? w.bias + t * TILE_ROWS : nullptr;
      for (int64_t r = 0; r < x.m;) {
        const int8_t* q = x.q.data() + r * w.k;
        const float *d = x.d.data() + r * blocks, *s = x.s.data() + r * blocks;
        const int32_t* q128 = INT8 ? q128_all.data() + r * blocks : nullptr;
        float* out = y + r * w.n + t * TILE_ROWS;
        switch (std::min<int64_t>(4, x.m - r)) {
          case 4: tile_rows_q8<INT8, 4>(tile, q, d, s, q128, w.k, out, w.n, bias); r += 4; break;
          case 3: tile_rows_q8<INT8, 3>(tile, q, d, s, q128, w.k, out, w.n, bias); r += 3; break;
          case 2: tile_rows_q8<INT8, 2>(tile, q, d, s, q128, w.k, out, w.n, bias); r += 2; break;
          default: tile_rows_q8<INT8, 1>(tile, q, d, s, q128, w.k, out, w.n, bias); r += 1; break;
        }
      }
    }
  });
}
#endif

// y[m, n] = x[m, :] . w[n, :] (+ bias), every output row read once for all m rows.
inline void q4_gemm(Workers& workers, const Activations& x, const Q4Matrix& w, float* y) {
  if (w.layout != Layout::Pairs) {
#if COMPLETER_TILES
    TORCH_CHECK(x.q8, "tiled weights take 8-bit activations");
    if (w.layout == Layout::Tiles4) gemm_tiled<false>(workers, x, w, y);
    else gemm_tiled<true>(workers, x, w, y);
    return;
#else
    TORCH_CHECK(false, "tiled weights need AVX512-VNNI");
#endif
  }
  const int64_t pairs = w.k / 64, row_bytes = pairs * PAIR_BYTES, blocks = w.k / QK;
  // A few long runs of rows per thread: the prefetcher streams a run, and a
  // thread that lost its core holds up only the run it took.
  const int64_t grain = std::max<int64_t>(32, w.n / (4 * workers.threads()));
  workers.run(w.n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w.data + n * row_bytes;
      const float bias = w.bias ? w.bias[n] : 0.f;
      int64_t r = 0;
#if defined(__AVX512F__)
      if (!x.q8) {
        const float* xf = x.f.data();
        for (; r + 8 <= x.m; r += 8) dot_rows_f32<8>(row, xf + r * w.k, w.k, pairs, y + r * w.n + n, w.n);
        for (; r + 4 <= x.m; r += 4) dot_rows_f32<4>(row, xf + r * w.k, w.k, pairs, y + r * w.n + n, w.n);
        for (; r + 2 <= x.m; r += 2) dot_rows_f32<2>(row, xf + r * w.k, w.k, pairs, y + r * w.n + n, w.n);
        for (; r < x.m; ++r) dot_rows_f32<1>(row, xf + r * w.k, w.k, pairs, y + r * w.n + n, w.n);
      }
#endif
      for (; r < x.m; ++r)
        y[r * w.n + n] = x.q8 ? dot_row(row, x.q.data() + r * w.k, x.d.data() + r * blocks, x.s.data() + r * blocks,
                                        pairs)
                              : dot_row_f32(row, x.f.data() + r * w.k, x.s.data() + r * blocks, pairs);
      for (r = 0; r < x.m; ++r) y[r * w.n + n] += bias;
    }
  });
}

// The output head: int8 weights with a scale per row, fp32 activations.
inline float dot_i8(const int8_t* w, const float* x, int64_t k) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; i + 32 <= k; i += 32)
    for (int h = 0; h < 2; ++h) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 16 * h));
      acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), _mm512_loadu_ps(x + i + 16 * h), acc[h]);
    }
  total = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
#elif defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_loadu_ps(x + i), acc);
  }
  total = hsum256(acc);
#endif
  for (; i < k; ++i) total += w[i] * x[i];
  return total;
}

inline void i8_gemm(Workers& workers, const float* x, int64_t m, const int8_t* w, const float* scale, int64_t n, int64_t k,
             float* y) {
  workers.run(n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t r = 0; r < m; ++r) y[r * n + row] = scale[row] * dot_i8(w + row * k, x + r * k, k);
  });
}

inline Q4Matrix matrix(const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  const float* b = bias && bias->defined() ? bias->data_ptr<float>() : nullptr;
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous(), "packed weights: a contiguous uint8 tensor");
  if (packed.dim() == 2) {  // 8-bit tiles
    TORCH_CHECK((packed.size(1) - 64) % I8_TILE_BYTES == 0 && packed.size(1) > 64,
                "8-bit tiles: [n / 16, 64 + k / 32 * 512] bytes");
    return {packed.data_ptr<uint8_t>(), b, packed.size(0) * TILE_ROWS, (packed.size(1) - 64) / I8_TILE_BYTES * QK,
            Layout::Tiles8};
  }
  const int64_t width = packed.dim() == 3 ? packed.size(2) : 0;
  TORCH_CHECK(width == PAIR_BYTES || width == TILE_BYTES,
              "packed weights: [n, k / 64, 40] (4-bit pairs), [n / 16, k / 32, 320] (4-bit tiles) or "
              "[n / 16, 64 + k / 32 * 512] (8-bit tiles) bytes");
  const bool pairs = width == PAIR_BYTES;
  return {packed.data_ptr<uint8_t>(), b, pairs ? packed.size(0) : packed.size(0) * TILE_ROWS,
          packed.size(1) * (pairs ? 64 : QK), pairs ? Layout::Pairs : Layout::Tiles4};
}

}  // namespace cpu_decode
