// Native CPU runtime for GGUF block-quantized weights: integer dot products on the file's own blocks.
//
// Activations are quantized per row into blocks of 32 int8 values with one float scale (llama.cpp's Q8_1
// idea: d = max|x| / 127, q = round(x / d), and s = d * sum(q) for the formats with a per-block minimum).
// A weight block times an activation block is an exact integer sum, scaled once. Every output element
// y[m, n] is computed by the same instruction sequence whatever else is in the call (other rows, draft
// tokens, a different thread split), so a row has the same bits alone or in a batch: greedy speculative
// output equals plain greedy output by construction.
//
// The only code that knows a block format is its struct in formats.h (layout, scales, unpacking); the GEMM,
// the fused decoder layer and the dequantizer are written once over it.
//
// This file is the one translation unit the build compiles (native.py's SOURCE): it includes the kernels' headers in
// dependency order, so the compiler still sees (and inlines across) all of them at once, and binds them to Python.
// The name is the concept's, not a format's: float weights (F32, F16, BF16) run through the same GEMM and layer.
//   simd.h         instruction set, f16 conversions, shared vector helpers
//   memory.h       tensors on 2 MB pages (huge_empty)
//   formats.h      the GGUF block formats
//   attention.h    paged attention in fixed chunks
//   activations.h  int8 activation quantization
//   gemm.h         integer and float GEMM tiles, QMatrix, matmul, linear, dequantize_rows
//   moe.h          a mixture-of-experts MLP: routing, rows grouped by expert
//   layer.h        the fused decoder layer and the whole-model Stack
//   rows.h         argmax_rows, logprob_rows, mask_rows, race_rows, race_logit_row
//   head.h         an EAGLE-3 head's whole draft step (Eagle3Step)
//   inputs.h       a step's causal layout over the paged cache (causal_inputs)
//   suffix.h       a retrieval datastore's lookups (suffix_longest_match, suffix_voted_chain)
#include "memory.h"
#include "formats.h"
#include "attention.h"
#include "activations.h"
#include "gemm.h"
#include "layer.h"
#include "rows.h"
#include "head.h"
#include "inputs.h"
#include "suffix.h"

namespace {

// The path this build takes, named as native.py's ISAS names the instruction sets.
std::string isa() { return SPECDEC_ISA_NAME; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<QMatrix>(m, "QMatrix")
      .def(py::init(&make_matrix), py::arg("data"), py::arg("formats"), py::arg("in_features"), py::arg("interleave") = true)
      .def_property_readonly("out_features", &QMatrix::N)
      .def_readonly("in_features", &QMatrix::K);
  py::class_<Layer>(m, "Layer")
      .def(py::init([](torch::Tensor ln1, QMatrix qkv, torch::Tensor qkv_b, torch::Tensor q_norm,
                       torch::Tensor k_norm, QMatrix o, torch::Tensor ln2, std::optional<QMatrix> gate_up,
                       std::optional<QMatrix> down,
                       int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps, int64_t window, double softcap,
                       torch::Tensor attn_out_norm, torch::Tensor mlp_out_norm, int64_t act, int64_t rotary,
                       bool local_rope, bool qk_norm_full, double clip, torch::Tensor router,
                       std::vector<QMatrix> experts_gate_up, std::vector<QMatrix> experts_down, int64_t top_k,
                       bool norm_topk, std::vector<QMatrix> shared, torch::Tensor shared_gate, torch::Tensor router_b,
                       std::vector<torch::Tensor> experts_gate_up_b, std::vector<torch::Tensor> experts_down_b,
                       torch::Tensor sinks, torch::Tensor o_b, double swiglu_alpha, double swiglu_limit,
                       int64_t scoring, int64_t groups, int64_t topk_groups, torch::Tensor choice_b,
                       double routed_scale, std::optional<QMatrix> mla_q_a, std::optional<QMatrix> mla_q,
                       torch::Tensor mla_q_a_norm, torch::Tensor mla_kv_a_norm, std::vector<QMatrix> mla_w_uk,
                       std::vector<QMatrix> mla_w_uv, int64_t mla_rope, int64_t mla_nope, int64_t mla_v,
                       bool mla_interleave) {
        TORCH_CHECK(window >= 0 && softcap >= 0 && clip >= 0, "window, softcap and clip must be >= 0 (0: none)");
        TORCH_CHECK(rotary >= 0 && rotary <= head_dim && rotary % 2 == 0, "rotary must be even, in [0, head_dim]");
        for (const auto* t : {&attn_out_norm, &mlp_out_norm})
          TORCH_CHECK(!t->defined() || t->numel() == 0 || (t->dtype() == torch::kFloat32 && t->is_contiguous()),
                      "sandwich norm weights must be contiguous float32");
        const bool mixture = !experts_gate_up.empty();
        TORCH_CHECK(mixture != (gate_up.has_value() && down.has_value()),
                    "a layer has either a dense MLP (gate_up, down) or experts, not both");
        Layer L{ln1, qkv_b, q_norm, k_norm, ln2, qkv, o, gate_up.value_or(QMatrix{}), down.value_or(QMatrix{}),
                n_heads, n_kv, head_dim, eps, window, (float)softcap};
        if (mixture) {
          const int64_t H = qkv.K, E = (int64_t)experts_gate_up.size();
          TORCH_CHECK(router.dtype() == torch::kFloat32 && router.is_contiguous() && router.dim() == 2 &&
                      router.size(0) == E && router.size(1) == H, "router must be contiguous float32 [E, H]");
          TORCH_CHECK((int64_t)experts_down.size() == E && top_k >= 1 && top_k <= E,
                      "one down matrix per expert, and 1 <= top_k <= experts");
          for (int64_t e = 0; e < E; e++)
            TORCH_CHECK(experts_gate_up[e].K == H && experts_down[e].N() == H &&
                        experts_down[e].K * 2 == experts_gate_up[e].N(), "expert ", e, "'s shapes do not fit");
          TORCH_CHECK(shared.empty() || (shared.size() == 2 && shared_gate.dtype() == torch::kFloat32 &&
                                         shared_gate.is_contiguous()),
                      "a shared expert is {gate_up, down} with a float32 gate [H] (or none)");
          for (const auto* b : {&experts_gate_up_b, &experts_down_b})
            TORCH_CHECK(b->empty() || (int64_t)b->size() == E, "expert biases: one per expert, or none");
          for (int64_t e = 0; e < (int64_t)experts_gate_up_b.size(); e++)
            TORCH_CHECK(experts_gate_up_b[e].dtype() == torch::kFloat32 && experts_gate_up_b[e].is_contiguous() &&
                        experts_gate_up_b[e].numel() == experts_gate_up[e].N() &&
                        experts_down_b[e].dtype() == torch::kFloat32 && experts_down_b[e].is_contiguous() &&
                        experts_down_b[e].numel() == H, "expert ", e, "'s biases must be contiguous float32 [2I], [H]");
          TORCH_CHECK(router_b.numel() == 0 || (router_b.dtype() == torch::kFloat32 && router_b.is_contiguous() &&
                                                router_b.numel() == E), "router_b must be contiguous float32 [E]");
          TORCH_CHECK((scoring == 0 || scoring == 1) && groups >= 1 && E % groups == 0 && topk_groups >= 1 &&
                      topk_groups <= groups && (groups == 1 || E / groups >= 2),
                      "scoring 0 (softmax) or 1 (sigmoid); groups dividing the experts, 1 <= topk_groups <= groups");
          TORCH_CHECK(choice_b.numel() == 0 || (choice_b.dtype() == torch::kFloat32 && choice_b.is_contiguous() &&
                                                choice_b.numel() == E), "choice_b must be contiguous float32 [E]");
          TORCH_CHECK(shared.empty() || shared_gate.numel() == 0 || shared_gate.numel() == H,
                      "a shared expert's gate is [H] or none");
          L.moe = Experts{router, router_b, std::move(experts_gate_up_b), std::move(experts_down_b),
                          std::move(experts_gate_up), std::move(experts_down), std::move(shared), shared_gate, top_k,
                          norm_topk};
          L.moe.scoring = scoring; L.moe.groups = groups; L.moe.topk_groups = topk_groups; L.moe.choice_b = choice_b;
          L.moe.scale = (float)routed_scale;
        }
        TORCH_CHECK(sinks.numel() == 0 || (sinks.dtype() == torch::kFloat32 && sinks.is_contiguous() &&
                                           sinks.numel() == n_heads), "sinks must be contiguous float32 [n_heads]");
        TORCH_CHECK(o_b.numel() == 0 || (o_b.dtype() == torch::kFloat32 && o_b.is_contiguous() && o_b.numel() == qkv.K),
                    "o_b must be contiguous float32 [H]");
        TORCH_CHECK(act >= 0 && act <= 2, "act: 0 SiLU, 1 GELU (tanh), 2 clamped SwiGLU");
        L.sinks = sinks; L.o_b = o_b; L.swiglu_alpha = (float)swiglu_alpha; L.swiglu_limit = (float)swiglu_limit;
        if (!mla_w_uk.empty()) {  // latent attention: qkv is kv_a [rank + rope, H]; one key head of rank + rope
          const int64_t rank = head_dim - mla_rope, H = qkv.K;
          TORCH_CHECK(mla_q.has_value() && n_kv == 1 && rank > 0 && mla_rope > 0 && mla_rope % 2 == 0 &&
                      qkv.N() == head_dim && (int64_t)mla_w_uk.size() == n_heads &&
                      (int64_t)mla_w_uv.size() == n_heads && rotary == mla_rope,
                      "latent attention: q, kv_a [rank + rope, H], one key head, a W_uk and W_uv per head");
          const bool bottleneck = mla_q_a.has_value() && mla_q_a->N() > 0;
          TORCH_CHECK(mla_q->N() == n_heads * (mla_nope + mla_rope) && mla_q->K == (bottleneck ? mla_q_a->N() : H) &&
                      (!bottleneck || (mla_q_a->K == H && mla_q_a_norm.numel() == mla_q_a->N())) &&
                      mla_kv_a_norm.numel() == rank && o.K == n_heads * mla_v, "latent attention: shapes do not fit");
          for (int64_t hh = 0; hh < n_heads; hh++)
            TORCH_CHECK(mla_w_uk[hh].N() == rank && mla_w_uk[hh].K == mla_nope && mla_w_uv[hh].N() == mla_v &&
                        mla_w_uv[hh].K == rank, "latent attention: head ", hh, "'s W_uk / W_uv do not fit");
          L.mla = Latent{bottleneck ? *mla_q_a : QMatrix{}, *mla_q, mla_q_a_norm, mla_kv_a_norm, std::move(mla_w_uk),
                         std::move(mla_w_uv), rank, mla_rope, mla_nope, mla_v, mla_interleave};
        }
        L.attn_out_norm = attn_out_norm.defined() ? attn_out_norm : torch::empty({0});
        L.mlp_out_norm = mlp_out_norm.defined() ? mlp_out_norm : torch::empty({0});
        L.act = act; L.rotary = rotary; L.local_rope = local_rope; L.qk_norm_full = qk_norm_full; L.clip = (float)clip;
        return L;
      }), py::arg("ln1"), py::arg("qkv"), py::arg("qkv_b"), py::arg("q_norm"), py::arg("k_norm"), py::arg("o"),
          py::arg("ln2"), py::arg("gate_up"), py::arg("down"), py::arg("n_heads"), py::arg("n_kv"), py::arg("head_dim"),
          py::arg("eps"), py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("attn_out_norm") = torch::empty({0}),
          py::arg("mlp_out_norm") = torch::empty({0}), py::arg("act") = 0, py::arg("rotary") = 0,
          py::arg("local_rope") = false, py::arg("qk_norm_full") = false, py::arg("clip") = 0.0,
          py::arg("router") = torch::empty({0}), py::arg("experts_gate_up") = std::vector<QMatrix>(),
          py::arg("experts_down") = std::vector<QMatrix>(), py::arg("top_k") = 0, py::arg("norm_topk") = false,
          py::arg("shared") = std::vector<QMatrix>(), py::arg("shared_gate") = torch::empty({0}),
          py::arg("router_b") = torch::empty({0}), py::arg("experts_gate_up_b") = std::vector<torch::Tensor>(),
          py::arg("experts_down_b") = std::vector<torch::Tensor>(), py::arg("sinks") = torch::empty({0}),
          py::arg("o_b") = torch::empty({0}), py::arg("swiglu_alpha") = 0.0, py::arg("swiglu_limit") = 0.0,
          py::arg("scoring") = 0, py::arg("groups") = 1, py::arg("topk_groups") = 1,
          py::arg("choice_b") = torch::empty({0}), py::arg("routed_scale") = 1.0, py::arg("mla_q_a") = nullptr,
          py::arg("mla_q") = nullptr, py::arg("mla_q_a_norm") = torch::empty({0}),
          py::arg("mla_kv_a_norm") = torch::empty({0}), py::arg("mla_w_uk") = std::vector<QMatrix>(),
          py::arg("mla_w_uv") = std::vector<QMatrix>(), py::arg("mla_rope") = 0, py::arg("mla_nope") = 0,
          py::arg("mla_v") = 0, py::arg("mla_interleave") = true)
      .def("forward", &layer_forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_pool"),
           py::arg("v_pool"), py::arg("slot_mapping"), py::arg("context_slots"), py::arg("mask"),
           py::arg("query_starts"), py::arg("scale"), py::arg("qkv_input") = torch::Tensor());
  py::class_<Stack>(m, "Stack")
      .def(py::init([](std::vector<Layer> layers, torch::Tensor norm, double eps) {
        TORCH_CHECK(norm.dtype() == torch::kFloat32 && norm.is_contiguous(), "norm weight must be contiguous float32");
        return Stack{std::move(layers), norm, eps};
      }))
      .def("forward", &Stack::forward, py::arg("x"), py::arg("rope_cos"), py::arg("rope_sin"), py::arg("positions"),
           py::arg("k_pools"), py::arg("v_pools"), py::arg("slot_mapping"), py::arg("context_slots"), py::arg("mask"),
           py::arg("query_starts"), py::arg("scale"), py::arg("num_layers"), py::arg("capture"),
           py::arg("lm_head") = nullptr, py::arg("logit_rows") = std::vector<int64_t>(),
           py::arg("rope_local_cos") = torch::empty({0}), py::arg("rope_local_sin") = torch::empty({0}));
  py::class_<Eagle3Step>(m, "Eagle3Step")
      .def(py::init([](QMatrix fc, Layer layer, torch::Tensor hidden_norm, torch::Tensor norm, QMatrix lm_head,
                       torch::Tensor d2t) {
        TORCH_CHECK(hidden_norm.dtype() == torch::kFloat32 && norm.dtype() == torch::kFloat32 &&
                    hidden_norm.is_contiguous() && norm.is_contiguous(), "norm weights must be contiguous float32");
        TORCH_CHECK(d2t.dtype() == torch::kInt64 && d2t.is_contiguous() && d2t.numel() == lm_head.N(),
                    "d2t must be contiguous int64 [draft vocab]");
        return Eagle3Step{fc, layer, hidden_norm, norm, lm_head, d2t};
      }))
      .def("forward", &Eagle3Step::forward, py::arg("embeds"), py::arg("input"), py::arg("features"),
           py::arg("rope_cos"), py::arg("rope_sin"), py::arg("positions"), py::arg("k_pool"), py::arg("v_pool"),
           py::arg("slot_mapping"), py::arg("context_slots"), py::arg("mask"), py::arg("query_starts"),
           py::arg("scale"), py::arg("rows"));
  m.def("linear", &linear, "y = x @ W.T for x float32 [M, K] (quantized per row to int8 blocks for block formats)");
  m.def("rms_norm", [](const torch::Tensor& x, const torch::Tensor& w, double eps) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && w.dtype() == torch::kFloat32 && w.dim() == 1 &&
                w.size(0) == x.size(1), "rms_norm takes float32 x [T, H] and weight [H]");
    auto xc = x.contiguous(), wc = w.contiguous();
    auto out = torch::empty_like(xc);
    rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), (float)eps, xc.size(0), xc.size(1), out.data_ptr<float>());
    return out;
  }, "RMSNorm of each row of x [T, H], the layers' own (a row's bits do not depend on T)");
  m.def("dequantize_rows", &dequantize_rows);
  m.def("attention", &attention_op, py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("context_slots"),
        py::arg("mask"), py::arg("query_starts"), py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = torch::empty({0}),
        "attention of q [T, Hq, D] over the K/V pools (the layers' own kernel); window > 0: each query's last `window` "
        "visible keys; softcap > 0: scores soft-capped; sinks [Hq]: a logit per head in each softmax, with no value");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum, float32 [N, V] -> int64 [N]");
  m.def("logprob_rows", &logprob_rows, "log-softmax of each row's token and its k largest values with indices");
  m.def("race_rows", &race_rows, "a keyed sample of each row of probs float32 [N, V] for keys int64 [N]: the first index "
        "of the largest p / E, E ~ Exp(1) a hash of (key, token) (sampling.keyed_sample)");
  m.def("race_logit_row", &race_logit_row, py::arg("logits"), py::arg("inv_t"), py::arg("key"),
        "race_rows over exp((logits - max) * inv_t) for one float32 row: the keyed sample at a temperature alone");
  m.def("mask_rows", &mask_rows, "logits float32 [N, V] of tokens a bitmask int32 [N, V / 32] forbids -> -inf");
  m.def("causal_inputs", &causal_inputs, py::arg("tables"), py::arg("starts"), py::arg("feeds"), py::arg("block_size"),
        py::arg("null_block"), "a step's causal layout over the paged cache: tokens, positions, slot_mapping, "
        "context_slots, mask, query_starts (kv_cache.paged_inputs without trees)");
  m.def("suffix_longest_match", &suffix_longest_match, py::arg("sa"), py::arg("tokens"), py::arg("context"),
        py::arg("min_match"), py::arg("max_match"), "(length, lo, hi) of the longest suffix of context found in a "
        "retrieval datastore's suffix array (retrieval.Datastore.longest_match)");
  m.def("suffix_voted_chain", &suffix_voted_chain, py::arg("sa"), py::arg("tokens"), py::arg("lo"), py::arg("hi"),
        py::arg("m"), py::arg("depth"), py::arg("max_candidates"), "the chain most continuations of a suffix-array "
        "range agree on (retrieval.voted_chain over Datastore.continuations)");
  m.def("isa", &isa);
  m.def("huge_empty", [](std::vector<int64_t> sizes, at::ScalarType dtype) { return huge_empty(sizes, dtype); },
        py::arg("sizes"), py::arg("dtype"), "an uninitialized CPU tensor on 2 MB pages where Linux gives them");
  m.def("team_max_rows", [](int64_t rows) {
    const int64_t before = team_max_rows.load();
    if (rows >= 0) team_max_rows.store(rows);
    return before;
  }, py::arg("rows") = -1, "steps of at most this many rows run the whole stack as one thread team (returns the "
     "previous value; -1 only reads it; 0 runs every step layer by layer)");
}
