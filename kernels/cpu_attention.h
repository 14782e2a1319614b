// The fused CPU layer's attention (cpu_decode.cpp): the new tokens' K/V written
// into the paged pool and flash-decoding attention over it (fp32, bf16 or fp16
// pools; fp32 math).

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

namespace cpu_decode {

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename KV>
inline void write_kv(const float* qkv, int64_t rows, int64_t row_stride, int64_t k_offset, int64_t kv_width,
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

#if defined(__AVX512F__)
// 1 / (1 + e^-x), from e^-|x| (never overflows): 1 / (1 + e) for x >= 0, e / (1 + e) below.
inline __m512 sigmoid512(__m512 x) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 one = _mm512_set1_ps(1.f);
  return _mm512_div_ps(_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), one, e),
                       _mm512_add_ps(one, e));
}
#endif

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// s -> cap * tanh(s / cap) in place (Gemma 2's attention scores): tanh(y) = 2 sigmoid(2y) - 1.
inline void soft_cap(float* s, int64_t n, float cap) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 c = _mm512_set1_ps(cap), two_over_c = _mm512_set1_ps(2.f / cap), one = _mm512_set1_ps(1.f);
  for (; j + 16 <= n; j += 16) {
    const __m512 sig = sigmoid512(_mm512_mul_ps(_mm512_loadu_ps(s + j), two_over_c));
    _mm512_storeu_ps(s + j, _mm512_mul_ps(c, _mm512_fmsub_ps(_mm512_set1_ps(2.f), sig, one)));
  }
#endif
  for (; j < n; ++j) s[j] = cap * (2.f * sigmoid(2.f * s[j] / cap) - 1.f);
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
// positions of its row, read through the row's block table, or with a `window`
// only the last `window` of them; fp32 math. softcap > 0: scores s (scaled by
// 1 / sqrt(hd)) become softcap * tanh(s / softcap) before the softmax.
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
inline void attend(Workers& workers, const float* qkv, int64_t rows, int64_t row_stride, int64_t heads, int64_t kv_heads,
            int64_t hd,
            const KV* kpool, const KV* vpool, const int32_t* tables, int64_t table_width,
            const int32_t* context_lens, int64_t tokens_per_row, int64_t block_size, int64_t window, float softcap,
            float* out) {
  const int64_t group = heads / kv_heads, kv_stride = kv_heads * hd, seqs = rows / tokens_per_row;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  // Token t reads positions [key_begin[t], context_lens[t]): all before it, or its window's.
  std::vector<int64_t> key_begin(rows, 0);
  if (window > 0)
    for (int64_t t = 0; t < rows; ++t) key_begin[t] = std::max<int64_t>(0, context_lens[t] - window);
  // A row's span: from the first block any of its tokens reads to the last position.
  std::vector<int64_t> row_first(seqs), row_end(seqs, 0);
  int64_t longest = 1;
  for (int64_t seq = 0; seq < seqs; ++seq) {
    int64_t lo = key_begin[seq * tokens_per_row];
    for (int64_t t = seq * tokens_per_row; t < (seq + 1) * tokens_per_row; ++t) {
      lo = std::min(lo, key_begin[t]);
      row_end[seq] = std::max<int64_t>(row_end[seq], context_lens[t]);
    }
    row_first[seq] = lo / block_size * block_size;
    longest = std::max(longest, row_end[seq] - row_first[seq]);
  }
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
      const int64_t first = row_first[seq] + part * span_blocks * block_size;
      const int64_t last = std::min(row_end[seq], first + span_blocks * block_size);
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
          if (j >= context_lens[t0 + u] || j + n4 <= key_begin[t0 + u]) continue;  // outside this token's keys
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
        // this token's positions here: [from, from + mine)
        const int64_t from = std::max(first, key_begin[t0 + u]);
        const int64_t mine = std::min<int64_t>(last, context_lens[t0 + u]) - from;
        if (mine <= 0) continue;
        const int64_t at = ((t0 + u) * parts + part) * heads;
        for (int64_t h = 0; h < heads; ++h) {
          float* sc = scores.data() + (u * heads + h) * count + (from - first);
          if (softcap > 0.f) soft_cap(sc, mine, softcap);
          float top = -INFINITY;
          for (int64_t j = 0; j < mine; ++j) top = std::max(top, sc[j]);
          part_max[at + h] = top;
          part_sum[at + h] = exp_shifted(sc, mine, top);
          weighted_sum(sc, vrows.data() + (from - first), mine, (h / group) * hd, hd, part_acc.data() + (at + h) * hd);
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

}  // namespace cpu_decode
