// Row kernels over the model's output logits, float32 [N, V]: argmax_rows (greedy), logprob_rows (a token's
// log-softmax and the k largest) and mask_rows (structured output's bitmask). Independent of the weights: they only
// share simd.h's instruction-set choice, and each row's result does not depend on the others.
#pragma once
#include "simd.h"

namespace {

// The index of each row's largest value, the first one on ties (torch.argmax's rule). logits: float32 [..., V] ->
// int64 [...].
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() >= 1, "logits must be float32 [..., V]");
  auto x = logits.contiguous();
  const int64_t V = x.size(-1), N = V > 0 ? x.numel() / V : 0;
  TORCH_CHECK(V > 0, "argmax of an empty row");
  auto out = torch::empty(x.sizes().slice(0, x.dim() - 1), torch::kInt64);
  for (int64_t n = 0; n < N; n++) {
    const float* r = x.data_ptr<float>() + n * V;
    int64_t best = 0, i = 0;
    float top = r[0];
#ifdef SPECDEC_AVX2
    if (V >= 8) {  // per lane: the largest value and its first index; then the lanes' best, lowest index on ties
      __m256 vmax = _mm256_loadu_ps(r);
      __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = vidx;
      const __m256i step = _mm256_set1_epi32(8);
      for (i = 8; i + 8 <= V; i += 8) {
        cur = _mm256_add_epi32(cur, step);
        const __m256 v = _mm256_loadu_ps(r + i);
        const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
        vmax = _mm256_blendv_ps(vmax, v, gt);
        vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
      }
      alignas(32) float lv[8];
      alignas(32) int32_t li[8];
      _mm256_store_ps(lv, vmax);
      _mm256_store_si256((__m256i*)li, vidx);
      top = lv[0]; best = li[0];
      for (int l = 1; l < 8; l++)
        if (lv[l] > top || (lv[l] == top && li[l] < best)) { top = lv[l]; best = li[l]; }
    }
#endif
    for (; i < V; i++)
      if (r[i] > top) { top = r[i]; best = i; }
    out.data_ptr<int64_t>()[n] = best;
  }
  return out;
}

// Logprobs: for each row of logits float32 [N, V], the log-softmax value of tokens[n] and the k largest
// log-softmax values with their indices, largest first (lowest index first among equal values). One pass for
// the maximum and the top k (a sorted list of k; a block of 8 lanes is looked at only when one beats the k-th),
// one for sum exp(x - max). Returns {picked [N], values [N, k], indices int64 [N, k]}.
std::vector<torch::Tensor> logprob_rows(const torch::Tensor& logits, const torch::Tensor& tokens, int64_t k) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() == 2, "logits must be float32 [N, V]");
  TORCH_CHECK(tokens.dtype() == torch::kInt64 && tokens.dim() == 1 && tokens.size(0) == logits.size(0),
              "tokens must be int64 [N]");
  auto x = logits.contiguous();
  auto t = tokens.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0 && 0 <= k && k <= V, "need 0 <= k <= V and V > 0");
  auto picked = torch::empty({N}, torch::kFloat32);
  auto values = torch::empty({N, k}, torch::kFloat32);
  auto indices = torch::empty({N, k}, torch::kInt64);
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> tv(k + 1);
  std::vector<int64_t> ti(k + 1);
  for (int64_t n = 0; n < N; n++) {
    const float* r = x.data_ptr<float>() + n * V;
    const int64_t token = t.data_ptr<int64_t>()[n];
    TORCH_CHECK(0 <= token && token < V, "token id out of the row");
    int64_t m = 0;  // entries in the top list, sorted: tv[0] largest
    auto offer = [&](float v, int64_t i) {
      if (k == 0 || (m == k && !(v > tv[k - 1]))) return;  // not above the k-th (an equal later index loses)
      int64_t j = m < k ? m++ : k - 1;
      while (j > 0 && v > tv[j - 1]) { tv[j] = tv[j - 1]; ti[j] = ti[j - 1]; j--; }
      tv[j] = v; ti[j] = i;
    };
    float top = ninf;
    int64_t i = 0;
#ifdef SPECDEC_AVX2
    __m256 vmax = _mm256_set1_ps(ninf);
    for (; i + 8 <= V; i += 8) {
      const __m256 v = _mm256_loadu_ps(r + i);
      vmax = _mm256_max_ps(vmax, v);
      if (k && _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(m == k ? tv[k - 1] : ninf), _CMP_GT_OQ)) |
               (m < k))
        for (int l = 0; l < 8; l++) offer(r[i + l], i + l);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    for (int l = 0; l < 8; l++) top = std::max(top, lanes[l]);
#endif
    for (; i < V; i++) { top = std::max(top, r[i]); offer(r[i], i); }
    double total = 0.0;
    i = 0;
#ifdef SPECDEC_AVX2
    __m256 acc = _mm256_setzero_ps();
    const __m256 vt = _mm256_set1_ps(top);
    for (; i + 8 <= V; i += 8) acc = _mm256_add_ps(acc, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(r + i), vt)));
    total = hsum(acc);
#endif
    for (; i < V; i++) total += std::exp(r[i] - top);
    const float lse = top + (float)std::log(total);
    picked.data_ptr<float>()[n] = r[token] - lse;
    for (int64_t j = 0; j < k; j++) {
      values.data_ptr<float>()[n * k + j] = tv[j] - lse;
      indices.data_ptr<int64_t>()[n * k + j] = ti[j];
    }
  }
  return {picked, values, indices};
}

// Structured output: logits of the tokens a grammar's bitmask forbids become -inf, in place. Bit t % 32 of
// word t / 32 allows token t (xgrammar's layout). logits: float32 [N, V]; bitmask: int32 [N, ceil(V / 32)].
void mask_rows(torch::Tensor& logits, const torch::Tensor& bitmask) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be contiguous float32 [N, V]");
  TORCH_CHECK(bitmask.dtype() == torch::kInt32 && bitmask.dim() == 2 && bitmask.is_contiguous() &&
              bitmask.size(0) == logits.size(0) && bitmask.size(1) * 32 >= logits.size(1),
              "bitmask must be contiguous int32 [N, ceil(V / 32)]");
  const int64_t N = logits.size(0), V = logits.size(1), W = bitmask.size(1);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t n = 0; n < N; n++) {
    float* r = logits.data_ptr<float>() + n * V;
    const uint32_t* m = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + n * W;
    for (int64_t w = 0; w < W && w * 32 < V; w++) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t end = std::min<int64_t>(32, V - w * 32);
      for (int64_t b = 0; b < end; b++)
        if (!((bits >> b) & 1u)) r[w * 32 + b] = ninf;
    }
  }
}

}  // namespace
