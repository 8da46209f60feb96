// The exact path's decoder layers in one call: per layer, residual + RMSNorm, the fused QKV
// projection, rotary + KV write, paged attention, the output projection, residual + RMSNorm,
// gate/up, SiLU * up, down. The same kernels as the per-module path, called in the same
// order on the same operands, so the bits are the same; what goes is Python's cost around
// them (module calls, wrappers, ~10 us per op, ~270 ops per decode step), and the GIL is
// released while the layers run, so the worker's other threads (KV streaming, control)
// keep going during a long prefill. The operands are checked once per call and the layers
// run the ops' raw forms (ops.h) over one workspace: no tensor is made per layer (that
// was ~2 ms of a one-token step's 17 on a Zen 1, ~2-4 us of aten dispatch per tensor).
// The workspace is kept between calls (grown when a step needs more): a step that runs
// its layers one call each (a layer hook streaming KV out) allocated ~9 MB per layer at
// 512 tokens, fresh pages the allocator handed back and forth, 18 ms of a 190 ms prefill.
#include <torch/extension.h>

#include <mutex>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

using exact::bf16_t;

constexpr size_t kPerLayer = 14;  // 2 norm weights + 4 projections x (weight, scale, bias)

c10::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// A packed projection (bf16, or int8 with per-column scales) and its bias, if any: the
// tensors are kept alive here, their checked pointers in `w`.
struct Proj {
  at::Tensor weight, scale, bias;
  exact::PackedLinear w;
  Proj(const at::Tensor* t, int64_t K, int64_t N)
      : weight(t[0]), scale(t[1]), bias(t[2]),
        w(exact::packed_linear(t[0], K, N, present(t[2]), present(t[1]))) {}
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Proj qkv, o, gate_up, down;
};

const bf16_t* cdata(const at::Tensor& t) { return reinterpret_cast<const bf16_t*>(t.data_ptr()); }
bf16_t* data(at::Tensor& t) { return reinterpret_cast<bf16_t*>(t.data_ptr()); }

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
      : hidden_(hidden), heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim),
        qkv_out_((num_heads + 2 * num_kv_heads) * head_dim), intermediate_(intermediate),
        eps_((float)eps), scale_((float)scale) {
    TORCH_CHECK(tensors.size() % kPerLayer == 0, "ExactDecoder: 14 tensors per layer");
    TORCH_CHECK(hidden % 16 == 0 && intermediate % 16 == 0, "ExactDecoder: sizes % 16");
    const int64_t q_out = num_heads * head_dim;
    for (size_t i = 0; i < tensors.size(); i += kPerLayer) {
      const at::Tensor* t = tensors.data() + i;
      for (int k = 0; k < 2; ++k)
        TORCH_CHECK(t[k].scalar_type() == at::kBFloat16 && t[k].is_contiguous() &&
                    t[k].numel() == hidden, "norm weights must be contiguous bfloat16 [hidden]");
      layers_.push_back(Layer{t[0], t[1], Proj(t + 2, hidden, qkv_out_), Proj(t + 5, q_out, hidden),
                              Proj(t + 8, hidden, 2 * intermediate),
                              Proj(t + 11, intermediate, hidden)});
    }
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

  // Layers [begin, end) over a step. x [T, hidden] bf16: the layer input (the embedding,
  // or the previous layer's MLP output); residual: the residual stream before it (none
  // before layer 0). cos, sin [T, head_dim] bf16; kv_cache [layers, 2, NBLK, BS, HKV, D].
  // Returns (the last layer's MLP output, the residual stream before it).
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& cos,
      const at::Tensor& sin, at::Tensor& kv_cache, const at::Tensor& slot_mapping,
      const at::Tensor& block_tables, const at::Tensor& token_seq,
      const at::Tensor& context_lens, int64_t begin, int64_t end) const {
    TORCH_CHECK(0 <= begin && begin < end && end <= num_layers(), "layers out of range");
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == num_layers() &&
                kv_cache.is_contiguous(), "kv_cache must be contiguous [layers, 2, NBLK, BS, HKV, D]");
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                x.dim() == 2 && x.size(1) == hidden_, "x must be contiguous bfloat16 [T, hidden]");
    const int64_t T = x.size(0), H = hidden_, I = intermediate_;
    const bool has_res = residual && residual->defined();
    if (has_res)
      TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                  residual->scalar_type() == at::kBFloat16, "residual must match x");
    const exact::KvLayer layout = exact::kv_layer_of(kv_cache.select(0, 0));
    TORCH_CHECK(layout.kv_heads == kv_heads_ && layout.head_dim == head_dim_,
                "the cache's heads do not match the model's");
    exact::check_rope_tables(cos, sin, T, head_dim_);
    const int64_t* slots = exact::checked_slots(slot_mapping, T, layout);
    const exact::PagedIndex index =
        exact::paged_index(block_tables, token_seq, context_lens, T, layout);

    // One workspace for every layer: the ops run one after another, each reading the
    // buffers the previous one wrote (the residual stream alternates between two).
    const int64_t qd = heads_ * head_dim_;
    const int64_t sizes[] = {H, H, H, qkv_out_, qd, qd, H, 2 * I, I};
    int64_t total = 0;
    for (int64_t n : sizes) total += T * n;
    at::Tensor out_x = at::empty({T, H}, x.options()), out_res = at::empty({T, H}, x.options());
    std::lock_guard<std::mutex> hold(workspace_mutex_);  // one caller at a time uses it
    if (workspace_.numel() < total) workspace_ = at::empty({total}, x.options());
    bf16_t* p = data(workspace_);
    bf16_t* const h = p;          p += T * H;
    bf16_t* const res_a = p;      p += T * H;
    bf16_t* const h2 = p;         p += T * H;
    bf16_t* const qkv = p;        p += T * qkv_out_;
    bf16_t* const q = p;          p += T * qd;
    bf16_t* const attn = p;       p += T * qd;
    bf16_t* const o = p;          p += T * H;
    bf16_t* const gate_up = p;    p += T * 2 * I;
    bf16_t* const act = p;
    bf16_t* const res_b = data(out_res);  // the last layer's post-attention sum lands here

    bf16_t* kv = data(kv_cache) + begin * layout.numel();
    const bf16_t* in = cdata(x);
    const bf16_t* res_in = has_res ? cdata(*residual) : nullptr;
    for (int64_t i = begin; i < end; ++i, kv += layout.numel()) {
      const Layer& l = layers_[i];
      // Residual sums: res_a after attention's input norm, res_b after the MLP's (which
      // is out_res: the last layer's is what forward returns).
      bf16_t* const sum1 = res_in ? res_a : nullptr;
      exact::rms_norm_into(in, res_in, cdata(l.input_norm), T, H, eps_, sum1, h);
      exact::linear_into(h, T, l.qkv.w, qkv);
      exact::rope_write_kv_into(qkv, cdata(cos), cdata(sin), T, heads_, kv, layout, slots, q);
      // each op's early threads fetch the next linear's weights (ops.h)
      exact::paged_attention_into(q, qd, head_dim_, heads_, kv, layout, index, scale_, attn,
                                  &l.o.w);
      exact::linear_into(attn, T, l.o.w, o, &l.gate_up.w);
      const bf16_t* stream = res_in ? res_a : in;  // the residual stream after attention
      exact::rms_norm_into(o, stream, cdata(l.post_norm), T, H, eps_, res_b, h2);
      exact::linear_into(h2, T, l.gate_up.w, gate_up, &l.down.w);
      exact::silu_mul_into(gate_up, T, I, act);
      bf16_t* const y = i + 1 == end ? data(out_x) : o;  // o is free again: the next input
      exact::linear_into(act, T, l.down.w, y, i + 1 < end ? &layers_[i + 1].qkv.w : nullptr);
      in = y;
      res_in = res_b;
    }
    return {out_x, out_res};
  }

 private:
  std::vector<Layer> layers_;
  mutable std::mutex workspace_mutex_;
  mutable at::Tensor workspace_;  // bf16, grown to the largest step seen
  int64_t hidden_, heads_, kv_heads_, head_dim_, qkv_out_, intermediate_;
  float eps_, scale_;
};

void register_decoder(pybind11::module& m) {
  namespace py = pybind11;
  // module-local: two builds of the kernels can be loaded side by side in one process
  // (in-process A/B of kernel changes, docs/benchmarks.md, 2026-11-29 21:20)
  py::class_<ExactDecoder>(m, "ExactDecoder", py::module_local())
      .def(py::init<const std::vector<at::Tensor>&, int64_t, int64_t, int64_t, int64_t,
                    int64_t, double, double>())
      .def("num_layers", &ExactDecoder::num_layers)
      .def("forward", &ExactDecoder::forward, py::call_guard<py::gil_scoped_release>());
}
