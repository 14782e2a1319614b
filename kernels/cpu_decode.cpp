// A decoder layer for CPU passes of a few tokens (decode, verify, a keystroke's
// prefill), in one call: the norms, 4-bit projections, RoPE, the K/V write,
// attention over the paged pool, the MLP. Built at first use by cpu_decode.py
// (torch.utils.cpp_extension), once per feature level (cpu_levels.py: scalar,
// avx2, avx512), each with its explicit flags.
//
// The families' differences (completer/model.py's ModelConfig) are options, each
// one generic path: per model the norm (RMSNorm, or LayerNorm with a bias), the
// activation (SiLU, GELU's tanh approximation, GELU), a gated or plain MLP and
// soft-capped attention scores; per layer RMSNorms over each q and k head before
// RoPE, sandwich norms (attention's and the MLP's outputs normed before their
// residual adds; the MLP's input norm is then pre_feedforward_layernorm) and a
// sliding window. Biases on any projection or norm; each layer's cos/sin come
// from Python (Gemma 3's sliding layers rotate with their own frequencies).
//
// Why: such a pass is bound by streaming the weights (~2 MB a layer at 4 bits),
// but through torch's ops it is ~15 dispatches a layer at 10-30 us each, more
// than the weights take to stream.
//
// The 4-bit GEMM is GGUF Q4_1's math with Q8 activations (engine.fused_cpu_q8), as llama.cpp's CPU
// backend does it: a block of 32 weights w = q * d + m (q in 0..15, d and m
// fp16) against 32 activations x ~= qx * dx (qx int8) gives
//   sum(w x) ~= d * dx * sum(q qx) + m * sum(x),
// the integer sum on AVX512-VNNI (dpbusd: u8 x s8; COMPLETER_TILES), AVX2 (maddubs) or plain C.
// sum(x) is taken from the unquantized activations.
//
// The pieces: cpu_gemm.h (the projections and the head), cpu_attention.h
// (the K/V write and attention, sigmoid), here the layer, norms, RoPE, the MLP's
// activation and the bindings.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_attention.h"
#include "cpu_gemm.h"
#include "cpu_workers.h"

namespace {

using namespace cpu_decode;

// What differs between model families, set per model (constructor) or per layer (add_layer).
enum class NormKind { Rms, Layer };         // RMSNorm, or LayerNorm (with a bias: StarCoder2)
enum class Activation { Silu, GeluTanh, Gelu };  // Gelu: erf's, exact

// A weight and its bias, if any, as Python passes them: (tensor, tensor or None).
using WeightArg = std::tuple<torch::Tensor, c10::optional<torch::Tensor>>;

struct Weights {
  torch::Tensor weight;  // undefined: none (an optional norm the layer does not have)
  torch::Tensor bias;    // undefined: none

  Weights() = default;
  explicit Weights(const WeightArg& arg) : weight(std::get<0>(arg).contiguous()) {
    if (std::get<1>(arg) && std::get<1>(arg)->defined()) bias = std::get<1>(arg)->contiguous();
  }
  explicit Weights(const c10::optional<WeightArg>& arg) {
    if (arg) *this = Weights(*arg);
  }
  bool present() const { return weight.defined(); }
  const float* bias_data() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
  Q4Matrix matrix() const { return cpu_decode::matrix(weight, bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt); }
};

// RMSNorm of `rows` rows of width d (in place where out == x): x / rms(x) * weight (+ bias).
void rms_norm(const float* x, const float* weight, const float* bias, float eps, int64_t rows, int64_t d, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / d + eps);
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = xr[i] * inv * weight[i] + (bias ? bias[i] : 0.f);
  }
}

// LayerNorm (torch's: biased variance): (x - mean) / sqrt(var + eps) * weight (+ bias).
void layer_norm(const float* x, const float* weight, const float* bias, float eps, int64_t rows, int64_t d, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float mean = 0.f, var = 0.f;
    for (int64_t i = 0; i < d; ++i) mean += xr[i];
    mean /= d;
    for (int64_t i = 0; i < d; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const float inv = 1.f / std::sqrt(var / d + eps);
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = (xr[i] - mean) * inv * weight[i] + (bias ? bias[i] : 0.f);
  }
}

void norm(NormKind kind, const Weights& w, float eps, const float* x, int64_t rows, int64_t d, float* out) {
  (kind == NormKind::Layer ? layer_norm : rms_norm)(x, w.weight.data_ptr<float>(), w.bias_data(), eps, rows, d, out);
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

// The MLP's activation: out[i] = act(x[i]) * u[i] (gated: x the gate's outputs, u the up
// projection's), or act(x[i]) (u null: a plain MLP). SiLU is x sigmoid(x) and GELU's tanh
// approximation 0.5 x (1 + tanh(z)) = x sigmoid(2z), z = sqrt(2 / pi) (x + 0.044715 x^3).
constexpr float GELU_2Z = 1.5957691216057308f;  // 2 sqrt(2 / pi)

inline void activate(Activation act, const float* x, const float* u, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (act != Activation::Gelu) {
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      __m512 arg = v;
      if (act == Activation::GeluTanh)
        arg = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(GELU_2Z)),
                            _mm512_fmadd_ps(_mm512_mul_ps(v, v), _mm512_set1_ps(0.044715f), _mm512_set1_ps(1.f)));
      __m512 y = _mm512_mul_ps(v, sigmoid512(arg));
      if (u) y = _mm512_mul_ps(y, _mm512_loadu_ps(u + i));
      _mm512_storeu_ps(out + i, y);
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    float y;
    switch (act) {
      case Activation::Silu: y = v * sigmoid(v); break;
      case Activation::GeluTanh: y = v * sigmoid(GELU_2Z * v * (1.f + 0.044715f * v * v)); break;
      default: y = 0.5f * v * (1.f + std::erf(v * static_cast<float>(M_SQRT1_2))); break;
    }
    out[i] = u ? y * u[i] : y;
  }
}

NormKind norm_kind(const std::string& name) {
  if (name == "rms") return NormKind::Rms;
  if (name == "layer") return NormKind::Layer;
  TORCH_CHECK(false, "no ", name, " norm (it has rms, layer)");
}

Activation activation(const std::string& name) {
  if (name == "silu") return Activation::Silu;
  if (name == "gelu_tanh") return Activation::GeluTanh;
  if (name == "gelu") return Activation::Gelu;
  TORCH_CHECK(false, "no ", name, " activation (it has silu, gelu_tanh, gelu)");
}

bool gated_mlp(const std::string& name) {
  TORCH_CHECK(name == "gated" || name == "plain", "no ", name, " MLP (it has gated, plain)");
  return name == "gated";
}

}  // namespace

// One layer's weights and options, held for the model's life.
struct Layer {
  Weights input_norm, mlp_norm;        // before attention, before the MLP
  Weights attn_out_norm, mlp_out_norm;  // sandwich norms (Gemma 2, 3): attention's and the MLP's outputs
  torch::Tensor q_norm, k_norm;        // RMSNorm weights over each q and k head before RoPE (Qwen3, Gemma 3)
  Weights qkv, o, up, down;            // q4 pairs or tiles; up: the gate's and up's rows side by side when gated
  int64_t window = 0;                  // keys each query reads back, its own included (0: all)
};

class FusedLayers {
 public:
  // q8: activations quantized to 8 bits for the 4-bit GEMMs (llama.cpp's math), else fp32.
  // threads: the calling thread and threads - 1 helpers of its own. norm: "rms" or "layer";
  // activation: "silu", "gelu_tanh" or "gelu"; mlp: "gated" or "plain" (ModelConfig's names);
  // softcap > 0: attention scores capped (Gemma 2).
  FusedLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, bool q8, int64_t threads,
              const std::string& norm, const std::string& activation_name, const std::string& mlp, double softcap)
      : heads_(heads), kv_heads_(kv_heads), hd_(head_dim), eps_(static_cast<float>(eps)), q8_(q8),
        norm_(norm_kind(norm)), act_(activation(activation_name)), gated_(gated_mlp(mlp)),
        softcap_(static_cast<float>(softcap)),
        workers_(std::make_unique<Workers>(static_cast<int>(std::max<int64_t>(threads, 1) - 1))) {}

  void add_layer(const WeightArg& input_norm, const WeightArg& qkv, const WeightArg& o, const WeightArg& mlp_norm,
                 const WeightArg& up, const WeightArg& down, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, c10::optional<WeightArg> attn_out_norm,
                 c10::optional<WeightArg> mlp_out_norm, int64_t window) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    TORCH_CHECK(attn_out_norm.has_value() == mlp_out_norm.has_value(), "sandwich norms come together");
    Layer layer;
    layer.input_norm = Weights(input_norm);
    layer.mlp_norm = Weights(mlp_norm);
    layer.attn_out_norm = Weights(attn_out_norm);
    layer.mlp_out_norm = Weights(mlp_out_norm);
    if (q_norm) {
      layer.q_norm = q_norm->contiguous();
      layer.k_norm = k_norm->contiguous();
      TORCH_CHECK(layer.q_norm.numel() == hd_ && layer.k_norm.numel() == hd_, "q/k norms: head_dim weights");
    }
    layer.qkv = Weights(qkv);
    layer.o = Weights(o);
    layer.up = Weights(up);
    layer.down = Weights(down);
    layer.window = window;
    layers_.push_back(std::move(layer));
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

  // x [tokens, d] fp32, updated in place; cos/sin [tokens, head_dim] (this layer's frequencies);
  // slots [tokens] int64; tables [rows, width] int32; context_lens [tokens] int32;
  // kpool/vpool this layer's [slots, kv_heads, head_dim].
  void forward(int64_t index, torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
               torch::Tensor tables, torch::Tensor context_lens, int64_t tokens_per_row, torch::Tensor kpool,
               torch::Tensor vpool, int64_t block_size) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32");
    TORCH_CHECK(kpool.is_contiguous() && vpool.is_contiguous(), "K/V pools: contiguous");
    const Layer& L = layers_.at(index);
    const int64_t tokens = x.size(0), d = x.size(1);
    const int64_t q_width = heads_ * hd_, kv_width = kv_heads_ * hd_, qkv_width = q_width + 2 * kv_width;
    const Q4Matrix qkv = L.qkv.matrix(), o = L.o.matrix(), up = L.up.matrix(), down = L.down.matrix();
    const int64_t ffn = gated_ ? up.n / 2 : up.n;

    float* h = x.data_ptr<float>();
    std::vector<float> normed(tokens * d), qkv_out(tokens * qkv_width), attended(tokens * q_width);
    std::vector<float> projected(tokens * std::max(d, up.n));
    Activations acts;
    acts.q8 = q8_;

    norm(norm_, L.input_norm, eps_, h, tokens, d, normed.data());
    acts.quantize(normed.data(), tokens, d);
    q4_gemm(*workers_, acts, qkv, qkv_out.data());
    if (L.q_norm.defined())  // each row's q heads, then its k heads, in place
      for (int64_t r = 0; r < tokens; ++r) {
        float* q = qkv_out.data() + r * qkv_width;
        rms_norm(q, L.q_norm.data_ptr<float>(), nullptr, eps_, heads_, hd_, q);
        rms_norm(q + q_width, L.k_norm.data_ptr<float>(), nullptr, eps_, kv_heads_, hd_, q + q_width);
      }
    rope(qkv_out.data(), tokens, qkv_width, heads_ + kv_heads_, hd_, cos.data_ptr<float>(), sin.data_ptr<float>());

    const int64_t* slot = slots.data_ptr<int64_t>();
    const int32_t* table = tables.data_ptr<int32_t>();
    const int32_t* lens = context_lens.data_ptr<int32_t>();
    auto run = [&](auto zero) {
      using scalar_t = decltype(zero);
      write_kv<scalar_t>(qkv_out.data(), tokens, qkv_width, q_width, kv_width, slot, kpool.data_ptr<scalar_t>(),
                         vpool.data_ptr<scalar_t>());
      attend<scalar_t>(*workers_, qkv_out.data(), tokens, qkv_width, heads_, kv_heads_, hd_, kpool.data_ptr<scalar_t>(),
                       vpool.data_ptr<scalar_t>(), table, tables.size(1), lens, tokens_per_row, block_size, L.window,
                       softcap_, attended.data());
        };
    switch (kpool.scalar_type()) {
      case at::kFloat: run(float{}); break;
      case at::kBFloat16: run(c10::BFloat16{}); break;
      case at::kHalf: run(c10::Half{}); break;
      default: TORCH_CHECK(false, "K/V pool: fp32, bf16 or fp16, not ", kpool.scalar_type());
    }

    acts.quantize(attended.data(), tokens, q_width);
    q4_gemm(*workers_, acts, o, projected.data());
    add_residual(L.attn_out_norm, projected.data(), tokens, d, h);

    norm(norm_, L.mlp_norm, eps_, h, tokens, d, normed.data());
    acts.quantize(normed.data(), tokens, d);
    q4_gemm(*workers_, acts, up, projected.data());
    std::vector<float> activated(tokens * ffn);
    for (int64_t t = 0; t < tokens; ++t) {
      const float* g = projected.data() + t * up.n;
      activate(act_, g, gated_ ? g + ffn : nullptr, ffn, activated.data() + t * ffn);
    }
    acts.quantize(activated.data(), tokens, ffn);
    q4_gemm(*workers_, acts, down, projected.data());
    add_residual(L.mlp_out_norm, projected.data(), tokens, d, h);
  }

 private:
  // h += out [tokens, d], out normed first where the layer has that norm (sandwich norms).
  void add_residual(const Weights& out_norm, float* out, int64_t tokens, int64_t d, float* h) const {
    if (out_norm.present()) norm(norm_, out_norm, eps_, out, tokens, d, out);
    for (int64_t i = 0; i < tokens * d; ++i) h[i] += out[i];
  }

  int64_t heads_, kv_heads_, hd_;
  float eps_;
  bool q8_;
  NormKind norm_;
  Activation act_;
  bool gated_;
  float softcap_;
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
                              torch::Tensor context_lens, int64_t tokens_per_row, int64_t block_size, int64_t window,
                              double softcap) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3, "q: fp32 [tokens, heads, head_dim]");
  q = q.contiguous();
  const int64_t tokens = q.size(0), heads = q.size(1), hd = q.size(2), kv_heads = kpool.size(1);
  auto out = torch::empty_like(q);
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    attend<scalar_t>(test_workers(), q.data_ptr<float>(), tokens, heads * hd, heads, kv_heads, hd, kpool.data_ptr<scalar_t>(),
                     vpool.data_ptr<scalar_t>(), tables.data_ptr<int32_t>(), tables.size(1),
                     context_lens.data_ptr<int32_t>(), tokens_per_row, block_size, window,
                     static_cast<float>(softcap), out.data_ptr<float>());
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
#if COMPLETER_TILES
  return "avx512-vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// Whether this build multiplies weights in VNNI tiles (else only pairs): what Python packs.
bool tiles_available() { return COMPLETER_TILES; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  // module_local: each level's build is its own module in one process (tests load all three).
  pybind11::class_<FusedLayers>(m, "FusedLayers", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, double, bool, int64_t, const std::string&, const std::string&,
                          const std::string&, double>(),
           arg("heads"), arg("kv_heads"), arg("head_dim"), arg("eps"), arg("q8"), arg("threads"), pybind11::kw_only(),
           arg("norm") = "rms", arg("activation") = "silu", arg("mlp") = "gated", arg("softcap") = 0.0)
      .def("add_layer", &FusedLayers::add_layer, arg("input_norm"), arg("qkv"), arg("o"), arg("mlp_norm"), arg("up"),
           arg("down"), pybind11::kw_only(), arg("q_norm") = pybind11::none(), arg("k_norm") = pybind11::none(),
           arg("attn_out_norm") = pybind11::none(), arg("mlp_out_norm") = pybind11::none(), arg("window") = 0)
      .def("set_head", &FusedLayers::set_head)
      .def("head", &FusedLayers::head, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward", &FusedLayers::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q4_linear", &q4_linear);
  m.def("paged_attention", &paged_attention, arg("q"), arg("kpool"), arg("vpool"), arg("tables"), arg("context_lens"),
        arg("tokens_per_row"), arg("block_size"), arg("window") = 0, arg("softcap") = 0.0);
  m.def("simd", &simd);
  m.def("tiles_available", &tiles_available);
}
