// Activation quantization: the int8 blocks every integer GEMM multiplies. A float32 row of K values becomes K / 32
// blocks of 32 int8 with one scale each (QAct, stored in tiles of rows so that a kernel tile addresses its rows from
// one pointer; RowTile), by quantize_rows. Its own header because the GEMM (gemm.h) and the layer (layer.h) both
// consume it, and because the AVX2 quantizer must keep computing exactly the scalar definition's integers.
#pragma once
#include "formats.h"

namespace {

// ---------------------------------------------------------------------------------------------------------
// Activations: rows of K floats -> int8 blocks of 32 with scale d and s = d * sum(q).
// ---------------------------------------------------------------------------------------------------------

// Rows are stored in tiles of ROW_TILE (the last one shorter): within a tile, block 0 of each row, then block 1 of
// each row, ... So a kernel tile of rows (never crossing a ROW_TILE boundary: tiles of 8, or of 4 from a multiple of
// 4) finds row r of block j at a constant offset from one pointer: few registers for addresses however many rows.
constexpr int ROW_TILE = 8;

struct QAct {
  std::vector<int8_t> q;  // 32 int8 per block
  std::vector<float> d, s;  // per block: the scale d, and s = d * sum(q)
  std::vector<int32_t> nh, ns;  // per block: -sum(q) over each half (2 per block), and over the block (the integer
                                // offsets of Q4_0, Q5_0, Q6_K and of VNNI's biased signed weights)
  int64_t M = 0, K = 0;
  // the block index of row m's block 0, and the index step from one of its blocks to the next
  int64_t first(int64_t m) const { return (m / ROW_TILE * ROW_TILE) * (K / QK) + m % ROW_TILE; }
  int64_t step(int64_t m) const { return std::min<int64_t>(ROW_TILE, M - m / ROW_TILE * ROW_TILE); }
};

// Row m0's blocks, and rows m0 + r of the same kernel tile at block index i + r.
struct RowTile {
  const int8_t* q;
  const float *d, *s;
  const int32_t *nh, *ns;
  int64_t step;
  RowTile(const QAct& x, int64_t m0) : step(x.step(m0)) {
    const int64_t i = x.first(m0);
    q = x.q.data() + i * QK; d = x.d.data() + i; s = x.s.data() + i; nh = x.nh.data() + 2 * i; ns = x.ns.data() + i;
  }
};

// One block of 32: the scalar definition; the AVX2 path below computes the same values (the multiply by 1/d is
// the same float multiply, and cvtps rounds to nearest even as nearbyint does in the default rounding mode).
inline void quantize_block(const float* xb, int8_t* qb, float& d_out, float& s_out, int32_t h_out[2], int32_t& ns_out) {
#ifdef SPECDEC_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) { v[i] = _mm256_loadu_ps(xb + 8 * i); m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i])); }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i q[4];
  for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));
  for (int half = 0; half < 2; half++) {
    const __m256i sum = _mm256_add_epi32(q[2 * half], q[2 * half + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    h_out[half] = _mm_cvtsi128_si32(s4);
  }
  // int32 -> int16 -> int8 (no value leaves [-127, 127]); packs interleave 128-bit lanes, the permute undoes it
  __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
  __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)qb, p8);
  d_out = d;
  s_out = d * (float)(h_out[0] + h_out[1]);
#else
  float amax = 0.f;
  for (int i = 0; i < QK; i++) amax = std::max(amax, std::fabs(xb[i]));
  float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
  h_out[0] = h_out[1] = 0;
  for (int i = 0; i < QK; i++) {
    int v = (int)std::nearbyint(xb[i] * id);
    qb[i] = (int8_t)v;
    h_out[i / 16] += v;
  }
  d_out = d;
  s_out = d * (float)(h_out[0] + h_out[1]);
#endif
  ns_out = -(h_out[0] + h_out[1]);  // stored negated: the kernels start their integer sums from -OFFSET * sum
  h_out[0] = -h_out[0]; h_out[1] = -h_out[1];
}

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, QAct& out) {
  out.M = M; out.K = K;
  grow(out.q, M * K); grow(out.d, M * K / QK); grow(out.s, M * K / QK); grow(out.nh, M * K / 16); grow(out.ns, M * K / QK);
  // blocks are independent: a prefill's rows spread over the threads, a decode step's stay on this one
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      const int64_t first = out.first(m), step = out.step(m);
      for (int64_t b = 0; b < K / QK; b++) {
        const int64_t i = first + b * step;
        quantize_block(x + m * ldx + b * QK, out.q.data() + i * QK, out.d[i], out.s[i], out.nh.data() + 2 * i, out.ns[i]);
      }
    }
  });
}

}  // namespace
