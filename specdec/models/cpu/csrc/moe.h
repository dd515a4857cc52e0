// A mixture-of-experts MLP for a step's rows (models/moe.py's, in one native pass):
//
//   route:    p = softmax(h @ router.T (+ router_b)) per row; its top k experts, by descending p (the first index at a tie); their
//             weights renormalized to sum 1 where norm_topk
//   experts:  for each expert e in ascending order, the rows that chose it gathered into one block, then
//             down_e(act(gate_up_e(rows))) (with each expert's biases where it has them): its weights read once a step, whatever number of rows (a
//             batch, its draft rows) chose it
//   combine:  out[t] = sum over the row's ranks j = 0..k-1 in order of w[t, j] y_j[t]  (+ sigmoid(h . shared_gate)
//             shared(h) with a shared expert, Qwen2-MoE's)
//
// Every product is the GEMM whose rows do not depend on the call's other rows, and each row's sum runs over its own
// ranks in one order: a row gets the same bits alone or in any batch. Alone (TEAM false) each product is a parallel
// region of its own; in a thread team each member routes every row itself (the same values) and the products split
// their columns across the team, ending in barriers.
#pragma once
#include "gemm.h"

namespace {

struct Experts {
  torch::Tensor router;  // [E, H] float32
  torch::Tensor router_b;  // [E] float32 added to the router's logits (gpt-oss), or empty
  std::vector<torch::Tensor> gate_up_b, down_b;  // per expert [2I] and [H] float32 biases (gpt-oss), or none
  std::vector<QMatrix> gate_up, down;  // per expert: [2I, H] (gate rows, then up rows) and [H, I]
  std::vector<QMatrix> shared;  // a shared expert's {gate_up, down}, or none
  torch::Tensor shared_gate;  // [H] float32, with a shared expert
  int64_t top_k = 0;
  bool norm_topk = false;
  // DeepSeek's routing: sigmoid scores (1; 0 softmax), a correction bias that steers only the choice, the choice
  // limited to the topk_groups best of `groups` groups (scored by their best expert under softmax, best two under
  // sigmoid), the weights times `scale`
  int64_t scoring = 0, groups = 1, topk_groups = 1;
  torch::Tensor choice_b;
  float scale = 1.f;

  bool empty() const { return gate_up.empty(); }
  // the widest intermediate of its experts (buffers)
  int64_t width() const {
    int64_t w = shared.empty() ? 0 : shared[0].N() / 2;
    for (const auto& m : gate_up) w = std::max(w, m.N() / 2);
    return w;
  }
};

// Each row's top-k experts and weights (ids, w: [T, k]) from its normed input h [T, H].
void route(const Experts& X, const float* h, int64_t T, int64_t H, int64_t* ids, float* w) {
  const int64_t E = X.router.size(0), k = X.top_k, G = X.groups, per = E / G;
  const float* R = X.router.data_ptr<float>();
  const float* rb = X.router_b.numel() > 0 ? X.router_b.data_ptr<float>() : nullptr;
  const float* cb = X.choice_b.numel() > 0 ? X.choice_b.data_ptr<float>() : nullptr;
  std::vector<float> p(E), choice(E), gscore(G);
  std::vector<char> taken(E), open(G);
  for (int64_t t = 0; t < T; t++) {
    float top = -INFINITY, sum = 0.f;
    for (int64_t e = 0; e < E; e++) {
      p[e] = dot_f32(h + t * H, R + e * H, H) + (rb ? rb[e] : 0.f);
      top = std::max(top, p[e]);
    }
    if (X.scoring == 1) {
      for (int64_t e = 0; e < E; e++) p[e] = 1.f / (1.f + std::exp(-p[e]));
    } else {
      for (int64_t e = 0; e < E; e++) { p[e] = std::exp(p[e] - top); sum += p[e]; }
      for (int64_t e = 0; e < E; e++) p[e] = p[e] / sum;
    }
    for (int64_t e = 0; e < E; e++) choice[e] = cb ? p[e] + cb[e] : p[e];
    std::fill(open.begin(), open.end(), 1);
    if (G > 1) {  // only the topk_groups best groups' experts compete
      for (int64_t g = 0; g < G; g++) {
        float a = -INFINITY, b = -INFINITY;  // the group's best and second best
        for (int64_t e = g * per; e < (g + 1) * per; e++) {
          if (choice[e] > a) { b = a; a = choice[e]; }
          else if (choice[e] > b) b = choice[e];
        }
        gscore[g] = X.scoring == 1 ? a + b : a;
      }
      std::fill(open.begin(), open.end(), 0);
      for (int64_t j = 0; j < X.topk_groups; j++) {
        int64_t best = -1;
        for (int64_t g = 0; g < G; g++)
          if (!open[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
        open[best] = 1;
      }
    }
    for (int64_t e = 0; e < E; e++) taken[e] = !open[e / per];
    float kept = 0.f;
    for (int64_t j = 0; j < k; j++) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; e++)
        if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
      taken[best] = 1;
      ids[t * k + j] = best;
      w[t * k + j] = p[best];
      kept += w[t * k + j];
    }
    if (X.norm_topk)
      for (int64_t j = 0; j < k; j++) w[t * k + j] /= X.scoring == 1 ? kept + 1e-20f : kept;
    if (X.scale != 1.f)
      for (int64_t j = 0; j < k; j++) w[t * k + j] *= X.scale;
  }
}

using GateFn = void (*)(const float*, int64_t, float*);

// The gated MLP's product of one row's halves g = [gate | up] (inter each) into out: fn (SiLU or GELU gating), or
// gpt-oss's clamped SwiGLU where limit > 0: min(gate, limit) sigmoid(alpha min(gate, limit)) (clamp(up) + 1).
struct Gate {
  GateFn fn;
  float alpha = 0.f, limit = 0.f;
  void operator()(const float* g, int64_t inter, float* out) const {
    if (limit <= 0.f) return fn(g, inter, out);
    for (int64_t i = 0; i < inter; i++) {
      const float x = std::min(g[i], limit), u = std::min(std::max(g[inter + i], -limit), limit);
      out[i] = x * (1.f / (1.f + std::exp(-(x * alpha)))) * (u + 1.f);
    }
  }
};

// The mixture's output for h [T, H] into the caller's own out [T, H]. gu [T, 2 width] and o [T, H]: product outputs
// (shared within a team); every other buffer is the calling thread's own.
template <bool TEAM>
void moe_mlp(const Experts& X, const float* h, int64_t T, int64_t H, const Gate& gate, QAct& qx, float* gu, float* o,
             float* out) {
  auto product = [&](const QMatrix& M, const float* in, int64_t M_rows, int64_t K, float* y, int64_t N) {
    if constexpr (TEAM) matmul_team(M, in, M_rows, K, qx, y, N);
    else matmul(M, in, M_rows, K, qx, y, N);
  };
  const int64_t k = X.top_k, E = (int64_t)X.gate_up.size();
  static thread_local std::vector<int64_t> ids, rows, ranks;
  static thread_local std::vector<float> w, g, a, ys, biased;
  grow(ids, T * k); grow(w, T * k);
  route(X, h, T, H, ids.data(), w.data());
  float* ysp = grow(ys, k * T * H);
  float* gp = grow(g, T * H);
  float* ap = grow(a, T * X.width());
  for (int64_t e = 0; e < E; e++) {  // the same order for every member: each reaches the same products
    rows.clear(); ranks.clear();
    for (int64_t i = 0; i < T * k; i++)
      if (ids[i] == e) { rows.push_back(i / k); ranks.push_back(i % k); }
    const int64_t n = (int64_t)rows.size(), inter = X.gate_up[e].N() / 2;
    if (n == 0) continue;
    for (int64_t r = 0; r < n; r++) std::memcpy(gp + r * H, h + rows[r] * H, H * sizeof(float));
    product(X.gate_up[e], gp, n, H, gu, 2 * inter);
    if (X.gate_up_b.empty()) {
      for (int64_t r = 0; r < n; r++) gate(gu + r * 2 * inter, inter, ap + r * inter);
    } else {  // biases on the member's own copy (gu and o are shared within a team)
      const float* b = X.gate_up_b[e].data_ptr<float>();
      float* row = grow(biased, 2 * inter);
      for (int64_t r = 0; r < n; r++) {
        for (int64_t i = 0; i < 2 * inter; i++) row[i] = gu[r * 2 * inter + i] + b[i];
        gate(row, inter, ap + r * inter);
      }
    }
    product(X.down[e], ap, n, inter, o, H);
    const float* db = X.down_b.empty() ? nullptr : X.down_b[e].data_ptr<float>();
    for (int64_t r = 0; r < n; r++) {
      float* y = ysp + (ranks[r] * T + rows[r]) * H;
      if (db) for (int64_t i = 0; i < H; i++) y[i] = o[r * H + i] + db[i];
      else std::memcpy(y, o + r * H, H * sizeof(float));
    }
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < H; i++) {
      float acc = ysp[t * H + i] * w[t * k];
      for (int64_t j = 1; j < k; j++) acc = acc + ysp[(j * T + t) * H + i] * w[t * k + j];
      out[t * H + i] = acc;
    }
  if (!X.shared.empty()) {
    const int64_t inter = X.shared[0].N() / 2;
    product(X.shared[0], h, T, H, gu, 2 * inter);
    for (int64_t t = 0; t < T; t++) gate(gu + t * 2 * inter, inter, ap + t * inter);
    product(X.shared[1], ap, T, inter, o, H);
    const float* sg = X.shared_gate.numel() > 0 ? X.shared_gate.data_ptr<float>() : nullptr;  // DeepSeek's: none
    for (int64_t t = 0; t < T; t++) {
      if (!sg) {
        for (int64_t i = 0; i < H; i++) out[t * H + i] += o[t * H + i];
        continue;
      }
      const float s = 1.f / (1.f + std::exp(-dot_f32(h + t * H, sg, H)));
      for (int64_t i = 0; i < H; i++) out[t * H + i] += s * o[t * H + i];
    }
  }
  if constexpr (TEAM) {
#pragma omp barrier
  }
}

}  // namespace
