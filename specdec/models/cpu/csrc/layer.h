// The transformer built from gemm.h's products and attention.h's attention: RMSNorm, SiLU-gated MLP, rotary
// embedding and q/k norms, the fused decoder layer for a step's tokens (writing their keys and values into the
// paged pools, StepLayout saying where), alone or by every member of a thread team, and Stack, the whole model's
// layers (and the LM head) in one call. Kept apart from the GEMM so the model's structure reads on its own.
#pragma once
#include "gemm.h"
#include "attention.h"
#include "moe.h"

namespace {

// ---------------------------------------------------------------------------------------------------------
// The fused decoder layer for a few tokens (decode and verification), in place on x [T, H].
// ---------------------------------------------------------------------------------------------------------

void rms_norm_rows(const float* x, const float* w, float eps, int64_t T, int64_t H, float* out) {
  for (int64_t t = 0; t < T; t++) {
    const float* xr = x + t * H;
    float ss = dot_f32(xr, xr, H);
    float inv = 1.f / std::sqrt(ss / (float)H + eps);
    for (int64_t i = 0; i < H; i++) out[t * H + i] = w[i] * (xr[i] * inv);
  }
}

// DeepSeek's latent attention (models/mla.py) in its absorbed form: queries through q (or q_a, its norm, then q),
// the cached key [latent (rank) | rotated key (rope)] from kv_a and its norm, each head's query latent q_nope W_uk[h],
// attention over one key head whose values are the latent, each head's value o W_uv[h]. The layer's qkv holds kv_a.
struct Latent {
  QMatrix q_a, q;  // q_a empty (N() 0): no q bottleneck
  torch::Tensor q_a_norm, kv_a_norm;
  std::vector<QMatrix> w_uk, w_uv;  // per head: [rank, nope] and [v, rank], float32
  int64_t rank = 0, rope = 0, nope = 0, v = 0;
  bool interleave = true;  // rotary pairs (2i, 2i + 1), de-interleaved before the rotation
  bool empty() const { return w_uk.empty(); }
};

struct Layer {
  torch::Tensor ln1, qkv_b, q_norm, k_norm, ln2;  // float32 (absent ones empty: ln1 for a layer without input norm)
  QMatrix qkv, o, gate_up, down;
  int64_t n_heads, n_kv, head_dim;
  double eps;
  int64_t window = 0;  // a sliding-window layer's window (0: every visible key)
  float softcap = 0.f;  // attention scores soft-capped at this (0: none)
  // The other families' options (their defaults are the Llama form):
  torch::Tensor attn_out_norm, mlp_out_norm;  // Gemma's sandwich: attention and MLP outputs normed (empty: none)
  int64_t act = 0;  // the gate's activation: 0 SiLU, 1 tanh-approximated GELU (Gemma's GeGLU)
  int64_t rotary = 0;  // dimensions of each head RoPE rotates, from the first (0: all; Phi-4-mini: 3/4)
  bool local_rope = false;  // reads the stack's second rotary tables (Gemma 3's sliding layers)
  bool qk_norm_full = false;  // OLMoE: q_norm over all of q and k_norm over all of k, not per head
  float clip = 0.f;  // OLMoE: q, k, v clamped to +-clip (0: none)
  Experts moe;  // a mixture of experts in place of gate_up and down (empty: the dense MLP)
  torch::Tensor sinks;  // gpt-oss: a sink logit per query head [Hq] in each softmax (empty: none)
  torch::Tensor o_b;  // gpt-oss: the output projection's bias [H] (empty: none)
  float swiglu_alpha = 0.f, swiglu_limit = 0.f;  // act 2 (gpt-oss's clamped SwiGLU)
  Latent mla;  // DeepSeek's attention in place of qkv's (empty: none); such a layer runs layer by layer, not in a team
};

inline int64_t rotary_dims(const Layer& L) { return L.rotary > 0 ? L.rotary : L.head_dim; }
// The widest intermediate the layer's MLP computes (its gate_up buffer holds twice this per row).
inline int64_t mlp_width(const Layer& L) { return L.moe.empty() ? L.gate_up.N() / 2 : L.moe.width(); }

// out[i] = silu(g[i]) * g[inter + i] (the gate and up halves of one row), the same lanes for every row.
void silu_mul(const float* g, int64_t inter, float* out) {
  int64_t i = 0;
#ifdef SPECDEC_AVX2
  const __m256 one = _mm256_set1_ps(1.f), lim = _mm256_set1_ps(88.f);
  for (; i + 8 <= inter; i += 8) {
    __m256 x = _mm256_loadu_ps(g + i);
    __m256 e = exp_ps(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), lim));  // exp(-x), finite
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(g + inter + i)));
  }
#endif
  for (; i < inter; i++) out[i] = g[i] / (1.f + std::exp(-g[i])) * g[inter + i];
}

// out[i] = gelu_tanh(g[i]) * g[inter + i]: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as torch's
// gelu(approximate="tanh"), element by element in one order for every row.
void gelu_mul(const float* g, int64_t inter, float* out) {
  const float k = 0.7978845608028654f;
  for (int64_t i = 0; i < inter; i++) {
    const float x = g[i];
    out[i] = 0.5f * x * (1.f + std::tanh(k * (x + 0.044715f * x * x * x))) * g[inter + i];
  }
}

// q/k norms (per head, or over all of q and of k; q, k, v clamped after the latter where the layer clips), then
// RoPE on each q and k head's first R dimensions (rotate_half within them; tables [T, R]).
void rope_and_qk_norm(float* qkv, int64_t T, const Layer& L, const float* cos, const float* ssin) {
  const int64_t D = L.head_dim, heads = L.n_heads + 2 * L.n_kv, R = rotary_dims(L), half = R / 2;
  std::vector<float> tmp(R);
  for (int64_t t = 0; t < T; t++) {
    float* row = qkv + t * heads * D;
    if (L.qk_norm_full) {
      rms_norm_rows(row, L.q_norm.data_ptr<float>(), (float)L.eps, 1, L.n_heads * D, row);
      rms_norm_rows(row + L.n_heads * D, L.k_norm.data_ptr<float>(), (float)L.eps, 1, L.n_kv * D, row + L.n_heads * D);
    }
    if (L.clip > 0.f)  // after OLMoE's norms, as transformers clamps
      for (int64_t i = 0; i < heads * D; i++) row[i] = std::min(std::max(row[i], -L.clip), L.clip);
    for (int64_t h = 0; h < L.n_heads + L.n_kv; h++) {  // q and k heads; v is left alone
      float* x = row + h * D;
      if (L.q_norm.numel() > 0 && !L.qk_norm_full) {
        const float* w = (h < L.n_heads ? L.q_norm : L.k_norm).data_ptr<float>();
        rms_norm_rows(x, w, (float)L.eps, 1, D, x);
      }
      std::memcpy(tmp.data(), x, R * sizeof(float));
      const float *c = cos + t * R, *sn = ssin + t * R;  // rotate_half: the partner of d is d + half (mod R)
      for (int64_t d = 0; d < half; d++) x[d] = tmp[d] * c[d] + tmp[d + half] * sn[d];
      for (int64_t d = half; d < R; d++) x[d] = tmp[d] * c[d] + tmp[d - half] * sn[d];
    }
  }
}

// The pools' element type: float32, or f16 (half the bytes per key; the native target's own pools).
template <class Fn>
auto with_kv(const torch::Tensor& k_pool, const torch::Tensor& v_pool, Fn&& fn) {
  TORCH_CHECK(k_pool.dtype() == v_pool.dtype() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "K and V pools must be contiguous and of one dtype");
  if (k_pool.dtype() == torch::kFloat16)
    return fn((uint16_t*)k_pool.data_ptr(), (uint16_t*)v_pool.data_ptr());
  TORCH_CHECK(k_pool.dtype() == torch::kFloat32, "K/V pools must be float32 or float16, got ", k_pool.dtype());
  return fn(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
}

// Where the step's tokens go and what each query sees (one per forward and window: the layers of one window share it).
struct StepLayout {
  const int64_t* slot_mapping;
  const int64_t* context_slots;
  int64_t Lk;
  Visible vis;
  int64_t window = 0;
};

StepLayout step_layout(const torch::Tensor& slot_mapping, const torch::Tensor& context_slots, const torch::Tensor& mask,
                       const torch::Tensor& query_starts, int64_t window = 0) {
  TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && context_slots.dtype() == torch::kInt64 &&
              query_starts.dtype() == torch::kInt64 && mask.dtype() == torch::kBool && slot_mapping.is_contiguous() &&
              context_slots.is_contiguous() && mask.is_contiguous() && query_starts.is_contiguous(),
              "attention metadata must be contiguous int64 slots / query starts and a bool mask");
  const int64_t B = query_starts.size(0) - 1, Lk = context_slots.size(1);
  return {slot_mapping.data_ptr<int64_t>(), context_slots.data_ptr<int64_t>(), Lk,
          visible_lists(context_slots.data_ptr<int64_t>(), Lk, mask.data_ptr<bool>(), mask.size(1),
                        query_starts.data_ptr<int64_t>(), B, window), window};
}

void check_rows(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& ssin, int64_t R) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous float32 [T, H]");
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && ssin.dtype() == torch::kFloat32 && cos.is_contiguous() &&
              ssin.is_contiguous() && cos.size(0) == x.size(0) && cos.size(1) == R && ssin.sizes() == cos.sizes(),
              "rotary tables must be contiguous float32 [T, rotary dims]");
}

// The rotary rows of a step's positions [T] from the model's tables [P, head_dim] (gathered here rather than by the
// caller: one call fewer from Python a forward).
std::pair<torch::Tensor, torch::Tensor> rope_rows(const torch::Tensor& cos_table, const torch::Tensor& sin_table,
                                                  const torch::Tensor& positions) {
  TORCH_CHECK(positions.dtype() == torch::kInt64 && positions.dim() == 1, "positions must be int64 [T]");
  TORCH_CHECK(cos_table.dim() == 2 && sin_table.sizes() == cos_table.sizes(), "rotary tables must be [P, head_dim]");
  return {cos_table.index_select(0, positions), sin_table.index_select(0, positions)};
}

// The attention alone (queries q [T, Hq, D] over pools already holding every visible key): what the layers run
// between their QKV and O projections, for the tests.
torch::Tensor attention_op(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& context_slots, const torch::Tensor& mask,
                           const torch::Tensor& query_starts, double scale, int64_t window, double softcap,
                           const torch::Tensor& sinks) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3 && q.is_contiguous(), "q must be contiguous float32 [T, Hq, D]");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == q.size(2) &&
              q.size(1) % k_pool.size(1) == 0, "pools must be [slots, Hkv, D] with Hq a multiple of Hkv");
  StepLayout step = step_layout(context_slots.new_empty({0}), context_slots, mask, query_starts, window);
  TORCH_CHECK(step.vis.T == q.size(0), "query_starts covers ", step.vis.T, " queries, q has ", q.size(0));
  auto out = torch::empty_like(q);
  const int64_t Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(sinks.numel() == 0 || (sinks.dtype() == torch::kFloat32 && sinks.is_contiguous() && sinks.numel() == Hq),
              "sinks must be contiguous float32 [Hq] (or empty: none)");
  with_kv(k_pool, v_pool, [&](auto* kp, auto* vp) {
    attention(q.data_ptr<float>(), Hq * D, Hq, k_pool.size(1), D, kp, vp, step.context_slots, step.Lk, step.vis,
              (float)scale, (float)softcap, out.data_ptr<float>(), sinks.numel() ? sinks.data_ptr<float>() : nullptr);
    return 0;
  });
  return out;
}


// ---------------------------------------------------------------------------------------------------------
// The whole stack for a few rows in one OpenMP team: the threads stay together from the first layer to the last
// instead of forking and joining per product and per attention (about 200 parallel regions a step on a 30-layer
// model, each costing microseconds, where a 576-wide product takes tens). Every member keeps its own copy of the
// residual stream and computes the row-wise work on it (norms, quantizing the product's input, SiLU): the same
// functions on the same values, so every copy has the same bits, and no barrier is needed around them. The
// products split their columns across the team (matmul_team) and the attention its units (attention_team), each
// ending in a barrier; each layer waits 7 times, at a fraction of a microsecond each when the threads are in step.
// Same operations per output element as the layer-at-a-time path, so the two give the same bits.
// ---------------------------------------------------------------------------------------------------------

// Steps of at most this many rows run as one team (above, in a prefill, the row-wise work each member repeats would
// cost more than the forks it saves); 0 runs every step layer by layer. Settable (team_max_rows) to compare the two.
std::atomic<int64_t> team_max_rows{16};

// Bytes of keys and values each member reads ahead at the start of a layer (touch_share; half a Zen 4 L2).
constexpr int64_t KV_TOUCH_BYTES = 512 << 10;

// The team's shared buffers (the calling thread's: one team per forward).
struct TeamBuffers {
  std::vector<float> qkv, attn, o, gu;
  AttentionPlan plan;
};

// One decoder layer on x [T, H] in place: alone (TEAM false: each product and the attention a parallel region of
// its own) or by every member of a thread team (TEAM true: x is the member's own residual stream, each product
// computes the member's share of its columns and ends in a barrier). The buffers: h [T, max(H, inter)] and qx the
// caller's own; qkv, attn, o, gu shared within a team. qkv_in: when given, what the QKV projection reads [T,
// L.qkv.K] instead of the input norm of x (an EAGLE-3 head's [norm(embedding), norm(hidden)], 2H wide).
// x += out, or x += norm(out) under a sandwich norm (into h, the caller's own buffer: out may be shared by a team).
// bias: the projection's own [H], added to out first (gpt-oss's o_proj), or null.
inline void add_output(float* x, const float* out, const torch::Tensor& norm, float eps, int64_t T, int64_t H, float* h,
                       const float* bias = nullptr) {
  if (bias != nullptr) {
    for (int64_t i = 0; i < T * H; i++) h[i] = out[i] + bias[i % H];
    out = h;
  }
  if (norm.numel() > 0) {
    rms_norm_rows(out, norm.data_ptr<float>(), eps, T, H, h);
    out = h;
  }
  for (int64_t i = 0; i < T * H; i++) x[i] += out[i];
}

// Latent attention for the normed rows h [T, H] (not in a team: each product its own parallel region, buffers the
// caller's): each head's value into out [T, n_heads * v], the new latent keys into k_pool, attn [T, n_heads * (rank +
// rope)] the attention's own output.
void latent_attention(const Layer& L, const float* h, int64_t T, int64_t H, const float* cos, const float* ssin,
                      torch::Tensor& k_pool, const StepLayout& step, double scale, QAct& qx, float* attn, float* out) {
  const Latent& M = L.mla;
  const int64_t nH = L.n_heads, r = M.rank, R = M.rope, D = r + R, qd = M.nope + R, half = R / 2;
  static thread_local std::vector<float> qa_buf, q_buf, kv_buf, query_buf, tmp;
  const float* qin = h;
  int64_t K = H;
  if (M.q_a.N() > 0) {
    float* qa = grow(qa_buf, T * M.q_a.N());
    matmul(M.q_a, h, T, H, qx, qa, M.q_a.N());
    rms_norm_rows(qa, M.q_a_norm.data_ptr<float>(), (float)L.eps, T, M.q_a.N(), qa);
    qin = qa;
    K = M.q_a.N();
  }
  float* q = grow(q_buf, T * nH * qd);
  float* kv = grow(kv_buf, T * D);
  float* query = grow(query_buf, T * nH * D);
  float* t2 = grow(tmp, 2 * R);
  matmul(M.q, qin, T, K, qx, q, nH * qd);
  matmul(L.qkv, h, T, H, qx, kv, D);  // kv_a
  auto rotate = [&](float* x, const float* c, const float* sn) {  // RoPE on R dims (de-interleaved first)
    if (M.interleave)
      for (int64_t i = 0; i < half; i++) { t2[i] = x[2 * i]; t2[half + i] = x[2 * i + 1]; }
    else
      std::memcpy(t2, x, R * sizeof(float));
    for (int64_t d = 0; d < half; d++) x[d] = t2[d] * c[d] + t2[d + half] * sn[d];
    for (int64_t d = half; d < R; d++) x[d] = t2[d] * c[d] + t2[d - half] * sn[d];
  };
  for (int64_t t = 0; t < T; t++) {
    float* row = kv + t * D;
    rms_norm_rows(row, M.kv_a_norm.data_ptr<float>(), (float)L.eps, 1, r, row);
    rotate(row + r, cos + t * R, ssin + t * R);
    for (int64_t hh = 0; hh < nH; hh++) {
      float* pe = q + t * nH * qd + hh * qd + M.nope;
      rotate(pe, cos + t * R, ssin + t * R);
      std::memcpy(query + t * nH * D + hh * D + r, pe, R * sizeof(float));
    }
  }
  for (int64_t hh = 0; hh < nH; hh++)  // q_nope W_uk[h]: the head's query in the latent
    matmul(M.w_uk[hh], q + hh * qd, T, nH * qd, qx, query + hh * D, nH * D);
  with_kv(k_pool, k_pool, [&](auto* kp, auto*) {
    for (int64_t t = 0; t < T; t++) narrow(kv + t * D, kp + step.slot_mapping[t] * D, D);
    TORCH_CHECK(step.window == L.window, "a layer of window ", L.window, " given the layout of window ", step.window);
    attention(query, nH * D, nH, 1, D, kp, kp, step.context_slots, step.Lk, step.vis, (float)scale, L.softcap, attn);
    return 0;
  });
  for (int64_t hh = 0; hh < nH; hh++)  // the latent output W_uv[h]: the head's value
    matmul(M.w_uv[hh], attn + hh * D, T, nH * D, qx, out + hh * M.v, nH * M.v);
}

template <bool TEAM>
void layer_body(const Layer& L, float* x, int64_t T, int64_t H, const float* cos, const float* ssin,
                torch::Tensor& k_pool, torch::Tensor& v_pool, const StepLayout& step, double scale, float* h, QAct& qx,
                float* qkv, float* attn, float* o, float* gu, const AttentionPlan* plan, const float* qkv_in) {
  const int64_t D = L.head_dim, Hq = L.n_heads, Hkv = L.n_kv;
  const int64_t W = (Hq + 2 * Hkv) * D, inter = L.gate_up.N() / 2;
  const Gate gate{L.act == 1 ? gelu_mul : silu_mul, L.swiglu_alpha, L.act == 2 ? L.swiglu_limit : 0.f};
  const float* sinks = L.sinks.numel() > 0 ? L.sinks.data_ptr<float>() : nullptr;
  auto product = [&](const QMatrix& M, const float* in, int64_t K, float* y, int64_t N) {
    if constexpr (TEAM) matmul_team(M, in, T, K, qx, y, N);
    else matmul(M, in, T, K, qx, y, N);
  };
  bool latent = false;  // DeepSeek's attention (layer by layer only: Stack keeps such a model out of teams)
  if constexpr (!TEAM) latent = !L.mla.empty();
  if (latent) {
    rms_norm_rows(x, L.ln1.data_ptr<float>(), (float)L.eps, T, H, h);
    static thread_local std::vector<float> heads;
    float* vo = grow(heads, T * L.n_heads * L.mla.v);
    latent_attention(L, h, T, H, cos, ssin, k_pool, step, scale, qx, attn, vo);
    product(L.o, vo, L.n_heads * L.mla.v, o, H);
    add_output(x, o, L.attn_out_norm, (float)L.eps, T, H, h, L.o_b.numel() > 0 ? L.o_b.data_ptr<float>() : nullptr);
  } else {
  if constexpr (TEAM) {
    static thread_local volatile int touched;  // keeps the loads
    touched = with_kv(k_pool, v_pool, [&](auto* kp, auto* vp) {
      return touch_share(*plan, step.vis, kp, vp, Hkv * D, KV_TOUCH_BYTES);
    });
  }
  if (qkv_in != nullptr) {
    product(L.qkv, qkv_in, L.qkv.K, qkv, W);
  } else {
    if (L.ln1.numel() > 0) rms_norm_rows(x, L.ln1.data_ptr<float>(), (float)L.eps, T, H, h);
    else std::memcpy(h, x, T * H * sizeof(float));  // no input norm (an EAGLE head's first layer)
    product(L.qkv, h, H, qkv, W);
  }
  auto place = [&] {  // bias, rotary embedding, and the new keys and values in first: queries see themselves
    if (L.qkv_b.numel() > 0) {
      const float* bias = L.qkv_b.data_ptr<float>();
      for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < W; i++) qkv[t * W + i] += bias[i];
    }
    rope_and_qk_norm(qkv, T, L, cos, ssin);
    with_kv(k_pool, v_pool, [&](auto* kp, auto* vp) {
      for (int64_t t = 0; t < T; t++) {
        narrow(qkv + t * W + Hq * D, kp + step.slot_mapping[t] * Hkv * D, Hkv * D);
        narrow(qkv + t * W + (Hq + Hkv) * D, vp + step.slot_mapping[t] * Hkv * D, Hkv * D);
      }
      return 0;
    });
  };
  if constexpr (TEAM) {
#pragma omp single
    place();  // one member; the others wait at the single's end
  } else {
    place();
  }
  with_kv(k_pool, v_pool, [&](auto* kp, auto* vp) {
    TORCH_CHECK(step.window == L.window, "a layer of window ", L.window, " given the layout of window ", step.window);
    if constexpr (TEAM) attention_team(*plan, qkv, W, Hq, Hkv, D, kp, vp, step.context_slots, step.Lk, step.vis,
                                       (float)scale, L.softcap, attn, sinks);
    else attention(qkv, W, Hq, Hkv, D, kp, vp, step.context_slots, step.Lk, step.vis, (float)scale, L.softcap, attn,
                   sinks);
    return 0;
  });
  product(L.o, attn, Hq * D, o, H);
  add_output(x, o, L.attn_out_norm, (float)L.eps, T, H, h, L.o_b.numel() > 0 ? L.o_b.data_ptr<float>() : nullptr);
  }
  rms_norm_rows(x, L.ln2.data_ptr<float>(), (float)L.eps, T, H, h);
  if (!L.moe.empty()) {
    static thread_local std::vector<float> mixed;  // the member's own
    float* m = grow(mixed, T * H);
    moe_mlp<TEAM>(L.moe, h, T, H, gate, qx, gu, o, m);
    add_output(x, m, L.mlp_out_norm, (float)L.eps, T, H, h);
    return;
  }
  product(L.gate_up, h, H, gu, 2 * inter);
  for (int64_t t = 0; t < T; t++) gate(gu + t * 2 * inter, inter, h + t * inter);
  product(L.down, h, inter, o, H);
  add_output(x, o, L.mlp_out_norm, (float)L.eps, T, H, h);
}

// A layer alone, its own parallel regions: buffers per calling thread, grown as needed and never cleared (every
// element is written before it is read).
void decoder_layer(const Layer& L, float* xp, int64_t T, int64_t H, const float* cos, const float* ssin,
                   torch::Tensor& k_pool, torch::Tensor& v_pool, const StepLayout& step, double scale,
                   const float* qkv_in = nullptr) {
  const int64_t W = (L.n_heads + 2 * L.n_kv) * L.head_dim, inter = mlp_width(L);
  static thread_local std::vector<float> h_buf, qkv_buf, attn_buf, o_buf, gu_buf;
  static thread_local QAct qx;
  layer_body<false>(L, xp, T, H, cos, ssin, k_pool, v_pool, step, scale, grow(h_buf, T * std::max(H, inter)), qx,
                    grow(qkv_buf, T * W), grow(attn_buf, T * L.n_heads * L.head_dim), grow(o_buf, T * H),
                    grow(gu_buf, T * 2 * inter), nullptr, qkv_in);
}

// A layer by every member of a team (see layer_body), the shared buffers in sh.
void decoder_layer_team(const Layer& L, float* x, int64_t T, int64_t H, const float* cos, const float* ssin,
                        torch::Tensor& k_pool, torch::Tensor& v_pool, const StepLayout& step, double scale,
                        TeamBuffers& sh, float* h, QAct& qx, const float* qkv_in = nullptr,
                        const AttentionPlan* plan = nullptr) {
  layer_body<true>(L, x, T, H, cos, ssin, k_pool, v_pool, step, scale, h, qx, sh.qkv.data(), sh.attn.data(),
                   sh.o.data(), sh.gu.data(), plan != nullptr ? plan : &sh.plan, qkv_in);
}


// One layer in place on x [T, H] (a draft head's layer).
void layer_forward(const Layer& L, torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& ssin,
                   torch::Tensor k_pool, torch::Tensor v_pool, const torch::Tensor& slot_mapping,
                   const torch::Tensor& context_slots, const torch::Tensor& mask, const torch::Tensor& query_starts,
                   double scale, const torch::Tensor& qkv_input) {
  check_rows(x, cos, ssin, rotary_dims(L));
  const bool own_input = qkv_input.defined() && qkv_input.numel() > 0;
  if (own_input) {
    TORCH_CHECK(qkv_input.dtype() == torch::kFloat32 && qkv_input.is_contiguous() && qkv_input.dim() == 2 &&
                qkv_input.size(0) == x.size(0) && qkv_input.size(1) == L.qkv.K,
                "qkv_input must be contiguous float32 [T, ", L.qkv.K, "]");
  } else {
    TORCH_CHECK(L.qkv.K == x.size(1), "this layer's QKV reads ", L.qkv.K, " inputs: pass them as qkv_input");
  }
  StepLayout step = step_layout(slot_mapping, context_slots, mask, query_starts, L.window);
  decoder_layer(L, x.data_ptr<float>(), x.size(0), x.size(1), cos.data_ptr<float>(), ssin.data_ptr<float>(), k_pool,
                v_pool, step, scale, own_input ? qkv_input.data_ptr<float>() : nullptr);
}

// The first num_layers layers in order, in place on x; returns the final norm of the result, the logits of the rows
// `logit_rows` of it (float32 [N, V] by lm_head, when given; else an empty tensor), then the outputs of the layers
// listed in `capture` as one tensor, features [T, len(capture) * H]: layer capture[c]'s output in columns c * H ..
// (c + 1) * H, in the order asked (what a feature drafter reads, with no concatenation after the call). The logits in
// the same call: no return to Python between the last layer and the LM head.
inline void capture_into(const std::vector<int64_t>& capture, int64_t layer, const float* x, int64_t T, int64_t H,
                         float* features) {
  const int64_t F = (int64_t)capture.size() * H;
  for (size_t c = 0; c < capture.size(); c++)
    if (capture[c] == layer)
      for (int64_t t = 0; t < T; t++) std::memcpy(features + t * F + c * H, x + t * H, H * sizeof(float));
}

struct Stack {
  std::vector<Layer> layers;
  torch::Tensor norm;  // the final RMSNorm's weight [H]
  double eps;
  std::vector<torch::Tensor> forward(torch::Tensor x, const torch::Tensor& rope_cos, const torch::Tensor& rope_sin,
                                     const torch::Tensor& positions, const std::vector<torch::Tensor>& k_pools,
                                     const std::vector<torch::Tensor>& v_pools, const torch::Tensor& slot_mapping,
                                     const torch::Tensor& context_slots, const torch::Tensor& mask,
                                     const torch::Tensor& query_starts, double scale, int64_t num_layers,
                                     const std::vector<int64_t>& capture, const QMatrix* lm_head,
                                     const std::vector<int64_t>& logit_rows, const torch::Tensor& rope_local_cos,
                                     const torch::Tensor& rope_local_sin) const {
    TORCH_CHECK(num_layers <= (int64_t)layers.size() && (int64_t)k_pools.size() >= num_layers &&
                (int64_t)v_pools.size() >= num_layers, "too few layers or pools");
    const auto [cos, ssin] = rope_rows(rope_cos, rope_sin, positions);
    check_rows(x, cos, ssin, layers.empty() ? 0 : rotary_dims(layers[0]));
    // a layer on the local tables (Gemma 3's sliding layers) reads their rows; without them, the global ones
    const bool local = rope_local_cos.defined() && rope_local_cos.numel() > 0;
    const auto [lcos, lssin] = local ? rope_rows(rope_local_cos, rope_local_sin, positions) : std::make_pair(cos, ssin);
    for (int64_t i = 0; i < num_layers; i++)
      TORCH_CHECK(!layers[i].local_rope || local, "layer ", i, " reads local rotary tables: pass rope_local_cos/sin");
    const float* tables[2][2] = {{cos.data_ptr<float>(), ssin.data_ptr<float>()},
                                 {lcos.data_ptr<float>(), lssin.data_ptr<float>()}};
    const int64_t T = x.size(0), H = x.size(1);
    std::vector<int64_t> rows;
    if (lm_head != nullptr) {
      TORCH_CHECK(lm_head->K == H, "the LM head takes ", lm_head->K, " inputs, the rows have ", H);
      rows = logit_rows;
      for (int64_t row : rows) TORCH_CHECK(row >= 0 && row < T, "logit row ", row, " out of range [0, ", T, ")");
    }
    // one layout per distinct window among the layers (a model with sliding-window layers has two)
    std::vector<StepLayout> steps;
    std::vector<size_t> layout_of(num_layers);
    steps.reserve(2);
    for (int64_t i = 0; i < num_layers; i++) {
      size_t k = 0;
      while (k < steps.size() && steps[k].window != layers[i].window) k++;
      if (k == steps.size()) steps.push_back(step_layout(slot_mapping, context_slots, mask, query_starts, layers[i].window));
      layout_of[i] = k;
    }
    bool latent = false;  // latent-attention layers run layer by layer
    for (int64_t i = 0; i < num_layers; i++) latent = latent || !layers[i].mla.empty();
    if (T <= team_max_rows.load() && num_layers > 0 && !latent)
      return forward_team(x, tables, k_pools, v_pools, steps, layout_of, scale, num_layers, capture, lm_head, rows);
    std::vector<torch::Tensor> out(3);
    out[2] = torch::empty({T, (int64_t)capture.size() * H}, x.options());
    for (int64_t i = 0; i < num_layers; i++) {
      const float* const* rope = tables[layers[i].local_rope];
      decoder_layer(layers[i], x.data_ptr<float>(), T, H, rope[0], rope[1],
                    const_cast<torch::Tensor&>(k_pools[i]), const_cast<torch::Tensor&>(v_pools[i]), steps[layout_of[i]],
                    scale);
      capture_into(capture, i, x.data_ptr<float>(), T, H, out[2].data_ptr<float>());
    }
    out[0] = torch::empty_like(x);
    rms_norm_rows(x.data_ptr<float>(), norm.data_ptr<float>(), (float)eps, T, H, out[0].data_ptr<float>());
    out[1] = lm_head == nullptr ? torch::empty({0}, x.options())
                                : linear(out[0].index_select(0, torch::tensor(rows, torch::kInt64)), *lm_head);
    return out;
  }

  // forward for T <= team_max_rows rows, the whole stack in one OpenMP team (see decoder_layer_team).
  std::vector<torch::Tensor> forward_team(torch::Tensor x, const float* const (*tables)[2],
                                          const std::vector<torch::Tensor>& k_pools,
                                          const std::vector<torch::Tensor>& v_pools,
                                          const std::vector<StepLayout>& steps, const std::vector<size_t>& layout_of,
                                          double scale, int64_t num_layers, const std::vector<int64_t>& capture,
                                          const QMatrix* lm_head, const std::vector<int64_t>& rows) const {
    const int64_t T = x.size(0), H = x.size(1), N = (int64_t)rows.size(), nthreads = at::get_num_threads();
    int64_t qkv_w = 0, attn_w = 0, inter = 0;
    for (int64_t i = 0; i < num_layers; i++) {  // everything that could throw is checked before the team starts
      const Layer& L = layers[i];
      TORCH_CHECK(L.qkv.K == H && L.ln2.numel() == H, "layer ", i, " does not take ", H, "-wide rows");
      TORCH_CHECK(k_pools[i].dtype() == v_pools[i].dtype() && k_pools[i].is_contiguous() && v_pools[i].is_contiguous() &&
                  (k_pools[i].dtype() == torch::kFloat16 || k_pools[i].dtype() == torch::kFloat32),
                  "K/V pools must be contiguous float32 or float16 of one dtype");
      qkv_w = std::max(qkv_w, L.qkv.N());
      attn_w = std::max(attn_w, L.n_heads * L.head_dim);
      inter = std::max(inter, mlp_width(L));
    }
    static thread_local TeamBuffers own;
    TeamBuffers& sh = own;  // the calling thread's, shared with the team (inside, `own` names each member's)
    grow(sh.qkv, T * qkv_w); grow(sh.attn, T * attn_w); grow(sh.o, T * H); grow(sh.gu, T * 2 * inter);
    static thread_local std::vector<AttentionPlan> own_plans;  // one per layout, the calling thread's
    std::vector<AttentionPlan>& plans = own_plans;
    if (plans.size() < steps.size()) plans.resize(steps.size());
    for (size_t k = 0; k < steps.size(); k++)
      plan_attention(steps[k].vis, layers[0].n_heads, layers[0].head_dim, nthreads, plans[k]);
    std::vector<torch::Tensor> out{torch::empty_like(x),
                                   lm_head == nullptr ? torch::empty({0}, x.options()) : torch::empty({N, lm_head->N()}, x.options()),
                                   torch::empty({T, (int64_t)capture.size() * H}, x.options())};
    float* features = out[2].data_ptr<float>();
    float* xs = x.data_ptr<float>();
    float *normed = out[0].data_ptr<float>(), *logits = lm_head == nullptr ? nullptr : out[1].data_ptr<float>();
#pragma omp parallel num_threads(nthreads)
    {
      static thread_local std::vector<float> own_x, own_h;
      static thread_local QAct qx;
      float* xm = grow(own_x, T * H);
      float* hm = grow(own_h, std::max(T, N) * std::max(H, inter));
      std::memcpy(xm, xs, T * H * sizeof(float));
      for (int64_t i = 0; i < num_layers; i++) {
        const float* const* rope = tables[layers[i].local_rope];
        decoder_layer_team(layers[i], xm, T, H, rope[0], rope[1], const_cast<torch::Tensor&>(k_pools[i]),
                           const_cast<torch::Tensor&>(v_pools[i]), steps[layout_of[i]], scale, sh, hm, qx, nullptr,
                           &plans[layout_of[i]]);
#pragma omp master
        capture_into(capture, i, xm, T, H, features);
      }
#pragma omp master
      {
        rms_norm_rows(xm, norm.data_ptr<float>(), (float)eps, T, H, normed);
        std::memcpy(xs, xm, T * H * sizeof(float));
      }
      if (lm_head != nullptr && N > 0) {  // each member norms the rows that need logits, then the team's product
        for (int64_t n = 0; n < N; n++)
          rms_norm_rows(xm + rows[n] * H, norm.data_ptr<float>(), (float)eps, 1, H, hm + n * H);
        matmul_team(*lm_head, hm, N, H, qx, logits, lm_head->N());
      }
    }
    return out;
  }
};

}  // namespace
