// The decoder layers of one CPU decode step (Llama family) in one call: the same ops, in the same
// order and with the same arguments, as srt/model_executor/cpu_decode_runner.py's Python loop, so
// the hidden states are bit-identical to it; what goes is the interpreter between the ops (about a
// dozen op calls, views and wrapper frames a layer). Each op is called through the dispatcher by
// name: the kernels live in the other translation units of this library (and oneDNN's in torch).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// How one linear layer runs, as CpuDecodeRunner binds it (`_LinearSpec.kind` there).
enum LinearKind : int64_t {
  kPanels = 0,  // srt_cpu::weight_packed_linear(x, panels, bias, out_features, x's dtype)
  kAmx = 1,     // srt_cpu::amx_linear(x, tiles, bias, None)
  kDense = 2,   // srt_cpu::dense_linear(x, weight, bias): fp32, at most the kernel's rows
  kOneDnn = 3,  // mkldnn::_linear_pointwise(x, packed, bias, "none", [], "")
  kPlain = 4,   // at::linear(x, weight, bias)
  kOneDnnCast = 5,  // oneDNN's layout in another dtype (bf16 widened): x and bias cast to it, the output back
};

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using T = at::Tensor;
using NormFn = std::tuple<T, T>(const T&, const OptTensor&, const T&, double);
using RopeFn = std::tuple<T, T>(const T&, const T&, const T&, const T&, const T&);
using StoreFn = void(const T&, const T&, const T&, const T&, const T&);
using UnaryFn = T(const T&);
using DecodeFn = T(const T&, const T&, const T&, const T&, const T&, const T&, double, bool, bool);
using PanelsFn = T(const T&, const T&, const OptTensor&, int64_t, std::optional<at::ScalarType>);

struct Ops {
  c10::TypedOperatorHandle<NormFn> rms_norm = op<NormFn>("srt_cpu::rms_norm");
  c10::TypedOperatorHandle<RopeFn> rotary = op<RopeFn>("srt_cpu::rotary_embedding");
  c10::TypedOperatorHandle<StoreFn> store_kv = op<StoreFn>("srt_cpu::store_kv");
  c10::TypedOperatorHandle<UnaryFn> silu_and_mul = op<UnaryFn>("srt_cpu::silu_and_mul");
  c10::TypedOperatorHandle<DecodeFn> decode = op<DecodeFn>("srt_cpu::paged_decode_attention");
  c10::TypedOperatorHandle<PanelsFn> panels = op<PanelsFn>("srt_cpu::weight_packed_linear");
};

// Ops that only some builds or CPUs have are looked up on first use.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& w, const OptTensor& bias) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, std::optional<at::ScalarType>)>(
          "srt_cpu::amx_linear");
  return handle.call(x, w, bias, std::nullopt);
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const OptTensor& bias) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>("srt_cpu::dense_linear");
  return handle.call(x, w, bias);
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const OptTensor& bias) {
  static const auto handle =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view,
                    c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>(
          "mkldnn::_linear_pointwise");
  return handle.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

const Ops& ops() {
  static const Ops instance;
  return instance;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const OptTensor& bias, int64_t kind, int64_t n) {
  switch (kind) {
    case kPanels: return ops().panels.call(x, w, bias, n, x.scalar_type());
    case kAmx: return amx_linear(x, w, bias);
    case kDense: return dense_linear(x, w, bias);
    case kOneDnn: return onednn_linear(x, w, bias);
    case kPlain: return at::linear(x, w, bias);
    case kOneDnnCast: {
      const OptTensor b = bias.has_value() ? OptTensor(bias->to(w.scalar_type())) : std::nullopt;
      return onednn_linear(x.to(w.scalar_type()).contiguous(), w, b).to(x.scalar_type());
    }
    default: TORCH_CHECK(false, "decode_layers: unknown linear kind ", kind);
  }
}

// hidden [bs, hidden] (the embeddings) through every layer; returns (hidden, residual) before the
// final norm. Per layer l: norms[2l], norms[2l + 1] (input / post-attention RMSNorm weights) and
// eps[2l], eps[2l + 1]; weights[4l + i], biases[4l + i], kinds[4l + i], out_features[4l + i] for
// i = qkv, o_proj, gate_up, down; cos[l], sin[l]; its KV buffers k_buffers[layer_ids[l]].
// `kv_dtype`: the pool's dtype where it differs from the activations' (K/V cast on store).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, const at::Tensor& positions, const at::Tensor& out_cache_loc,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
    at::TensorList k_buffers, at::TensorList v_buffers, at::IntArrayRef layer_ids, at::TensorList norms,
    at::ArrayRef<double> eps, at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
    at::IntArrayRef kinds, at::IntArrayRef out_features, at::TensorList cos, at::TensorList sin, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scaling, std::optional<at::ScalarType> kv_dtype) {
  const int64_t layers = static_cast<int64_t>(layer_ids.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(eps.size()) == 2 * layers,
              "decode_layers: two norms and two eps per layer: ", layers, " layers need ", 2 * layers, ", got ",
              norms.size(), " norms and ", eps.size(), " eps");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * layers && static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(kinds.size()) == 4 * layers &&
                  static_cast<int64_t>(out_features.size()) == 4 * layers,
              "decode_layers: four linears (weight, bias, kind, out_features) per layer: ", layers, " layers need ",
              4 * layers, " of each, got ", weights.size(), ", ", biases.size(), ", ", kinds.size(), ", ",
              out_features.size());
  TORCH_CHECK(static_cast<int64_t>(cos.size()) == layers && static_cast<int64_t>(sin.size()) == layers,
              "decode_layers: one cos and one sin table per layer: ", layers, " layers, got ", cos.size(), " and ",
              sin.size());
  for (int64_t kind : kinds) {
    TORCH_CHECK(kind >= kPanels && kind <= kOneDnnCast, "decode_layers: unknown linear kind ", kind,
                " (kinds are ", static_cast<int64_t>(kPanels), " to ", static_cast<int64_t>(kOneDnnCast), ")");
  }
  for (int64_t id : layer_ids) {
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(k_buffers.size()) && id < static_cast<int64_t>(v_buffers.size()),
                "decode_layers: layer id ", id, " has no KV buffer (",
                k_buffers.size(), " K and ", v_buffers.size(), " V buffers)");
  }
  const Ops& o = ops();
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const std::vector<int64_t> split{q_size, kv_size, kv_size};
  at::Tensor hidden = hidden_in;
  at::Tensor residual;
  for (int64_t l = 0; l < layers; ++l) {
    if (l == 0) {
      residual = hidden;
      hidden = std::get<0>(o.rms_norm.call(hidden, std::nullopt, norms[0], eps[0]));
    } else {
      std::tie(hidden, residual) = o.rms_norm.call(hidden, residual, norms[2 * l], eps[2 * l]);
    }
    const int64_t w = 4 * l;
    const std::vector<at::Tensor> qkv =
        linear(hidden, weights[w], biases.get(w), kinds[w], out_features[w]).split_with_sizes(split, -1);
    at::Tensor q = qkv[0].reshape({-1, num_heads, head_dim});
    at::Tensor k = qkv[1].reshape({-1, num_kv_heads, head_dim});
    std::tie(q, k) = o.rotary.call(positions, q, k, cos[l], sin[l]);
    const at::Tensor& k_buffer = k_buffers[layer_ids[l]];
    const at::Tensor& v_buffer = v_buffers[layer_ids[l]];
    at::Tensor v = qkv[2].reshape({-1, num_kv_heads, head_dim});
    if (kv_dtype.has_value()) {
      k = k.to(*kv_dtype);
      v = v.to(*kv_dtype);
    }
    o.store_kv.call(k_buffer, v_buffer, out_cache_loc, k, v);
    q = q.reshape({-1, q_size}).reshape({-1, num_heads, head_dim});
    const at::Tensor out =
        o.decode.call(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scaling, true, true);
    hidden = linear(out.view({-1, q_size}), weights[w + 1], biases.get(w + 1), kinds[w + 1], out_features[w + 1]);
    std::tie(hidden, residual) = o.rms_norm.call(hidden, residual, norms[2 * l + 1], eps[2 * l + 1]);
    const at::Tensor gate_up = linear(hidden, weights[w + 2], biases.get(w + 2), kinds[w + 2], out_features[w + 2]);
    hidden = linear(o.silu_and_mul.call(gate_up), weights[w + 3], biases.get(w + 3), kinds[w + 3], out_features[w + 3]);
  }
  return {hidden, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor positions, Tensor out_cache_loc, Tensor req_to_token, "
      "Tensor req_pool_indices, Tensor seq_lens, Tensor[] k_buffers, Tensor[] v_buffers, int[] layer_ids, "
      "Tensor[] norms, float[] eps, Tensor[] weights, Tensor?[] biases, int[] kinds, int[] out_features, "
      "Tensor[] cos, Tensor[] sin, int num_heads, int num_kv_heads, int head_dim, float scaling, "
      "ScalarType? kv_dtype) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
// Weights in oneDNN's packed layout are MkldnnCPU tensors: the call dispatches on that key then.
TORCH_LIBRARY_IMPL(srt_cpu, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
