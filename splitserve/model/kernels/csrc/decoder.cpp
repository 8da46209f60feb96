// The exact path's decoder layers in one call: per layer, residual + RMSNorm, the fused QKV
// projection, rotary + KV write, paged attention, the output projection, residual + RMSNorm,
// gate/up, SiLU * up, down. The same kernels as the per-module path, called in the same
// order on the same operands, so the bits are the same; what goes is Python's cost around
// them (module calls, wrappers, ~10 us per op, ~270 ops per decode step), and the GIL is
// released while the layers run, so the worker's other threads (KV streaming, control)
// keep going during a long prefill.
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "ops.h"

namespace {

constexpr size_t kPerLayer = 14;  // 2 norm weights + 4 projections x (weight, scale, bias)

// A packed projection (bf16, or int8 with per-column scales) and its bias, if any.
struct Proj {
  at::Tensor weight;
  c10::optional<at::Tensor> scale, bias;

  static c10::optional<at::Tensor> present(const at::Tensor& t) {
    return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
  }
  explicit Proj(const at::Tensor* t) : weight(t[0]), scale(present(t[1])), bias(present(t[2])) {}

  at::Tensor operator()(const at::Tensor& x, int64_t N) const {
    return linear(x, weight, N, bias, scale);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Proj qkv, o, gate_up, down;
};

}  // namespace

class ExactDecoder {
 public:
  // tensors: per layer, in order: input norm weight, post-attention norm weight, then for
  // QKV, O, gate/up and down: the packed weight, its fp32 scales (int8 weights) and its fp32
  // bias, each an empty tensor when absent. scale: the attention's softmax scale
  // (head_dim ** -0.5, from Python's float).
  ExactDecoder(const std::vector<at::Tensor>& tensors, int64_t hidden, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               double scale)
      : hidden_(hidden), heads_(num_heads), qkv_out_((num_heads + 2 * num_kv_heads) * head_dim),
        intermediate_(intermediate), eps_(eps), scale_(scale) {
    TORCH_CHECK(tensors.size() % kPerLayer == 0, "ExactDecoder: 14 tensors per layer");
    for (size_t i = 0; i < tensors.size(); i += kPerLayer) {
      const at::Tensor* t = tensors.data() + i;
      layers_.push_back(Layer{t[0], t[1], Proj(t + 2), Proj(t + 5), Proj(t + 8), Proj(t + 11)});
    }
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

  // Layers [begin, end) over a step. x [T, hidden] bf16: the layer input (the embedding,
  // or the previous layer's MLP output); residual: the residual stream before it (none
  // before layer 0). cos, sin [T, head_dim] bf16; kv_cache [layers, 2, NBLK, BS, HKV, D].
  // Returns (the last layer's MLP output, the residual stream before it).
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& cos,
      const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
      const at::Tensor& block_tables, const at::Tensor& token_seq,
      const at::Tensor& context_lens, int64_t begin, int64_t end) const {
    TORCH_CHECK(0 <= begin && begin < end && end <= num_layers(), "layers out of range");
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == num_layers(),
                "kv_cache must be [layers, 2, NBLK, BS, HKV, D]");
    const int64_t T = x.size(0);
    for (int64_t i = begin; i < end; ++i) {
      const Layer& l = layers_[i];
      at::Tensor kv_layer = kv_cache.select(0, i);
      auto [h, res] = rms_norm(x, l.input_norm, eps_, residual);
      at::Tensor qkv = l.qkv(h, qkv_out_);
      at::Tensor q = rope_write_kv(qkv, cos, sin, kv_layer, slot_mapping, heads_);
      at::Tensor attn = paged_attention(q, kv_layer, block_tables, token_seq, context_lens,
                                        scale_);
      at::Tensor o = l.o(attn.view({T, -1}), hidden_);
      auto [h2, res2] = rms_norm(o, l.post_norm, eps_, res);
      at::Tensor act = silu_mul(l.gate_up(h2, 2 * intermediate_));
      x = l.down(act, hidden_);
      residual = res2;
    }
    return {x, *residual};
  }

 private:
  std::vector<Layer> layers_;
  int64_t hidden_, heads_, qkv_out_, intermediate_;
  double eps_, scale_;
};

void register_decoder(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<ExactDecoder>(m, "ExactDecoder")
      .def(py::init<const std::vector<at::Tensor>&, int64_t, int64_t, int64_t, int64_t,
                    int64_t, double, double>())
      .def("num_layers", &ExactDecoder::num_layers)
      .def("forward", &ExactDecoder::forward, py::call_guard<py::gil_scoped_release>());
}
