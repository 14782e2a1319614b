// A decoder layer for CPU passes of a few tokens (decode, verify, a keystroke's
// prefill), in one call: RMSNorm, 4-bit projections, RoPE, the K/V write,
// attention over the paged pool, SiLU-gated MLP. Built at first use by
// cpu_decode.py (torch.utils.cpp_extension, -march=native).
//
// Why: such a pass is bound by streaming the weights (~2 MB a layer at 4 bits),
// but through torch's ops it is ~15 dispatches a layer at 10-30 us each, more
// than the weights take to stream.
//
// The 4-bit GEMM is GGUF Q4_1's math with Q8 activations (engine.fused_cpu_q8), as llama.cpp's CPU
// backend does it: a block of 32 weights w = q * d + m (q in 0..15, d and m
// fp16) against 32 activations x ~= qx * dx (qx int8) gives
//   sum(w x) ~= d * dx * sum(q qx) + m * sum(x),
// the integer sum on AVX512-VNNI (dpbusd: u8 x s8), AVX2 (maddubs) or plain C.
// sum(x) is taken from the unquantized activations.

#include <torch/extension.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_workers.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

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
// The int8 model's weights take the same tiles, a byte a weight: per block the rows' fp32
// scales, 128 * each row's sum of the block's weights (int32), then 8 x 64 bytes.
constexpr int TILE_ROWS = 16;
constexpr int TILE_BYTES = 64 + 256;        // per block of a 4-bit tile
constexpr int I8_TILE_BYTES = 128 + 512;    // per block of an 8-bit tile

enum class Layout { Pairs, Tiles4, Tiles8 };

struct Q4Matrix {
  const uint8_t* data;  // pairs [n, k / 64, PAIR_BYTES] or tiles [n / 16, k / 32, TILE_BYTES or I8_TILE_BYTES]
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

// One weight row against one quantized activation row: sum over pairs of blocks.
inline float dot_row(const uint8_t* w, const int8_t* qx, const float* dx, const float* sx, int64_t pairs) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
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
  float total = 0.f;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* pair = w + p * PAIR_BYTES;
    const int8_t* xb = qx + p * 64;
    int32_t low = 0, high = 0;
    for (int j = 0; j < 32; ++j) {
      low += (pair[8 + j] & 15) * xb[j];
      high += (pair[8 + j] >> 4) * xb[j + 32];
    }
    total += half_to_float(pair) * dx[2 * p] * low + half_to_float(pair + 2) * dx[2 * p + 1] * high +
             half_to_float(pair + 4) * sx[2 * p] + half_to_float(pair + 6) * sx[2 * p + 1];
  }
  return total;
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
  float total = 0.f;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* pair = w + p * PAIR_BYTES;
    float low = 0.f, high = 0.f;
    for (int j = 0; j < 32; ++j) {
      low += (pair[8 + j] & 15) * x[p * 64 + j];
      high += (pair[8 + j] >> 4) * x[p * 64 + 32 + j];
    }
    total += half_to_float(pair) * low + half_to_float(pair + 2) * high + half_to_float(pair + 4) * sx[2 * p] +
             half_to_float(pair + 6) * sx[2 * p + 1];
  }
  return total;
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

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R quantized activation rows against one tile (16 weight rows): y[r, 0..15].
// 4-bit tiles (INT8 false): per block d * dx * sum(q qx) + m * sum(x), q unsigned, qx signed.
// 8-bit tiles (the int8 model's weights w, |w| <= 63, a scale per row): dpbusd wants one side
// unsigned, so it multiplies qx + 128 (qx ^ 0x80) by w and each block subtracts 128 * sum(w),
// stored with the block: per block scale * dx * sum(w qx).
template <bool INT8, int R>
inline void tile_rows_q8(const uint8_t* tile, const int8_t* qx, const float* dx, const float* sx, int64_t k,
                         float* y, int64_t y_stride, const float* bias) {
  const int64_t blocks = k / QK;
  const __m512i low_mask = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * (INT8 ? I8_TILE_BYTES : TILE_BYTES);
    __m512 d, m;
    __m512i w[8], offset;
    if constexpr (INT8) {
      d = _mm512_loadu_ps(block);
      offset = _mm512_loadu_si512(block + 64);
      for (int h = 0; h < 8; ++h) w[h] = _mm512_loadu_si512(block + 128 + 64 * h);
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
      auto dp = [&](__m512i sum, int h) {
        return INT8 ? _mm512_dpbusd_epi32(sum, broadcast4(xb + 4 * h), w[h])
                    : _mm512_dpbusd_epi32(sum, w[h], broadcast4(xb + 4 * h));
      };
      __m512i s0 = dp(zero, 0), s1 = dp(zero, 4);
      for (int h = 1; h < 4; ++h) {
        s0 = dp(s0, h);
        s1 = dp(s1, h + 4);
      }
      __m512i sum = _mm512_add_epi32(s0, s1);
      if constexpr (INT8) sum = _mm512_sub_epi32(sum, offset);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(dx[r * blocks + b])), acc[r]);
      if constexpr (!INT8) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * blocks + b]), acc[r]);
    }
  }
  const __m512 bias16 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * y_stride, _mm512_add_ps(acc[r], bias16));
}

// y[m, n] for a tiled matrix: each thread takes runs of tiles, all m rows at once (four at a time
// from registers; a tile's k / 32 blocks stay in L1 between the groups of four).
template <bool INT8>
void gemm_tiled(Workers& workers, const Activations& x, const Q4Matrix& w, float* y) {
  const int64_t blocks = w.k / QK, tiles = w.n / TILE_ROWS;
  const int64_t tile_bytes = blocks * (INT8 ? I8_TILE_BYTES : TILE_BYTES);
  std::vector<int8_t> flipped;  // qx + 128, the unsigned side of the 8-bit tiles' products
  const int8_t* qx = x.q.data();
  if constexpr (INT8) {
    flipped.resize(x.q.size());
    for (size_t i = 0; i < flipped.size(); ++i) flipped[i] = static_cast<int8_t>(x.q[i] ^ 0x80);
    qx = flipped.data();
  }
  const int64_t grain = std::max<int64_t>(1, tiles / (4 * workers.threads()));
  workers.run(tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = w.data + t * tile_bytes;
      const float* bias = w.bias ? w.bias + t * TILE_ROWS : nullptr;
      for (int64_t r = 0; r < x.m;) {
        const int8_t* q = qx + r * w.k;
        const float *d = x.d.data() + r * blocks, *s = x.s.data() + r * blocks;
        float* out = y + r * w.n + t * TILE_ROWS;
        switch (std::min<int64_t>(4, x.m - r)) {
          case 4: tile_rows_q8<INT8, 4>(tile, q, d, s, w.k, out, w.n, bias); r += 4; break;
          case 3: tile_rows_q8<INT8, 3>(tile, q, d, s, w.k, out, w.n, bias); r += 3; break;
          case 2: tile_rows_q8<INT8, 2>(tile, q, d, s, w.k, out, w.n, bias); r += 2; break;
          default: tile_rows_q8<INT8, 1>(tile, q, d, s, w.k, out, w.n, bias); r += 1; break;
        }
      }
    }
  });
}
#endif

// y[m, n] = x[m, :] . w[n, :] (+ bias), every output row read once for all m rows.
void q4_gemm(Workers& workers, const Activations& x, const Q4Matrix& w, float* y) {
  if (w.layout != Layout::Pairs) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
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

void i8_gemm(Workers& workers, const float* x, int64_t m, const int8_t* w, const float* scale, int64_t n, int64_t k,
             float* y) {
  workers.run(n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t r = 0; r < m; ++r) y[r * n + row] = scale[row] * dot_i8(w + row * k, x + r * k, k);
  });
}

void rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t d, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / d + eps);
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = xr[i] * inv * weight[i];
  }
}

// HF's rotate-half RoPE on `heads` heads of width hd at the start of each row.
void rope(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t hd, const float* cos, const float* sin) {
  const int64_t half = hd / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * hd;
    const float* s = sin + r * hd;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + h * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename KV>
void write_kv(const float* qkv, int64_t rows, int64_t row_stride, int64_t k_offset, int64_t kv_width,
              const int64_t* slots, KV* kpool, KV* vpool) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* k = qkv + r * row_stride + k_offset;
    const float* v = k + kv_width;
    KV* kd = kpool + slots[r] * kv_width;
    KV* vd = vpool + slots[r] * kv_width;
    for (int64_t i = 0; i < kv_width; ++i) {
      kd[i] = static_cast<KV>(k[i]);
      vd[i] = static_cast<KV>(v[i]);
    }
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is fp32's upper half
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// q . k over hd values (q fp32), and acc += p * v.
template <typename KV>
inline float dot(const float* q, const KV* k, int64_t hd) {
#if defined(__AVX512F__)
  if (hd % 16 == 0) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < hd; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), s);
    return _mm512_reduce_add_ps(s);
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < hd; ++i) s += q[i] * to_float(k[i]);
  return s;
}

template <typename KV>
inline void add_scaled(float* acc, float p, const KV* v, int64_t hd) {
#if defined(__AVX512F__)
  if (hd % 16 == 0) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t i = 0; i < hd; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, load16(v + i), _mm512_loadu_ps(acc + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < hd; ++i) acc[i] += p * to_float(v[i]);
}

// q . k for four keys at once: their sums reduced together (one horizontal sum
// per key was most of attention's time).
template <typename KV>
inline void dot4(const float* q, const KV* k0, const KV* k1, const KV* k2, const KV* k3, int64_t hd, float* out) {
#if defined(__AVX512F__)
  if (hd % 16 == 0) {
    __m512 v[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const KV* ks[4] = {k0, k1, k2, k3};
    for (int64_t i = 0; i < hd; i += 16) {
      const __m512 qv = _mm512_loadu_ps(q + i);
      for (int c = 0; c < 4; ++c) v[c] = _mm512_fmadd_ps(qv, load16(ks[c] + i), v[c]);
    }
    // lanes: (v0+v1 interleaved), (v2+v3 interleaved) -> each 128-bit lane [v0 v1 v2 v3] -> sum of lanes
    const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
    const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
    const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
    const __m512 d = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0x4E));
    const __m512 e = _mm512_add_ps(d, _mm512_shuffle_f32x4(d, d, 0xB1));
    _mm_storeu_ps(out, _mm512_castps512_ps128(e));
    return;
  }
#endif
  out[0] = dot(q, k0, hd);
  out[1] = dot(q, k1, hd);
  out[2] = dot(q, k2, hd);
  out[3] = dot(q, k3, hd);
}

#if defined(__AVX512F__)
// e^x for x <= 0 (softmax after subtracting the max): 2^n * p(r), r = x - n ln2, a degree-6
// polynomial on |r| <= ln2 / 2 (relative error ~2e-7); std::exp per score was most of attention's time.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// out[i] = silu(g[i]) * u[i] for n values (g, u: the gate's and the up projection's).
inline void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));  // e^-|x|, no overflow
    const __m512 one = _mm512_set1_ps(1.f);
    // sigmoid(x) = 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below
    const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), one, e),
                                     _mm512_add_ps(one, e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), _mm512_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// s[j] = e^(s[j] - top) in place; returns their sum.
inline float exp_shifted(float* s, int64_t n, float top) {
  int64_t j = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), shift));
    _mm512_mask_storeu_ps(s + j, tail, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    j = n;
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - top);
    total += s[j];
  }
  return total;
}

#if defined(__AVX512F__)
template <int VECS, typename KV>
inline void weighted_sum_regs(const float* p, const KV* const* rows, int64_t n, int64_t offset, float* acc) {
  __m512 a[VECS];
  for (int i = 0; i < VECS; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int64_t j = 0; j < n; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    const KV* v = rows[j] + offset;
    for (int i = 0; i < VECS; ++i) a[i] = _mm512_fmadd_ps(pj, load16(v + 16 * i), a[i]);
  }
  for (int i = 0; i < VECS; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif

// acc += sum_j p[j] * v_j for n value rows (each at rows[j] + offset), acc in registers
// for the usual head widths.
template <typename KV>
inline void weighted_sum(const float* p, const KV* const* rows, int64_t n, int64_t offset, int64_t hd, float* acc) {
#if defined(__AVX512F__)
  if (hd == 64) return weighted_sum_regs<4>(p, rows, n, offset, acc);
  if (hd == 128) return weighted_sum_regs<8>(p, rows, n, offset, acc);
#endif
  for (int64_t j = 0; j < n; ++j) add_scaled(acc, p[j], rows[j] + offset, hd);
}

// Each new token t (row t / tokens_per_row) attends over the first context_lens[t]
// positions of its row, read through the row's block table; fp32 math.
// Flash-decoding split: a row's context is cut into `parts` spans, each span
// read once for all its new tokens and heads (a position's K/V rows of every
// head are contiguous in the pool, so a span streams, and stays in L2 while its
// tokens and heads take their turns), and the spans' softmax partials merged after.
constexpr int64_t PREFETCH_AHEAD = 16;  // positions

// into L1 (near) or L2 (far)
inline void prefetch(const void* p, int64_t bytes, bool near) {
  for (int64_t off = 0; off < bytes; off += 64) {
    const char* line = static_cast<const char*>(p) + off;
#if defined(__SSE__)
    if (near) _mm_prefetch(line, _MM_HINT_T0);
    else _mm_prefetch(line, _MM_HINT_T1);
#else
    __builtin_prefetch(line, 0, near ? 3 : 2);
#endif
  }
}

template <typename KV>
void attend(Workers& workers, const float* qkv, int64_t rows, int64_t row_stride, int64_t heads, int64_t kv_heads,
            int64_t hd,
            const KV* kpool, const KV* vpool, const int32_t* tables, int64_t table_width,
            const int32_t* context_lens, int64_t tokens_per_row, int64_t block_size, float* out) {
  const int64_t group = heads / kv_heads, kv_stride = kv_heads * hd, seqs = rows / tokens_per_row;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  int64_t longest = 1;
  for (int64_t t = 0; t < rows; ++t) longest = std::max<int64_t>(longest, context_lens[t]);
  // spans of at least 64 positions, whole blocks, enough of them to keep every thread busy
  const int64_t want = std::max<int64_t>(1, 2 * workers.threads() / std::max<int64_t>(1, seqs));
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(want, longest / 64));
  const int64_t span = (longest + parts - 1) / parts;
  const int64_t span_blocks = (span + block_size - 1) / block_size;
  std::vector<float> part_max(rows * parts * heads, -INFINITY), part_sum(rows * parts * heads, 0.f);
  std::vector<float> part_acc(rows * parts * heads * hd, 0.f);

  workers.run(seqs * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(tokens_per_row * heads * hd), scores;
    std::vector<const KV*> vrows;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / parts, part = item % parts, t0 = seq * tokens_per_row;
      int64_t n = 0;  // the longest context among the row's new tokens
      for (int64_t t = t0; t < t0 + tokens_per_row; ++t) n = std::max<int64_t>(n, context_lens[t]);
      const int64_t first = part * span_blocks * block_size, last = std::min(n, first + span_blocks * block_size);
      if (first >= last) continue;
      const int64_t count = last - first;
      const int32_t* table = tables + seq * table_width;
      for (int64_t u = 0; u < tokens_per_row; ++u)
        for (int64_t i = 0; i < heads * hd; ++i) q[u * heads * hd + i] = qkv[(t0 + u) * row_stride + i] * scale;
      scores.resize(tokens_per_row * heads * count);
      for (int64_t j = first; j < last; j += 4) {
        const int64_t n4 = std::min<int64_t>(4, last - j);
        if (j + PREFETCH_AHEAD < last) {  // blocks are scattered in the pool: the prefetcher cannot guess the next
          const int64_t at = j + PREFETCH_AHEAD;
          const int64_t row = (static_cast<int64_t>(table[at / block_size]) * block_size + at % block_size) * kv_stride;
          const int64_t bytes = std::min<int64_t>(4, block_size - at % block_size) * kv_stride * sizeof(KV);
          prefetch(kpool + row, bytes, true);
          prefetch(vpool + row, bytes, false);  // read after the span's scores
        }
        const KV* k4[4];
        for (int64_t c = 0; c < 4; ++c) {
          const int64_t at = j + std::min(c, n4 - 1);
          k4[c] = kpool + (static_cast<int64_t>(table[at / block_size]) * block_size + at % block_size) * kv_stride;
        }
        for (int64_t u = 0; u < tokens_per_row; ++u) {
          if (j >= context_lens[t0 + u]) continue;  // past this token's causal end
          for (int64_t h = 0; h < heads; ++h) {
            float s4[4];
            const int64_t off = (h / group) * hd;
            dot4(q.data() + (u * heads + h) * hd, k4[0] + off, k4[1] + off, k4[2] + off, k4[3] + off, hd, s4);
            float* sc = scores.data() + (u * heads + h) * count + (j - first);
            for (int64_t c = 0; c < n4; ++c) sc[c] = s4[c];
          }
        }
      }
      vrows.resize(count);
      for (int64_t j = first; j < last; ++j)
        vrows[j - first] = vpool + (static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size) * kv_stride;
      for (int64_t u = 0; u < tokens_per_row; ++u) {
        const int64_t mine = std::min<int64_t>(last, context_lens[t0 + u]) - first;  // this token's positions here
        if (mine <= 0) continue;
        const int64_t at = ((t0 + u) * parts + part) * heads;
        for (int64_t h = 0; h < heads; ++h) {
          float* sc = scores.data() + (u * heads + h) * count;
          float top = -INFINITY;
          for (int64_t j = 0; j < mine; ++j) top = std::max(top, sc[j]);
          part_max[at + h] = top;
          part_sum[at + h] = exp_shifted(sc, mine, top);
          weighted_sum(sc, vrows.data(), mine, (h / group) * hd, hd, part_acc.data() + (at + h) * hd);
        }
      }
    }
  });

  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float top = -INFINITY;
      for (int64_t p = 0; p < parts; ++p) top = std::max(top, part_max[(t * parts + p) * heads + h]);
      float* o = out + t * heads * hd + h * hd;
      std::fill(o, o + hd, 0.f);
      float total = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t at = (t * parts + p) * heads + h;
        if (part_sum[at] == 0.f) continue;
        const float w = std::exp(part_max[at] - top);
        total += w * part_sum[at];
        const float* a = part_acc.data() + at * hd;
        for (int64_t i = 0; i < hd; ++i) o[i] += w * a[i];
      }
      for (int64_t i = 0; i < hd; ++i) o[i] /= total;
    }
}

Q4Matrix matrix(const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  const int64_t width = packed.dim() == 3 ? packed.size(2) : 0;
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() &&
              (width == PAIR_BYTES || width == TILE_BYTES || width == I8_TILE_BYTES),
              "packed weights: a contiguous uint8 [n, k / 64, 40] (4-bit pairs), [n / 16, k / 32, 320] "
              "(4-bit tiles) or [n / 16, k / 32, 640] (8-bit tiles) tensor");
  const Layout layout = width == PAIR_BYTES ? Layout::Pairs : width == TILE_BYTES ? Layout::Tiles4 : Layout::Tiles8;
  const bool tiled = layout != Layout::Pairs;
  return {packed.data_ptr<uint8_t>(), bias && bias->defined() ? bias->data_ptr<float>() : nullptr,
          tiled ? packed.size(0) * TILE_ROWS : packed.size(0), packed.size(1) * (tiled ? QK : 64), layout};
}

}  // namespace

// One layer's weights, held for the model's life.
struct Layer {
  torch::Tensor input_norm, post_norm;
  torch::Tensor qkv, o, gate_up, down;  // q4 pairs of blocks
  c10::optional<torch::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
};

class FusedLayers {
 public:
  // q8: activations quantized to 8 bits for the 4-bit GEMMs (llama.cpp's math), else fp32.
  // threads: the calling thread and threads - 1 helpers of its own.
  FusedLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, bool q8, int64_t threads)
      : heads_(heads), kv_heads_(kv_heads), hd_(head_dim), eps_(static_cast<float>(eps)), q8_(q8),
        workers_(std::make_unique<Workers>(static_cast<int>(std::max<int64_t>(threads, 1) - 1))) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias, torch::Tensor o,
                 c10::optional<torch::Tensor> o_bias, torch::Tensor post_norm, torch::Tensor gate_up,
                 c10::optional<torch::Tensor> gate_up_bias, torch::Tensor down,
                 c10::optional<torch::Tensor> down_bias) {
    layers_.push_back({input_norm.contiguous(), post_norm.contiguous(), qkv, o, gate_up, down, qkv_bias, o_bias,
                       gate_up_bias, down_bias});
  }

  // The output head: int8 weights [vocab, d] and a scale per row.
  void set_head(torch::Tensor weight, torch::Tensor scale) {
    TORCH_CHECK(weight.dtype() == torch::kInt8 && weight.dim() == 2 && scale.dtype() == torch::kFloat32 &&
                scale.size(0) == weight.size(0), "head: int8 [vocab, d] and fp32 [vocab] scales");
    head_weight_ = weight.contiguous();
    head_scale_ = scale.contiguous();
  }

  // logits [m, vocab] of final hidden states x [m, d].
  torch::Tensor head(torch::Tensor x) {
    TORCH_CHECK(head_weight_.defined(), "no head set");
    x = x.contiguous();
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == head_weight_.size(1),
                "head input: fp32 [m, d]");
    auto y = torch::empty({x.size(0), head_weight_.size(0)}, x.options());
    i8_gemm(*workers_, x.data_ptr<float>(), x.size(0), head_weight_.data_ptr<int8_t>(), head_scale_.data_ptr<float>(),
            head_weight_.size(0), head_weight_.size(1), y.data_ptr<float>());
    return y;
  }

  // x [tokens, d] fp32, updated in place; cos/sin [tokens, head_dim]; slots [tokens] int64;
  // tables [rows, width] int32; context_lens [tokens] int32; kpool/vpool this layer's [slots, kv_heads, head_dim].
  void forward(int64_t index, torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
               torch::Tensor tables, torch::Tensor context_lens, int64_t tokens_per_row, torch::Tensor kpool,
               torch::Tensor vpool, int64_t block_size) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32");
    TORCH_CHECK(kpool.is_contiguous() && vpool.is_contiguous(), "K/V pools: contiguous");
    const Layer& L = layers_.at(index);
    const int64_t tokens = x.size(0), d = x.size(1);
    const int64_t q_width = heads_ * hd_, kv_width = kv_heads_ * hd_, qkv_width = q_width + 2 * kv_width;
    const Q4Matrix qkv = matrix(L.qkv, L.qkv_bias), o = matrix(L.o, L.o_bias);
    const Q4Matrix gate_up = matrix(L.gate_up, L.gate_up_bias), down = matrix(L.down, L.down_bias);
    const int64_t ffn = gate_up.n / 2;

    float* h = x.data_ptr<float>();
    std::vector<float> normed(tokens * d), qkv_out(tokens * qkv_width), attended(tokens * q_width);
    std::vector<float> projected(tokens * std::max(d, gate_up.n));
    Activations acts;
    acts.q8 = q8_;

    rms_norm(h, L.input_norm.data_ptr<float>(), eps_, tokens, d, normed.data());
    acts.quantize(normed.data(), tokens, d);
    q4_gemm(*workers_, acts, qkv, qkv_out.data());
    rope(qkv_out.data(), tokens, qkv_width, heads_ + kv_heads_, hd_, cos.data_ptr<float>(), sin.data_ptr<float>());

    const int64_t* slot = slots.data_ptr<int64_t>();
    const int32_t* table = tables.data_ptr<int32_t>();
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    auto run = [&](auto zero) {
      using scalar_t = decltype(zero);
      write_kv<scalar_t>(qkv_out.data(), tokens, qkv_width, q_width, kv_width, slot, kpool.data_ptr<scalar_t>(),
                         vpool.data_ptr<scalar_t>());
      attend<scalar_t>(*workers_, qkv_out.data(), tokens, qkv_width, heads_, kv_heads_, hd_, kpool.data_ptr<scalar_t>(),
                       vpool.data_ptr<scalar_t>(), table, tables.size(1), lens, tokens_per_row, block_size,
                       attended.data());
        };
    switch (kpool.scalar_type()) {
      case at::kFloat: run(float{}); break;
      case at::kBFloat16: run(c10::BFloat16{}); break;
      case at::kHalf: run(c10::Half{}); break;
      default: TORCH_CHECK(false, "K/V pool: fp32, bf16 or fp16, not ", kpool.scalar_type());
    }

    acts.quantize(attended.data(), tokens, q_width);
    q4_gemm(*workers_, acts, o, projected.data());
    for (int64_t i = 0; i < tokens * d; ++i) h[i] += projected[i];

    rms_norm(h, L.post_norm.data_ptr<float>(), eps_, tokens, d, normed.data());
    acts.quantize(normed.data(), tokens, d);
    q4_gemm(*workers_, acts, gate_up, projected.data());
    std::vector<float> gated(tokens * ffn);
    for (int64_t t = 0; t < tokens; ++t) {
      const float* g = projected.data() + t * gate_up.n;
      silu_mul(g, g + ffn, ffn, gated.data() + t * ffn);
    }
    acts.quantize(gated.data(), tokens, ffn);
    q4_gemm(*workers_, acts, down, projected.data());
    for (int64_t i = 0; i < tokens * d; ++i) h[i] += projected[i];
  }

 private:
  int64_t heads_, kv_heads_, hd_;
  float eps_;
  bool q8_;
  std::unique_ptr<Workers> workers_;
  std::vector<Layer> layers_;
  torch::Tensor head_weight_, head_scale_;
};

// The pieces alone (tests) share two threads.
Workers& test_workers() {
  static Workers workers(1);
  return workers;
}

// x [m, k] fp32 times a q4 matrix.
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor pairs, c10::optional<torch::Tensor> bias, bool q8) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x: fp32 [m, k]");
  x = x.contiguous();
  const Q4Matrix w = matrix(pairs, bias);
  TORCH_CHECK(x.size(1) == w.k, "x has ", x.size(1), " columns, the weights ", w.k);
  Activations acts;
  acts.q8 = q8;
  acts.quantize(x.data_ptr<float>(), x.size(0), x.size(1));
  auto y = torch::empty({x.size(0), w.n}, x.options());
  q4_gemm(test_workers(), acts, w, y.data_ptr<float>());
  return y;
}

// Attention alone (tests): q [tokens, heads, head_dim] fp32 over the pools [slots, kv_heads, head_dim].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kpool, torch::Tensor vpool, torch::Tensor tables,
                              torch::Tensor context_lens, int64_t tokens_per_row, int64_t block_size) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3, "q: fp32 [tokens, heads, head_dim]");
  q = q.contiguous();
  const int64_t tokens = q.size(0), heads = q.size(1), hd = q.size(2), kv_heads = kpool.size(1);
  auto out = torch::empty_like(q);
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    attend<scalar_t>(test_workers(), q.data_ptr<float>(), tokens, heads * hd, heads, kv_heads, hd, kpool.data_ptr<scalar_t>(),
                     vpool.data_ptr<scalar_t>(), tables.data_ptr<int32_t>(), tables.size(1),
                     context_lens.data_ptr<int32_t>(), tokens_per_row, block_size, out.data_ptr<float>());
  };
  switch (kpool.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "K/V pool: fp32, bf16 or fp16, not ", kpool.scalar_type());
  }
  return out;
}

std::string simd() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512-vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<FusedLayers>(m, "FusedLayers")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, bool, int64_t>())
      .def("add_layer", &FusedLayers::add_layer)
      .def("set_head", &FusedLayers::set_head)
      .def("head", &FusedLayers::head, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward", &FusedLayers::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q4_linear", &q4_linear);
  m.def("paged_attention", &paged_attention);
  m.def("simd", &simd);
}
