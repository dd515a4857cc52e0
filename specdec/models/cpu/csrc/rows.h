// Row kernels over the model's output logits, float32 [N, V]: argmax_rows (greedy), logprob_rows (a token's
// log-softmax and the k largest), mask_rows (structured output's bitmask), race_rows and race_logit_row (a keyed
// sample). Independent of the weights: they only share simd.h's instruction-set choice, and each row's result does
// not depend on the others.
#pragma once
#include "simd.h"

namespace {

#ifdef SPECDEC_AVX2
// Per lane, the larger value and its index (the earlier one on ties: only a strictly larger value replaces it).
inline void keep_larger(__m256 v, __m256i idx, __m256& vmax, __m256i& vidx) {
  const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
  vmax = _mm256_blendv_ps(vmax, v, gt);
  vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(idx), gt));
}

// The lanes' best: the largest value, the lowest index among equal ones.
inline void best_lane(__m256 vmax, __m256i vidx, float& top, int64_t& best) {
  alignas(32) float lv[8];
  alignas(32) int32_t li[8];
  _mm256_store_ps(lv, vmax);
  _mm256_store_si256((__m256i*)li, vidx);
  top = lv[0]; best = li[0];
  for (int l = 1; l < 8; l++)
    if (lv[l] > top || (lv[l] == top && li[l] < best)) { top = lv[l]; best = li[l]; }
}
#endif

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
        keep_larger(v, cur, vmax, vidx);
      }
      best_lane(vmax, vidx, top, best);
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

// ---- the keyed exponential race (sampling.py's keyed_sample) ----------------------------------------------------
// Row n's token is argmax_v p[v] / E(key_n, v), with E ~ Exp(1) a function of the key and the token id alone: the
// 32 bits of a counter-based hash of (key, v) (two rounds of the lowbias32 mixer) give a uniform u = (bits / 2^9 +
// 1/2) / 2^23, exactly a float strictly inside (0, 1), and E = -log u (Cephes' logf polynomial, fixed operations).
// No generator state: a row is drawn in one pass over its V values (torch's exponential_ took 0.9 ms for a 49k
// vocabulary on Zen 4, a quarter of a decode step), and the scalar and vector paths run the same float operations,
// so every build draws the same token.
inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16; h *= 0x7feb352dU; h ^= h >> 15; h *= 0x846ca68bU; h ^= h >> 16;
  return h;
}
inline uint32_t race_bits(uint32_t k0, uint32_t k1, uint32_t v) { return mix32(mix32(v * 0x9E3779B9U + k0) ^ k1); }

// -log(u) for u in (0, 1) as Cephes' logf computes log: u = m 2^e, m in [sqrt(1/2), sqrt(2)), a degree-9 polynomial.
constexpr float LOG_P[9] = {7.0376836292E-2f, -1.1514610310E-1f, 1.1676998740E-1f, -1.2420140846E-1f, 1.4249322787E-1f,
                            -1.6668057665E-1f, 2.0000714765E-1f, -2.4999993993E-1f, 3.3333331174E-1f};
inline float race_exp1(uint32_t bits) {
  const float u = ((float)(bits >> 9) + 0.5f) * (1.f / 8388608.f);  // exact: 24 bits
  uint32_t ub;
  std::memcpy(&ub, &u, 4);
  float e = (float)((int32_t)(ub >> 23) - 126);
  uint32_t mb = (ub & 0x007fffffU) | 0x3f000000U;  // m in [1/2, 1)
  float m;
  std::memcpy(&m, &mb, 4);
  if (m < 0.707106781186547524f) { e -= 1.f; m = m + m - 1.f; } else { m = m - 1.f; }
  const float z = m * m;
  float y = LOG_P[0];
  for (int i = 1; i < 9; i++) y = std::fma(y, m, LOG_P[i]);
  y = y * m * z;
  y = std::fma(e, -2.12194440e-4f, y);
  y = std::fma(-0.5f, z, y);
  float x = m + y;
  x = std::fma(e, 0.693359375f, x);
  return -x;
}

#ifdef SPECDEC_AVX2
inline __m256i mix32x8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int32_t)0x7feb352dU));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int32_t)0x846ca68bU));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// race_exp1 of 8 lanes, the same operations.
inline __m256 race_exp1x8(__m256i bits) {
  const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bits, 9)), _mm256_set1_ps(0.5f)),
                                 _mm256_set1_ps(1.f / 8388608.f));
  const __m256i ub = _mm256_castps_si256(u);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(ub, 23), _mm256_set1_epi32(126)));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(ub, _mm256_set1_epi32(0x007fffff)),
                                                 _mm256_set1_epi32(0x3f000000)));
  const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_sub_ps(e, _mm256_and_ps(small, _mm256_set1_ps(1.f)));
  m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(small, m)), _mm256_set1_ps(1.f));
  const __m256 z = _mm256_mul_ps(m, m);
  __m256 y = _mm256_set1_ps(LOG_P[0]);
  for (int i = 1; i < 9; i++) y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(LOG_P[i]));
  y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fmadd_ps(_mm256_set1_ps(-0.5f), z, y);
  __m256 x = _mm256_add_ps(m, y);
  x = _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), x);
  return _mm256_sub_ps(_mm256_setzero_ps(), x);
}
#endif

#ifdef SPECDEC_AVX2
// race_bits of 8 consecutive token ids (lanes of `ids`), the same operations.
inline __m256i race_bits8(__m256i ids, __m256i k0, __m256i k1) {
  const __m256i gold = _mm256_set1_epi32((int32_t)0x9E3779B9U);
  return mix32x8(_mm256_xor_si256(mix32x8(_mm256_add_epi32(_mm256_mullo_epi32(ids, gold), k0)), k1));
}
#endif

// The race over one row of V values: the first index of the largest p[v] / E(key, v). The 8-lane path maps each block
// of values to p with p8 (the last block padded with `pad`, a value p8 maps to 0, so every value goes through the same
// lanes' operations and a padded lane never wins: a real lane scores as much and comes first); the portable path
// maps each value with p1. Scores are >= 0, so -1 starts below every lane.
template <class P8, class P1>
int64_t race_row(const float* r, int64_t V, uint64_t key, float pad, P8 p8, P1 p1) {
  const uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
  int64_t best = 0;
  float top = -1.f;
#ifdef SPECDEC_AVX2
  (void)p1;
  const __m256i step = _mm256_set1_epi32(8), kk0 = _mm256_set1_epi32((int32_t)k0), kk1 = _mm256_set1_epi32((int32_t)k1);
  __m256i cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), vidx = cur;
  __m256 vmax = _mm256_set1_ps(-1.f);
  alignas(32) float tail[8];
  for (int64_t i = 0; i < V; i += 8) {
    const float* src = r + i;
    if (i + 8 > V) {
      for (int l = 0; l < 8; l++) tail[l] = i + l < V ? r[i + l] : pad;
      src = tail;
    }
    keep_larger(_mm256_div_ps(p8(_mm256_loadu_ps(src)), race_exp1x8(race_bits8(cur, kk0, kk1))), cur, vmax, vidx);
    cur = _mm256_add_epi32(cur, step);
  }
  best_lane(vmax, vidx, top, best);
#else
  (void)p8; (void)pad;
  for (int64_t i = 0; i < V; i++) {
    const float v = p1(r[i]) / race_exp1(race_bits(k0, k1, (uint32_t)i));
    if (v > top) { top = v; best = i; }
  }
#endif
  return best;
}

// One token per row of probs float32 [N, V] (unnormalized is fine; a zero is never chosen while any value is
// positive) for keys int64 [N]: the first index of the largest p / E. Returns int64 [N].
torch::Tensor race_rows(const torch::Tensor& probs, const torch::Tensor& keys) {
  TORCH_CHECK(probs.dtype() == torch::kFloat32 && probs.dim() == 2, "probs must be float32 [N, V]");
  TORCH_CHECK(keys.dtype() == torch::kInt64 && keys.dim() == 1 && keys.size(0) == probs.size(0),
              "keys must be int64 [N]");
  auto x = probs.contiguous();
  auto k = keys.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "rows of 1 to 2^31 - 1 values");
  auto out = torch::empty({N}, torch::kInt64);
#ifdef SPECDEC_AVX2
  const auto p8 = [](__m256 p) { return p; };
#else
  const auto p8 = [](float p) { return p; };  // unused: the portable path maps each value alone
#endif
  for (int64_t n = 0; n < N; n++)
    out.data_ptr<int64_t>()[n] = race_row(x.data_ptr<float>() + n * V, V, (uint64_t)k.data_ptr<int64_t>()[n], 0.f, p8,
                                          [](float p) { return p; });
  return out;
}

// The keyed race straight from one row of logits at an inverse temperature (a request that sets no top-k, top-p or
// min-p): p[v] = exp((x[v] - max) inv_t), unnormalized, raced as race_rows does, in two passes over the row (its
// maximum, then the race) where a softmax would write a new row first. A value of -inf (a grammar's mask) or one
// whose exponent falls under -87 gets p = 0: never drawn (the portable build's scalar exp may differ in the last bit).
int64_t race_logit_row(const torch::Tensor& logits, double inv_t, int64_t key) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() == 1 && logits.is_contiguous() && logits.numel() > 0 &&
              logits.numel() < (int64_t(1) << 31), "logits must be a contiguous float32 row of 1 to 2^31 - 1 values");
  const float* r = logits.data_ptr<float>();
  const int64_t V = logits.numel();
  const float t = (float)inv_t;
  float mx = -INFINITY;
  int64_t i = 0;
#ifdef SPECDEC_AVX2
  __m256 m8 = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= V; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(r + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  for (int l = 0; l < 8; l++) mx = std::max(mx, lanes[l]);
#endif
  for (; i < V; i++) mx = std::max(mx, r[i]);
#ifdef SPECDEC_AVX2
  const __m256 vm = _mm256_set1_ps(mx), vt = _mm256_set1_ps(t), floor = _mm256_set1_ps(-87.f);
  const auto p8 = [&](__m256 x) {
    const __m256 a = _mm256_mul_ps(_mm256_sub_ps(x, vm), vt);
    return _mm256_and_ps(exp_ps(a), _mm256_cmp_ps(a, floor, _CMP_GE_OQ));
  };
#else
  const auto p8 = [](float x) { return x; };  // unused: the portable path maps each value alone
#endif
  return race_row(r, V, (uint64_t)key, -INFINITY, p8, [&](float x) {
    const float a = (x - mx) * t;
    return a >= -87.f ? std::exp(a) : 0.f;
  });
}

}  // namespace
