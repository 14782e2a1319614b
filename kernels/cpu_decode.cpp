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
//
// The pieces: cpu_gemm.h (the projections and the head), cpu_attention.h
// (the K/V write and attention), here the layer, norms, RoPE, the MLP's
// activation and the bindings.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_attention.h"
#include "cpu_gemm.h"
#include "cpu_workers.h"

namespace {

using namespace cpu_decode;

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
