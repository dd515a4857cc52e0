// An EAGLE-3 head's draft step in one call and one thread team: fc over the target's features (or the head's own
// previous output), its decoder layer whose QKV reads [norm(embedding), norm(hidden)], the final norm, the LM head
// over the draft vocabulary and the greedy draft tokens as target ids. The Python path (models/eagle3.py) runs the
// same functions one call at a time (linear, rms_norm, Layer.forward, argmax_rows): the same bits, so a chain
// drafted either way has the same tokens. One call instead of a dozen: a drafting step costs its arithmetic, not
// the host's round trips and a parallel region per product.
#pragma once
#include "layer.h"
#include "rows.h"

namespace {

struct Eagle3Step {
  QMatrix fc;  // [H, aux * H]: the target's features -> the head's hidden state
  Layer layer;  // ln1 norms the embeddings; its QKV reads 2H
  torch::Tensor hidden_norm, norm;  // float32 [H]
  QMatrix lm_head;  // [draft vocab, H]
  torch::Tensor d2t;  // int64 [draft vocab]: target id = draft id + d2t[draft id]

  // embeds [T, H] (the tokens each row continues with); input: the target's features [T, fc.K] or the head's own
  // previous outputs [T, H] (`features` says which). Returns out [T, H], the target ids [N] of the head's argmax
  // at rows `rows` and their log-probabilities under the head [N] (what a chain's stopping rule reads). Rows with
  // more than team_max_rows go through the one-call-per-op path.
  std::vector<torch::Tensor> forward(const torch::Tensor& embeds, const torch::Tensor& input, bool features,
                                     const torch::Tensor& rope_cos, const torch::Tensor& rope_sin,
                                     const torch::Tensor& positions, torch::Tensor k_pool, torch::Tensor v_pool,
                                     const torch::Tensor& slot_mapping, const torch::Tensor& context_slots,
                                     const torch::Tensor& mask, const torch::Tensor& query_starts, double scale,
                                     const std::vector<int64_t>& rows) const {
    const int64_t T = embeds.size(0), H = layer.ln2.numel(), V = lm_head.N();
    TORCH_CHECK(embeds.dtype() == torch::kFloat32 && embeds.is_contiguous() && embeds.dim() == 2 && embeds.size(1) == H,
                "embeds must be contiguous float32 [T, ", H, "]");
    const int64_t K = features ? fc.K : H;
    TORCH_CHECK(input.dtype() == torch::kFloat32 && input.is_contiguous() && input.dim() == 2 && input.size(0) == T &&
                input.size(1) == K, "input must be contiguous float32 [", T, ", ", K, "]");
    TORCH_CHECK(layer.qkv.K == 2 * H && lm_head.K == H && fc.N() == H, "not an EAGLE-3 head's shapes");
    TORCH_CHECK(k_pool.dtype() == v_pool.dtype() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                (k_pool.dtype() == torch::kFloat16 || k_pool.dtype() == torch::kFloat32),
                "K/V pools must be contiguous float32 or float16 of one dtype");
    const auto [cos, ssin] = rope_rows(rope_cos, rope_sin, positions);
    check_rows(embeds, cos, ssin, layer.head_dim);
    const int64_t N = (int64_t)rows.size();
    const int64_t* rp = rows.data();
    for (int64_t n = 0; n < N; n++) TORCH_CHECK(rp[n] >= 0 && rp[n] < T, "row ", rp[n], " out of range [0, ", T, ")");
    StepLayout step = step_layout(slot_mapping, context_slots, mask, query_starts, layer.window);
    auto out = torch::empty({T, H}, embeds.options());
    auto logits = torch::empty({N, V}, embeds.options());
    const float *e = embeds.data_ptr<float>(), *in = input.data_ptr<float>();
    float *op = out.data_ptr<float>(), *lp = logits.data_ptr<float>();
    const float *c = cos.data_ptr<float>(), *sn = ssin.data_ptr<float>();
    const float *ln1 = layer.ln1.data_ptr<float>(), *hn = hidden_norm.data_ptr<float>(), *fn = norm.data_ptr<float>();
    const float eps = (float)layer.eps;
    const int64_t inter = layer.gate_up.N() / 2;

    if (T > team_max_rows.load()) {  // one parallel region per product, as the Python path
      static thread_local QAct qx;
      static thread_local std::vector<float> qin_buf, h_buf;
      float* qin = grow(qin_buf, T * 2 * H);
      if (features) matmul(fc, in, T, K, qx, op, H);
      else std::memcpy(op, in, T * H * sizeof(float));
      for (int64_t t = 0; t < T; t++) {
        rms_norm_rows(e + t * H, ln1, eps, 1, H, qin + t * 2 * H);
        rms_norm_rows(op + t * H, hn, eps, 1, H, qin + t * 2 * H + H);
      }
      decoder_layer(layer, op, T, H, c, sn, k_pool, v_pool, step, scale, qin);
      float* hr = grow(h_buf, N * H);
      for (int64_t n = 0; n < N; n++) rms_norm_rows(op + rp[n] * H, fn, eps, 1, H, hr + n * H);
      if (N > 0) matmul(lm_head, hr, N, H, qx, lp, V);
    } else {
      static thread_local TeamBuffers own;
      TeamBuffers& sh = own;  // the calling thread's, shared with the team
      grow(sh.qkv, T * layer.qkv.N()); grow(sh.attn, T * layer.n_heads * layer.head_dim); grow(sh.o, T * H);
      grow(sh.gu, T * 2 * inter);
      const int64_t nthreads = at::get_num_threads();
      plan_attention(step.vis, layer.n_heads, layer.head_dim, nthreads, sh.plan);
#pragma omp parallel num_threads(nthreads)
      {
        static thread_local std::vector<float> own_x, own_h, own_in;
        static thread_local QAct qx;
        float* xm = grow(own_x, T * H);
        float* hm = grow(own_h, std::max(T, N) * std::max(H, inter));
        float* qin = grow(own_in, T * 2 * H);
        if (features) {
          matmul_team(fc, in, T, K, qx, op, H);  // into out, read back by every member
          std::memcpy(xm, op, T * H * sizeof(float));
        } else {
          std::memcpy(xm, in, T * H * sizeof(float));
        }
        for (int64_t t = 0; t < T; t++) {
          rms_norm_rows(e + t * H, ln1, eps, 1, H, qin + t * 2 * H);
          rms_norm_rows(xm + t * H, hn, eps, 1, H, qin + t * 2 * H + H);
        }
        decoder_layer_team(layer, xm, T, H, c, sn, k_pool, v_pool, step, scale, sh, hm, qx, qin);
#pragma omp master
        std::memcpy(op, xm, T * H * sizeof(float));
        for (int64_t n = 0; n < N; n++) rms_norm_rows(xm + rp[n] * H, fn, eps, 1, H, hm + n * H);
        if (N > 0) matmul_team(lm_head, hm, N, H, qx, lp, V);
      }
    }
    auto ids = argmax_rows(logits);
    auto logp = logprob_rows(logits, ids, 0)[0];
    const int64_t* d2 = d2t.data_ptr<int64_t>();
    int64_t* ip = ids.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; n++) ip[n] += d2[ip[n]];
    return {out, ids, logp};
  }
};

}  // namespace
