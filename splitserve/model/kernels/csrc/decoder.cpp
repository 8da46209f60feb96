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
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor

#include <cstring>
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

using Ints = std::vector<int64_t>;
using Ints32 = std::vector<int32_t>;

// A step's index operands as the runner builds them, Python lists (pybind11 copies them
// into vectors): the slot of each token, the block tables (S rows of `width`, flat), each
// token's row of them and its context length. Making a numpy array and a tensor of each,
// as the runner once did, cost ~60 us of the cold Python between two decode steps. The
// tensors here only view the vectors, for the checks the module-level ops share.
struct StepIndex {
  at::Tensor slots, tables, token_seq, context_lens;
  StepIndex(const Ints& s, const Ints32& t, int64_t width, const Ints32& seq, const Ints32& lens)
      : slots(view(s, {(int64_t)s.size()}, at::kLong)),
        tables(view(t, {rows_of(t, width), width}, at::kInt)),
        token_seq(view(seq, {(int64_t)seq.size()}, at::kInt)),
        context_lens(view(lens, {(int64_t)lens.size()}, at::kInt)) {}
  static int64_t rows_of(const Ints32& t, int64_t width) {
    TORCH_CHECK(width > 0 && (int64_t)t.size() % width == 0,
                "block tables: ", t.size(), " entries are not rows of ", width);
    return (int64_t)t.size() / width;
  }
  template <typename V>
  static at::Tensor view(const V& v, at::IntArrayRef sizes, at::ScalarType type) {
    return at::from_blob(const_cast<typename V::value_type*>(v.data()), sizes,
                         at::TensorOptions().dtype(type));
  }
};

const bf16_t* cdata(const at::Tensor& t) { return reinterpret_cast<const bf16_t*>(t.data_ptr()); }
bf16_t* data(at::Tensor& t) { return reinterpret_cast<bf16_t*>(t.data_ptr()); }

}  // namespace

class ExactDecoder {
 public:
  // tensors: per layer, in order: input norm weight, post-attention norm weight, then for
  // QKV, O, gate/up and down: the packed weight, its fp32 scales (int8 weights) and its fp32
  // bias, each an empty tensor when absent. scale: the attention's softmax scale
  // (head_dim ** -0.5, from Python's float). ends: empty, or the model's ends for
  // logits(): the token embedding (bf16 [V, hidden]), the rotary cos and signed sin tables
  // (bf16 [positions, head_dim]), the final norm's weight, and the LM head's packed weight,
  // scales and bias (as a projection's).
  ExactDecoder(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& ends,
               int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               int64_t intermediate, double eps, double scale)
      : hidden_(hidden), heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim),
        qkv_out_((num_heads + 2 * num_kv_heads) * head_dim), intermediate_(intermediate),
        eps_((float)eps), scale_((float)scale) {
    TORCH_CHECK(tensors.size() % kPerLayer == 0, "ExactDecoder: 14 tensors per layer");
    TORCH_CHECK(hidden % 16 == 0 && intermediate % 16 == 0, "ExactDecoder: sizes % 16");
    const int64_t q_out = num_heads * head_dim;
    for (size_t i = 0; i < tensors.size(); i += kPerLayer) {
      const at::Tensor* t = tensors.data() + i;
      for (int k = 0; k < 2; ++k) check_norm(t[k], hidden);
      layers_.push_back(Layer{t[0], t[1], Proj(t + 2, hidden, qkv_out_), Proj(t + 5, q_out, hidden),
                              Proj(t + 8, hidden, 2 * intermediate),
                              Proj(t + 11, intermediate, hidden)});
    }
    if (ends.empty()) return;
    TORCH_CHECK(ends.size() == 7, "ExactDecoder: ends are 7 tensors");
    const at::Tensor& emb = ends[0];
    TORCH_CHECK(emb.scalar_type() == at::kBFloat16 && emb.is_contiguous() && emb.dim() == 2 &&
                emb.size(1) == hidden, "the embedding must be contiguous bfloat16 [V, hidden]");
    for (const at::Tensor* t : {&ends[1], &ends[2]})
      TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->dim() == 2 &&
                  t->size(1) == head_dim && t->size(0) == ends[1].size(0),
                  "the rotary tables must be contiguous bfloat16 [positions, head_dim]");
    check_norm(ends[3], hidden);
    ends_.emplace(Ends{emb, ends[1], ends[2], ends[3], Proj(ends.data() + 4, hidden, emb.size(0))});
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

  // Layers [begin, end) over a step. x [T, hidden] bf16: the layer input (the embedding,
  // or the previous layer's MLP output); residual: the residual stream before it (none
  // before layer 0). cos, sin [T, head_dim] bf16; kv_cache [layers, 2, NBLK, BS, HKV, D].
  // The step's index (StepIndex) comes as Python lists. Returns (the last layer's MLP
  // output, the residual stream before it).
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& cos,
      const at::Tensor& sin, at::Tensor& kv_cache, const Ints& slots, const Ints32& tables,
      int64_t width, const Ints32& token_seq, const Ints32& context_lens, int64_t begin,
      int64_t end) const {
    const StepIndex index(slots, tables, width, token_seq, context_lens);
    return layers(x, residual, cos, sin, kv_cache, index, begin, end);
  }

  // A whole step from token ids to fp32 logits [n, V] of `rows` (the flat batch's rows
  // that sample; every row when none): the embedding, the rotary tables' rows, the layers,
  // the final norm and the LM head, with the same kernels and operands as forward() and
  // the Python ops around it, so the same bits, without the ~10 torch ops a step made
  // from Python after the layers had streamed every weight through the caches (each
  // ~20-50 us there against ~5 warm). input_ids, positions [T]; rows [n]; the index as
  // forward()'s: all Python lists.
  // Returns the logits and each row's first maximum as a list (the greedy token: a numpy
  // argmax over the cold logits cost a step ~75 us in Python).
  std::tuple<at::Tensor, Ints> logits(
      const Ints& input_ids, const Ints& positions, at::Tensor& kv_cache, const Ints& slots,
      const Ints32& tables, int64_t width, const Ints32& token_seq,
      const Ints32& context_lens, const c10::optional<Ints>& rows) const {
    TORCH_CHECK(ends_, "ExactDecoder: built without the model's ends");
    const Ends& e = *ends_;
    const int64_t T = (int64_t)input_ids.size(), H = hidden_, D = head_dim_,
                  V = e.embedding.size(0);
    TORCH_CHECK(T > 0 && (int64_t)positions.size() == T,
                "input_ids and positions must be [T], T > 0");
    if (rows)
      for (int64_t r : *rows) TORCH_CHECK(r >= 0 && r < T, "row ", r, " out of range");
    const StepIndex index(slots, tables, width, token_seq, context_lens);
    const auto bf16 = e.embedding.options();
    at::Tensor x = at::empty({T, H}, bf16), cos = at::empty({T, D}, bf16),
               sin = at::empty({T, D}, bf16);
    const int64_t* ids = input_ids.data();
    const int64_t* pos = positions.data();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(ids[t] >= 0 && ids[t] < V, "token id ", ids[t], " out of range");
      TORCH_CHECK(pos[t] >= 0 && pos[t] < e.cos.size(0), "position ", pos[t], " out of range");
      std::memcpy(data(x) + t * H, cdata(e.embedding) + ids[t] * H, H * sizeof(bf16_t));
      std::memcpy(data(cos) + t * D, cdata(e.cos) + pos[t] * D, D * sizeof(bf16_t));
      std::memcpy(data(sin) + t * D, cdata(e.sin) + pos[t] * D, D * sizeof(bf16_t));
    }
    auto [y, stream] = layers(x, c10::nullopt, cos, sin, kv_cache, index, 0, num_layers());
    if (rows) {  // the sampled rows alone (the norm and the head are row by row)
      const int64_t* r = rows->data();
      const int64_t n = (int64_t)rows->size();
      at::Tensor ys = at::empty({n, H}, bf16), ss = at::empty_like(ys);
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(data(ys) + i * H, cdata(y) + r[i] * H, H * sizeof(bf16_t));
        std::memcpy(data(ss) + i * H, cdata(stream) + r[i] * H, H * sizeof(bf16_t));
      }
      y = ys, stream = ss;
    }
    const int64_t n = y.size(0);
    at::Tensor out = at::empty({n, V}, bf16.dtype(at::kFloat));
    Ints top(n);
    if (n == 0) return {out, top};
    at::Tensor h = at::empty({n, H}, bf16), sum = at::empty({n, H}, bf16);
    exact::parallel_rows(n, [&](int64_t r0, int64_t r1) {
      exact::rms_norm_into(cdata(y) + r0 * H, cdata(stream) + r0 * H, cdata(e.norm), r1 - r0, H,
                           eps_, data(sum) + r0 * H, data(h) + r0 * H);
    });
    at::Tensor head = at::empty({n, V}, bf16);
    exact::linear_into(cdata(h), n, e.head.w, data(head));
    const bf16_t* src = cdata(head);
    float* dst = out.data_ptr<float>();
    int64_t* first = top.data();
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {  // bf16 -> fp32, argmax
      for (int64_t i = begin; i < end; ++i) {
        uint32_t* row = reinterpret_cast<uint32_t*>(dst + i * V);
        for (int64_t j = 0; j < V; ++j) row[j] = (uint32_t)src[i * V + j] << 16;
        first[i] = exact::first_max(dst + i * V, V);
      }
    });
    return {out, top};
  }

 private:
  // Layers [begin, end) as forward().
  std::tuple<at::Tensor, at::Tensor> layers(
      at::Tensor x, c10::optional<at::Tensor> residual, const at::Tensor& cos,
      const at::Tensor& sin, at::Tensor& kv_cache, const StepIndex& step, int64_t begin,
      int64_t end) const {
    TORCH_CHECK(0 <= begin && begin < end && end <= num_layers(), "layers out of range");
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == num_layers() &&
                kv_cache.is_contiguous(),
                "kv_cache must be contiguous [layers, 2, NBLK, BS, HKV, D]");
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
    const int64_t* slots = exact::checked_slots(step.slots, T, layout);
    const exact::PagedIndex index =
        exact::paged_index(step.tables, step.token_seq, step.context_lens, T, layout);

    // One workspace for every layer: the ops run one after another, each reading the
    // buffers the previous one wrote (the residual stream alternates between two).
    const int64_t qd = heads_ * head_dim_;
    const int64_t sizes[] = {H, H, H, qkv_out_, qd, qd, H, 2 * I, I};
    int64_t total = 0;
    for (int64_t n : sizes) total += T * n;
    at::Tensor out_x = at::empty({T, H}, x.options()), out_res = at::empty({T, H}, x.options());
    // With fewer rows than threads (a decode step on a team), each thread runs the row-wise
    // ops in full into buffers of its own (below): its h, two residual sums and act.
    const int64_t own_size = T * (3 * H + I);
    const int64_t pool_threads = get_isa() >= 3 ? 1 : at::get_num_threads();
    if (T < pool_threads) total += pool_threads * own_size;
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
    bf16_t* const act = p;        p += T * I;
    bf16_t* const owned = p;      // pool_threads x own_size, when T < pool_threads
    bf16_t* const res_b = data(out_res);  // the last layer's post-attention sum lands here

    bf16_t* const kv0 = data(kv_cache) + begin * layout.numel();
    const bf16_t* const x0 = cdata(x);
    const bf16_t* const res0 = has_res ? cdata(*residual) : nullptr;
    const bf16_t *cos_p = cdata(cos), *sin_p = cdata(sin);
    const int64_t D = head_dim_;
    // Every thread of the team runs this (each with its own loop state); every op shares
    // its tasks out (parallel_tasks; the row-wise ops, parallel_rows: chunks of rows) and
    // ends at the team's barrier. With fewer rows than threads (a decode step) each thread
    // runs the norms and SiLU in full, into buffers of its own, and goes straight on to the
    // linear after them, which reads its own copy (the same bits whichever thread computes
    // a task): three barriers a layer fewer, where the other thread's split of those small
    // ops saved less than its wait (~1.5% of a batch-1 step at a fast DRAM moment,
    // docs/benchmarks.md 11-30 08:2x-09:4x). AMX runs each op in a region of its own (its
    // attention packs V into the caller's buffer; the team is not measured there yet).
    auto stack = [&] {
      exact::Team* const team = exact::Team::current();
      const bool own = team && T < team->threads();
      const int64_t me = exact::Team::me();
      // Where this thread's row-wise ops write: its own buffers when `own` (thread 0's
      // residual sums are the shared ones: res_b is what forward returns).
      bf16_t* const mine = own ? owned + me * own_size : nullptr;
      bf16_t* const h1_ = own ? mine : h;
      bf16_t* const h2_ = own ? mine : h2;
      bf16_t* const act_ = own ? mine + 3 * T * H : act;
      bf16_t* const sum_a = own && me > 0 ? mine + T * H : res_a;
      bf16_t* const sum_b = own && me > 0 ? mine + 2 * T * H : res_b;
      const auto row_op = [&](const auto& rows) {  // rows(r0, r1): that range of the op
        if (own) rows(0, T);
        else exact::parallel_rows(T, rows);
      };
      bf16_t* kv = kv0;
      const bf16_t* in = x0;
      const bf16_t* res_in = res0;
      for (int64_t i = begin; i < end; ++i, kv += layout.numel()) {
        const Layer& l = layers_[i];
        // Residual sums: sum_a after attention's input norm, sum_b after the MLP's (res_b
        // is out_res: the last layer's is what forward returns).
        bf16_t* const sum1 = res_in ? sum_a : nullptr;
        row_op([&](int64_t r0, int64_t r1) {
          exact::rms_norm_into(in + r0 * H, res_in ? res_in + r0 * H : nullptr,
                               cdata(l.input_norm), r1 - r0, H, eps_,
                               sum1 ? sum1 + r0 * H : nullptr, h1_ + r0 * H);
        });
        exact::linear_into(h1_, T, l.qkv.w, qkv);
        const auto rope = [&](int64_t r0, int64_t r1, int64_t u0, int64_t u1) {
          exact::rope_write_kv_into(qkv + r0 * qkv_out_, cos_p + r0 * D, sin_p + r0 * D,
                                    r1 - r0, heads_, kv, layout, slots + r0, q + r0 * qd, u0,
                                    u1);
        };
        if (own) {  // every row, this thread's heads of them (the next op reads them all)
          const auto [u0, u1] = team->part(heads_ + kv_heads_ + 1);
          rope(0, T, u0, u1);
          team->barrier();
        } else {
          exact::parallel_rows(T, [&](int64_t r0, int64_t r1) { rope(r0, r1, 0, -1); });
        }
        exact::paged_attention_into(q, qd, head_dim_, heads_, kv, layout, index, scale_, attn);
        exact::linear_into(attn, T, l.o.w, o);
        const bf16_t* stream = res_in ? sum_a : in;  // the residual stream after attention
        row_op([&](int64_t r0, int64_t r1) {
          exact::rms_norm_into(o + r0 * H, stream + r0 * H, cdata(l.post_norm), r1 - r0, H,
                               eps_, sum_b + r0 * H, h2_ + r0 * H);
        });
        exact::linear_into(h2_, T, l.gate_up.w, gate_up);
        row_op([&](int64_t r0, int64_t r1) {
          exact::silu_mul_into(gate_up + r0 * 2 * I, r1 - r0, I, act_ + r0 * I, T);
        });
        bf16_t* const y = i + 1 == end ? data(out_x) : o;  // o is free again: the next input
        exact::linear_into(act_, T, l.down.w, y);
        in = y;
        res_in = sum_b;
      }
    };
    if (get_isa() >= 3) stack();
    else exact::Team::run(stack);
    return {out_x, out_res};
  }

  static void check_norm(const at::Tensor& w, int64_t hidden) {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == hidden,
                "norm weights must be contiguous bfloat16 [hidden]");
  }

  struct Ends {
    at::Tensor embedding, cos, sin, norm;
    Proj head;
  };
  std::vector<Layer> layers_;
  c10::optional<Ends> ends_;
  mutable std::mutex workspace_mutex_;
  mutable at::Tensor workspace_;  // bf16, grown to the largest step seen
  int64_t hidden_, heads_, kv_heads_, head_dim_, qkv_out_, intermediate_;
  float eps_, scale_;
};

void register_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  // module-local: two builds of the kernels can be loaded side by side in one process
  // (in-process A/B of kernel changes, docs/benchmarks.md, 2026-11-29 21:20)
  py::class_<ExactDecoder>(m, "ExactDecoder", py::module_local())
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, int64_t,
                    int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("num_layers", &ExactDecoder::num_layers)
      .def("forward", &ExactDecoder::forward, py::call_guard<py::gil_scoped_release>())
      .def("logits", &ExactDecoder::logits, py::call_guard<py::gil_scoped_release>());
}
