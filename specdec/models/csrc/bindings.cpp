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
#include "formats.h"
#include "attention.h"

namespace {

// ---------------------------------------------------------------------------------------------------------
// Activations: rows of K floats -> int8 blocks of 32 with scale d and s = d * sum(q).
// ---------------------------------------------------------------------------------------------------------

// v's storage, grown to at least n elements (kept across calls; contents unspecified).
template <class T>
inline T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

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

// ---------------------------------------------------------------------------------------------------------
// GEMM: y[m, n] = dot(w[n], x[m]) for NR activation rows per weight row (the weight block is unpacked once).
// ---------------------------------------------------------------------------------------------------------

#ifdef SPECDEC_AVX2
// 8 int32 sums of 4 products each: lanes 0-3 cover weights 0-15, lanes 4-7 weights 16-31.
template <bool SIGNED>
inline __m256i dot32(__m256i w, __m256i x) {
#ifdef SPECDEC_VNNI
  if (SIGNED) return SPECDEC_DPBUSD(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return SPECDEC_DPBUSD(_mm256_setzero_si256(), w, x);
#else
  // maddubs never saturates here: |w| <= 128 (signed), w <= 63 (unsigned), |x| <= 127.
  __m256i p = SIGNED ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                     : _mm256_maddubs_epi16(w, x);
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}
#endif

// y[m0 + r, n0 + w] for NW weight rows (w) by NR activation rows (r): each weight sub-block is unpacked once
// and used NR times; NW x NR independent accumulators keep the FMA units busy. Every (row, weight row)
// pair runs the same operations in the same order whatever the tile, so tiling never changes a bit.
template <class F, int NW, int NR>
void dot_tile(const uint8_t* w, int64_t row_bytes, const QAct& x, int64_t m0, float* y, int64_t ldy, int64_t n0) {
  const int64_t nsub = x.K / QK;
  const RowTile t(x, m0);
#ifdef SPECDEC_AVX2
  __m256 acc[NW][NR];
  float accm[NW][NR];
  for (int i = 0; i < NW; i++)
    for (int r = 0; r < NR; r++) { acc[i][r] = _mm256_setzero_ps(); accm[i][r] = 0.f; }
  for (int64_t j = 0; j < nsub; j++) {
    const int64_t boff = (j * QK / F::BLOCK) * F::BYTES;
    const int sub = (int)(j % (F::BLOCK / QK));
    __m256i q[NW];
    __m256 scv[NW];
    float mn[NW];
    for (int i = 0; i < NW; i++) {
      const uint8_t* blk = w + i * row_bytes + boff;
      float sc[2];
      F::scales(blk, sub, sc, mn[i]);
      scv[i] = sc[0] == sc[1] ? _mm256_set1_ps(sc[0]) : _mm256_setr_ps(sc[0], sc[0], sc[0], sc[0], sc[1], sc[1], sc[1], sc[1]);
      q[i] = F::quants(blk, sub);
    }
    const int64_t b = j * t.step;
    for (int r = 0; r < NR; r++) {
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(t.q + (b + r) * QK));
      const __m256 dx = _mm256_set1_ps(t.d[b + r]);
      for (int i = 0; i < NW; i++) {
        __m256 p = _mm256_cvtepi32_ps(dot32<F::SIGNED>(q[i], xv));
        acc[i][r] = _mm256_fmadd_ps(p, _mm256_mul_ps(scv[i], dx), acc[i][r]);
        if (!F::SIGNED) accm[i][r] += mn[i] * t.s[b + r];
      }
    }
  }
  for (int i = 0; i < NW; i++)
    for (int r = 0; r < NR; r++) y[(m0 + r) * ldy + n0 + i] = hsum(acc[i][r]) + accm[i][r];
#else
  float acc[NW][NR] = {}, accm[NW][NR] = {};
  uint8_t q[32];
  for (int64_t j = 0; j < nsub; j++) {
    const int64_t boff = (j * QK / F::BLOCK) * F::BYTES;
    const int sub = (int)(j % (F::BLOCK / QK));
    for (int i = 0; i < NW; i++) {
      const uint8_t* blk = w + i * row_bytes + boff;
      float sc[2], mn;
      F::scales(blk, sub, sc, mn);
      F::quants(blk, sub, q);
      for (int r = 0; r < NR; r++) {
        const int64_t b = j * t.step + r;
        const int8_t* xb = t.q + b * QK;
        int lo = 0, hi = 0;
        for (int k = 0; k < 16; k++) {
          int a = F::SIGNED ? (int)(int8_t)q[k] : (int)q[k], b = F::SIGNED ? (int)(int8_t)q[k + 16] : (int)q[k + 16];
          lo += a * xb[k];
          hi += b * xb[k + 16];
        }
        acc[i][r] += (float)lo * (sc[0] * t.d[b]) + (float)hi * (sc[1] * t.d[b]);
        if (!F::SIGNED) accm[i][r] += mn * t.s[b];
      }
    }
  }
  for (int i = 0; i < NW; i++)
    for (int r = 0; r < NR; r++) y[(m0 + r) * ldy + n0 + i] = acc[i][r] + accm[i][r];
#endif
}

// ---------------------------------------------------------------------------------------------------------
// Interleaved rows (each format's X8 view, formats.h): 8 weight rows in the 8 lanes of a vector. One broadcast of
// 4 activation bytes multiplies all 8 rows and the 8 sums land in 8 lanes, no horizontal sums; a sub-block is
// unpacked once for up to 4 activation rows. Every output element still gets one fixed sequence of operations
// (integer sums are exact in any order), so tiling and batch never change a bit.
// ---------------------------------------------------------------------------------------------------------

#ifdef SPECDEC_AVX2
template <class F>
torch::Tensor x8_pack(const torch::Tensor& data, int64_t K) {
  const int64_t groups = data.size(0) / 8, nrec = K / F::BLOCK, row_bytes = data.size(1);
  torch::Tensor out = torch::empty({groups, nrec * F::REC}, torch::kUInt8);
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++)
      for (int64_t s = 0; s < nrec; s++) {
        const uint8_t* blk[8];
        for (int i = 0; i < 8; i++) blk[i] = src + (g * 8 + i) * row_bytes + s * F::BYTES;
        F::pack(blk, dst + (g * nrec + s) * F::REC);
      }
  });
  return out;
}

// The largest unsigned value of F's interleaved quants (0: signed int8), and the integer offset its weights
// subtract (under VNNI signed values are biased by 128 into u8, so 128 more).
template <class F>
constexpr int x8_umax() {
  if constexpr (F::KIND == K_SIGNED) return 0; else return F::UMAX;
}
template <class F>
constexpr int x8_offset() {
#ifdef SPECDEC_VNNI
  if constexpr (F::KIND == K_SIGNED) return 128;
#endif
  if constexpr (F::KIND == K_OFFSET || F::KIND == K_HALVES) return F::OFFSET; else return 0;
}
// ... as a shift: every offset is a power of two, so -OFFSET * sum(x) is the stored -sum(x) shifted left
template <class F>
constexpr int x8_offset_shift() {
  constexpr int off = x8_offset<F>();
  static_assert((off & (off - 1)) == 0, "offsets are powers of two");
  int k = 0;
  while ((1 << k) < off) k++;
  return k;
}

// s0 + the sum over e in [E0, E1) of the 8 rows' 4-weight products with activation word xw[e]: 8 exact int32
// lanes. VNNI: one u8 x s8 instruction per word. AVX2: maddubs into int16, as many summed before widening as
// cannot saturate (2 * UMAX * 127 per instruction); signed weights (UMAX 0) move their signs onto the activations.
template <int UMAX, int E0, int E1>
inline __m256i dot_words(const __m256i* u, const __m256i* au, const int32_t* xw, __m256i s0) {
  __m256i s = s0;
#ifdef SPECDEC_VNNI
  (void)au;
  for (int e = E0; e < E1; e++) s = SPECDEC_DPBUSD(s, u[e], _mm256_set1_epi32(xw[e]));
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (UMAX == 0) {
    for (int e = E0; e < E1; e++) {
      const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(xw[e]), u[e]);
      s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(au[e], xv), ones));
    }
  } else {
    constexpr int CHAIN = 32767 / (2 * 127 * UMAX);  // UMAX 15: 8, 31: 4, 63: 2
    for (int e = E0; e < E1; e += CHAIN) {
      __m256i p = _mm256_maddubs_epi16(u[e], _mm256_set1_epi32(xw[e]));
      for (int k = e + 1; k < E1 && k < e + CHAIN; k++)
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[k], _mm256_set1_epi32(xw[k])));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
  }
#endif
  return s;
}

// y[m0 + r, n0 .. n0 + 7] for NR activation rows against one group of 8 weight rows (its records `recs`).
template <class F, int NR>
void x8_tile(const uint8_t* recs, const QAct& x, int64_t m0, float* y, int64_t ldy, int64_t n0) {
  constexpr int SUBS = F::BLOCK / QK, U = x8_umax<F>(), OFF = x8_offset<F>(), SHIFT = OFF ? x8_offset_shift<F>() : 0;
  constexpr int64_t AHEAD = F::BLOCK == QK ? 8 * F::REC : F::REC;  // prefetch distance, bytes
  const RowTile t(x, m0);
  __m256 acc[NR];
  for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
  const int64_t nrec = x.K / F::BLOCK;
  for (int64_t s = 0; s < nrec; s++) {
    const uint8_t* rec = recs + s * F::REC;
    for (int64_t o = 0; o < F::REC; o += 64) _mm_prefetch((const char*)(rec + AHEAD + o), _MM_HINT_T0);
    const typename F::Head head(rec);
    for (int sub = 0; sub < SUBS; sub++) {
      const int64_t b = (s * SUBS + sub) * t.step;  // row r's block: b + r
      __m256i u[8], au[8];
      F::unpack(rec, sub, u);
#ifndef SPECDEC_VNNI
      if constexpr (U == 0)
        for (int e = 0; e < 8; e++) au[e] = _mm256_sign_epi8(u[e], u[e]);  // |w| as u8 (-128 -> 128)
#endif
      if constexpr (F::KIND == K_HALVES) {  // a scale per 16 weights: two integer sums, scaled exactly
        const __m256i sc_lo = head.scale_lo(rec, sub), sc_hi = head.scale_hi(rec, sub);
        for (int r = 0; r < NR; r++) {
          const int32_t* xw = (const int32_t*)(t.q + (b + r) * QK);
          const __m256i lo = dot_words<U, 0, 4>(u, au, xw, _mm256_slli_epi32(_mm256_set1_epi32(t.nh[2 * (b + r)]), SHIFT));
          const __m256i hi = dot_words<U, 4, 8>(u, au, xw, _mm256_slli_epi32(_mm256_set1_epi32(t.nh[2 * (b + r) + 1]), SHIFT));
          const __m256i sum = _mm256_add_epi32(_mm256_mullo_epi32(lo, sc_lo), _mm256_mullo_epi32(hi, sc_hi));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(head.d, _mm256_set1_ps(t.d[b + r])), acc[r]);
        }
      } else {
        const __m256 sc = head.scale(rec, sub);
        __m256 mn = _mm256_setzero_ps();
        if constexpr (F::KIND == K_MIN) mn = head.minimum(rec, sub);
        for (int r = 0; r < NR; r++) {
          const int32_t* xw = (const int32_t*)(t.q + (b + r) * QK);
          __m256i s0 = _mm256_setzero_si256();
          if constexpr (OFF != 0) s0 = _mm256_slli_epi32(_mm256_set1_epi32(t.ns[b + r]), SHIFT);
          const __m256i sum = dot_words<U, 0, 8>(u, au, xw, s0);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(sc, _mm256_set1_ps(t.d[b + r])), acc[r]);
          if constexpr (F::KIND == K_MIN) acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(t.s[b + r]), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < NR; r++) _mm256_storeu_ps(y + (m0 + r) * ldy + n0, acc[r]);
}

template <class F>
void x8_rows(const torch::Tensor& packed, const QAct& x, float* y, int64_t ldy, int64_t g, int64_t n0) {
  const uint8_t* recs = packed.data_ptr<uint8_t>() + g * packed.size(1);
  int64_t m = 0;
  for (; m + 4 <= x.M; m += 4) x8_tile<F, 4>(recs, x, m, y, ldy, n0);
  switch (x.M - m) {
    case 3: x8_tile<F, 3>(recs, x, m, y, ldy, n0); break;
    case 2: x8_tile<F, 2>(recs, x, m, y, ldy, n0); break;
    case 1: x8_tile<F, 1>(recs, x, m, y, ldy, n0); break;
  }
}

#ifdef SPECDEC_AVX512
// Two consecutive groups of 8 weight rows in one 512-bit vector (low half: group a, high half: group b): every lane
// runs x8_tile's operations on the same values, so a row's bits do not depend on which of the two tiles ran it.
// The 32 registers hold the 8 unpacked weight vectors and up to 8 activation rows' accumulators, so verifying 8
// tokens unpacks each weight sub-block once; the activation words come in as the dot product's broadcast operand.
inline __m512i join(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
inline __m512 join(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }

// Below this many activation rows the 256-bit tiles are faster. At SmolLM2-1.7B's shape on Zen 4 (whole steps,
// thresholds alternated in one process): a decode step 34 ms on them, 40 ms on 512-bit tiles (a step streams the
// weights from memory: one group's records after another is one sequential stream, a pair of groups two); at 4
// rows 256-bit still ahead, from 5 rows 512-bit (5 rows 58 ms against 70, 8 rows 79-82 against 98-118).
constexpr int64_t X16_MIN_ROWS = 5;

template <int E0, int E1>
inline __m512i dot_words16(const __m512i* u, const int32_t* xw, __m512i s0) {
  __m512i s = s0;
  for (int e = E0; e < E1; e++) s = _mm512_dpbusd_epi32(s, u[e], _mm512_set1_epi32(xw[e]));
  return s;
}

template <class F, int NR>
void x16_tile(const uint8_t* ra, const uint8_t* rb, const QAct& x, int64_t m0, float* y, int64_t ldy, int64_t n0) {
  constexpr int SUBS = F::BLOCK / QK, OFF = x8_offset<F>(), SHIFT = OFF ? x8_offset_shift<F>() : 0;
  constexpr int64_t AHEAD = F::BLOCK == QK ? 8 * F::REC : F::REC;
  const RowTile t(x, m0);
  __m512 acc[NR];
  for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
  const int64_t nrec = x.K / F::BLOCK;
  for (int64_t s = 0; s < nrec; s++) {
    const uint8_t *a = ra + s * F::REC, *b = rb + s * F::REC;
    for (int64_t o = 0; o < F::REC; o += 64) {
      _mm_prefetch((const char*)(a + AHEAD + o), _MM_HINT_T0);
      _mm_prefetch((const char*)(b + AHEAD + o), _MM_HINT_T0);
    }
    const typename F::Head ha(a), hb(b);
    for (int sub = 0; sub < SUBS; sub++) {
      const int64_t i = (s * SUBS + sub) * t.step;  // row r's block: i + r
      __m512i u[8];
      {
        __m256i ua[8], ub[8];
        F::unpack(a, sub, ua);
        F::unpack(b, sub, ub);
        for (int e = 0; e < 8; e++) u[e] = join(ua[e], ub[e]);
      }
      if constexpr (F::KIND == K_HALVES) {
        const __m512i sc_lo = join(ha.scale_lo(a, sub), hb.scale_lo(b, sub));
        const __m512i sc_hi = join(ha.scale_hi(a, sub), hb.scale_hi(b, sub));
        const __m512 d = join(ha.d, hb.d);
        for (int r = 0; r < NR; r++) {
          const int32_t* xw = (const int32_t*)(t.q + (i + r) * QK);
          const __m512i lo = dot_words16<0, 4>(u, xw, _mm512_slli_epi32(_mm512_set1_epi32(t.nh[2 * (i + r)]), SHIFT));
          const __m512i hi = dot_words16<4, 8>(u, xw, _mm512_slli_epi32(_mm512_set1_epi32(t.nh[2 * (i + r) + 1]), SHIFT));
          const __m512i sum = _mm512_add_epi32(_mm512_mullo_epi32(lo, sc_lo), _mm512_mullo_epi32(hi, sc_hi));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(t.d[i + r])), acc[r]);
        }
      } else {
        const __m512 sc = join(ha.scale(a, sub), hb.scale(b, sub));
        __m512 mn = _mm512_setzero_ps();
        if constexpr (F::KIND == K_MIN) mn = join(ha.minimum(a, sub), hb.minimum(b, sub));
        for (int r = 0; r < NR; r++) {
          const int32_t* xw = (const int32_t*)(t.q + (i + r) * QK);
          __m512i s0 = _mm512_setzero_si512();
          if constexpr (OFF != 0) s0 = _mm512_slli_epi32(_mm512_set1_epi32(t.ns[i + r]), SHIFT);
          const __m512i sum = dot_words16<0, 8>(u, xw, s0);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sc, _mm512_set1_ps(t.d[i + r])), acc[r]);
          if constexpr (F::KIND == K_MIN) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(t.s[i + r]), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < NR; r++) _mm512_storeu_ps(y + (m0 + r) * ldy + n0, acc[r]);
}

// Groups g and g + 1 (weight rows n0 .. n0 + 15) for every activation row: tiles of 8, then one tile of the rest.
template <class F>
void x16_rows(const torch::Tensor& packed, const QAct& x, float* y, int64_t ldy, int64_t g, int64_t n0) {
  const uint8_t* ra = packed.data_ptr<uint8_t>() + g * packed.size(1);
  const uint8_t* rb = ra + packed.size(1);
  int64_t m = 0;
  for (; m + 8 <= x.M; m += 8) x16_tile<F, 8>(ra, rb, x, m, y, ldy, n0);
  switch (x.M - m) {
    case 7: x16_tile<F, 7>(ra, rb, x, m, y, ldy, n0); break;
    case 6: x16_tile<F, 6>(ra, rb, x, m, y, ldy, n0); break;
    case 5: x16_tile<F, 5>(ra, rb, x, m, y, ldy, n0); break;
    case 4: x16_tile<F, 4>(ra, rb, x, m, y, ldy, n0); break;
    case 3: x16_tile<F, 3>(ra, rb, x, m, y, ldy, n0); break;
    case 2: x16_tile<F, 2>(ra, rb, x, m, y, ldy, n0); break;
    case 1: x16_tile<F, 1>(ra, rb, x, m, y, ldy, n0); break;
  }
}
#endif
#endif

// ---------------------------------------------------------------------------------------------------------
// Float weights: y[m, n] = 8 lane sums of w[n, k] x[m, k] over k in steps of 8, one fixed horizontal sum, then
// the K % 8 tail in order; NW weight rows x NR activation rows per tile share their loads, and no tile changes
// an element's sequence. Float32 activations: nothing is rounded but the sums.
// ---------------------------------------------------------------------------------------------------------

template <class W, int NW, int NR>
void float_tile(const typename W::T* w, int64_t K, const float* x, int64_t ldx, int64_t m0, float* y, int64_t ldy,
                int64_t n0) {
  int64_t k = 0;
  float s[NW][NR] = {};
#ifdef SPECDEC_AVX2
  __m256 acc[NW][NR];
  for (int i = 0; i < NW; i++)
    for (int r = 0; r < NR; r++) acc[i][r] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NW];
    for (int i = 0; i < NW; i++) wv[i] = W::load8(w + i * K + k);
    for (int r = 0; r < NR; r++) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + r) * ldx + k);
      for (int i = 0; i < NW; i++) acc[i][r] = _mm256_fmadd_ps(wv[i], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < NW; i++)
    for (int r = 0; r < NR; r++) s[i][r] = hsum(acc[i][r]);
#endif
  for (int i = 0; i < NW; i++)
    for (int r = 0; r < NR; r++) {
      for (int64_t kk = k; kk < K; kk++) s[i][r] += W::at(w + i * K, kk) * x[(m0 + r) * ldx + kk];
      y[(m0 + r) * ldy + n0 + i] = s[i][r];
    }
}

template <class W, int NW>
void float_rows(const typename W::T* w, int64_t K, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
                int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) float_tile<W, NW, 2>(w, K, x, ldx, m, y, ldy, n);
  if (m < M) float_tile<W, NW, 1>(w, K, x, ldx, m, y, ldy, n);
}

template <class W>
void float_part(const torch::Tensor& data, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy, int64_t n0,
                int64_t n1, int64_t off) {
  using T = typename W::T;
  const T* base = (const T*)data.data_ptr();
  const int64_t K = data.size(1);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) float_rows<W, 4>(base + (n - off) * K, K, x, M, ldx, y, ldy, n);
  for (; n < n1; n++) float_rows<W, 1>(base + (n - off) * K, K, x, M, ldx, y, ldy, n);
}

// A weight matrix: consecutive row ranges ("parts"), each in one format (q, k and v, or gate and up, fused into
// one matrix, may come in different formats from a GGUF): block-quantized, or float (F32, F16, BF16).
struct QMatrix {
  std::vector<torch::Tensor> data;  // per part: uint8 [rows, row_bytes], the file's blocks; or float [rows, K]
  std::vector<int64_t> formats, first;  // format id and first output row per part; first has parts + 1
  std::vector<torch::Tensor> x8;  // per part: its first rows / 8 * 8 rows interleaved (X8), or undefined
  int64_t K = 0;
  bool quantized = false;  // some part is block-quantized: the activations are quantized for it
  int64_t N() const { return first.back(); }
};

template <class F, int NW>
void gemm_rows(const uint8_t* w, int64_t row_bytes, const QAct& x, float* y, int64_t ldy, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= x.M; m += 4) dot_tile<F, NW, 4>(w, row_bytes, x, m, y, ldy, n);
  switch (x.M - m) {
    case 3: dot_tile<F, NW, 3>(w, row_bytes, x, m, y, ldy, n); break;
    case 2: dot_tile<F, NW, 2>(w, row_bytes, x, m, y, ldy, n); break;
    case 1: dot_tile<F, NW, 1>(w, row_bytes, x, m, y, ldy, n); break;
  }
}

template <class F>
void gemm_part(const torch::Tensor& data, const QAct& x, float* y, int64_t ldy, int64_t n0, int64_t n1,
               int64_t off) {
  const uint8_t* base = data.data_ptr<uint8_t>();
  const int64_t row_bytes = data.size(1);
  int64_t n = n0;
  if (x.M <= 2)  // decode: four weight rows at a time for independent FMA chains
    for (; n + 4 <= n1; n += 4) gemm_rows<F, 4>(base + (n - off) * row_bytes, row_bytes, x, y, ldy, n);
  for (; n + 2 <= n1; n += 2) gemm_rows<F, 2>(base + (n - off) * row_bytes, row_bytes, x, y, ldy, n);
  for (; n < n1; n++) gemm_rows<F, 1>(base + (n - off) * row_bytes, row_bytes, x, y, ldy, n);
}

// y [M, ldy] (columns 0..N) = x @ W.T for x [M, ldx] float32; qx holds x quantized (done here when W needs it).
void matmul(const QMatrix& W, const float* xf, int64_t M, int64_t ldx, QAct& x, float* y, int64_t ldy) {
  if (W.quantized) quantize_rows(xf, M, W.K, ldx, x);
  const int64_t N = W.N();
  int64_t grain = std::max<int64_t>(8, std::min<int64_t>(64, N / (8 * at::get_num_threads()) + 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (size_t p = 0; p + 1 < W.first.size(); p++) {
      int64_t a = std::max(n0, W.first[p]), b = std::min(n1, W.first[p + 1]);
      if (a >= b) continue;
#ifdef SPECDEC_AVX2
      if (W.x8[p].defined()) {  // groups of 8 rows, each done by the chunk holding its first row
        const int64_t off = W.first[p], packed = W.x8[p].size(0) * 8;
        with_format(W.formats[p], [&](auto f) {
          int64_t g = (a - off + 7) / 8;
#ifdef SPECDEC_AVX512
          // groups in pairs (2i, 2i + 1), each done by the chunk holding its first row; only an odd count's last
          // group goes alone. Both tiles give the same bits, so the choice may depend on the row count.
          if (x.M >= X16_MIN_ROWS) {
            g += g % 2;
            for (; g * 8 < std::min(b - off, packed - 8); g += 2) x16_rows<decltype(f)>(W.x8[p], x, y, ldy, g, off + 8 * g);
          }
#endif
          for (; g * 8 < std::min(b - off, packed); g++) x8_rows<decltype(f)>(W.x8[p], x, y, ldy, g, off + 8 * g);
          return 0;
        });
        a = std::max(a, off + packed);
        if (a >= b) continue;
      }
#endif
      if (is_float_format(W.formats[p])) {
        with_float(W.formats[p], [&](auto f) {
          float_part<decltype(f)>(W.data[p], xf, M, ldx, y, ldy, a, b, W.first[p]);
          return 0;
        });
        continue;
      }
      with_format(W.formats[p], [&](auto f) {
        gemm_part<decltype(f)>(W.data[p], x, y, ldy, a, b, W.first[p]);
        return 0;
      });
    }
  });
}

QMatrix make_matrix(std::vector<torch::Tensor> data, std::vector<int64_t> formats, int64_t K, bool interleave) {
  TORCH_CHECK(data.size() == formats.size() && !data.empty(), "one format per part");
  QMatrix W;
  W.K = K;
  W.first.push_back(0);
  for (size_t p = 0; p < data.size(); p++) {
    TORCH_CHECK(data[p].dim() == 2 && data[p].is_contiguous(), "part ", p, " must be a contiguous matrix");
    if (is_float_format(formats[p])) {
      const auto want = formats[p] == F_F32 ? torch::kFloat32 : formats[p] == F_F16 ? torch::kHalf : torch::kBFloat16;
      TORCH_CHECK(formats[p] <= F_BF16 && data[p].scalar_type() == want && data[p].size(1) == K, "float part ", p,
                  " must be ", c10::toString(want), " [rows, ", K, "], got ", data[p].scalar_type(), " ", data[p].sizes());
      W.data.push_back(data[p]);
      W.formats.push_back(formats[p]);
      W.x8.emplace_back();
      W.first.push_back(W.first.back() + data[p].size(0));
      continue;
    }
    W.quantized = true;
    TORCH_CHECK(data[p].dtype() == torch::kUInt8, "quantized data must be contiguous uint8 [rows, row_bytes]");
    int64_t bytes = with_format(formats[p], [&](auto f) {
      using F = decltype(f);
      TORCH_CHECK(K % F::BLOCK == 0, "row length ", K, " is not a multiple of the block size ", F::BLOCK);
      return K / F::BLOCK * F::BYTES;
    });
    TORCH_CHECK(data[p].size(1) == bytes, "part ", p, " has ", data[p].size(1), " bytes per row, expected ", bytes);
    W.data.push_back(data[p]);
    W.formats.push_back(formats[p]);
    torch::Tensor x8;
#ifdef SPECDEC_AVX2
    if (data[p].size(0) >= 8 && interleave)
      x8 = with_format(formats[p], [&](auto f) { return x8_pack<decltype(f)>(data[p], K); });
#endif
    W.x8.push_back(x8);
    W.first.push_back(W.first.back() + data[p].size(0));
  }
  return W;
}

// ---------------------------------------------------------------------------------------------------------
// Python-facing operations.
// ---------------------------------------------------------------------------------------------------------

torch::Tensor linear(const torch::Tensor& x, const QMatrix& W) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == W.K, "x must be float32 [M, ", W.K, "]");
  auto xc = x.contiguous();
  QAct qx;
  auto y = torch::empty({xc.size(0), W.N()}, x.options());
  matmul(W, xc.data_ptr<float>(), xc.size(0), W.K, qx, y.data_ptr<float>(), W.N());
  return y;
}

// Rows `rows` of W as float32 (the token embedding of a quantized model).
torch::Tensor dequantize_rows(const QMatrix& W, const torch::Tensor& rows) {
  auto idx = rows.to(torch::kInt64).contiguous();
  auto out = torch::empty({idx.size(0), W.K}, torch::kFloat32);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < idx.size(0); t++) {
    int64_t n = ip[t];
    TORCH_CHECK(n >= 0 && n < W.N(), "row ", n, " out of range [0, ", W.N(), ")");
    size_t p = 0;
    while (W.first[p + 1] <= n) p++;
    float* o = out.data_ptr<float>() + t * W.K;
    if (is_float_format(W.formats[p])) {
      with_float(W.formats[p], [&](auto f) {
        using F = decltype(f);
        const auto* w = (const typename F::T*)W.data[p].data_ptr() + (n - W.first[p]) * W.K;
        for (int64_t k = 0; k < W.K; k++) o[k] = F::at(w, k);
        return 0;
      });
      continue;
    }
    const uint8_t* w = W.data[p].data_ptr<uint8_t>() + (n - W.first[p]) * W.data[p].size(1);
    with_format(W.formats[p], [&](auto f) {
      using F = decltype(f);
      uint8_t q[32];
      for (int64_t j = 0; j < W.K / QK; j++) {
        const uint8_t* blk = w + (j * QK / F::BLOCK) * F::BYTES;
        int sub = (int)(j % (F::BLOCK / QK));
        float sc[2], mn;
        F::scales(blk, sub, sc, mn);
        F::quants(blk, sub, q);
        for (int i = 0; i < 32; i++) {
          float v = F::SIGNED ? (float)(int8_t)q[i] : (float)q[i];
          o[j * QK + i] = sc[i / 16] * v + mn;
        }
      }
      return 0;
    });
  }
  return out;
}

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

struct Layer {
  torch::Tensor ln1, qkv_b, q_norm, k_norm, ln2;  // float32 (absent ones empty: ln1 for a layer without input norm)
  QMatrix qkv, o, gate_up, down;
  int64_t n_heads, n_kv, head_dim;
  double eps;
};

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

void rope_and_qk_norm(float* qkv, int64_t T, const Layer& L, const float* cos, const float* ssin) {
  const int64_t D = L.head_dim, heads = L.n_heads + 2 * L.n_kv, half = D / 2;
  std::vector<float> tmp(D);
  for (int64_t t = 0; t < T; t++) {
    for (int64_t h = 0; h < L.n_heads + L.n_kv; h++) {  // q and k heads; v is left alone
      float* x = qkv + (t * heads + h) * D;
      if (L.q_norm.numel() > 0) {
        const float* w = (h < L.n_heads ? L.q_norm : L.k_norm).data_ptr<float>();
        rms_norm_rows(x, w, (float)L.eps, 1, D, x);
      }
      std::memcpy(tmp.data(), x, D * sizeof(float));
      const float *c = cos + t * D, *sn = ssin + t * D;  // rotate_half: the partner of d is d + half (mod D)
      for (int64_t d = 0; d < half; d++) x[d] = tmp[d] * c[d] + tmp[d + half] * sn[d];
      for (int64_t d = half; d < D; d++) x[d] = tmp[d] * c[d] + tmp[d - half] * sn[d];
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

// Where the step's tokens go and what each query sees (one per forward: every layer shares it).
struct StepLayout {
  const int64_t* slot_mapping;
  const int64_t* context_slots;
  int64_t Lk;
  Visible vis;
};

StepLayout step_layout(const torch::Tensor& slot_mapping, const torch::Tensor& context_slots, const torch::Tensor& mask,
                       const torch::Tensor& query_starts) {
  TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && context_slots.dtype() == torch::kInt64 &&
              query_starts.dtype() == torch::kInt64 && mask.dtype() == torch::kBool && slot_mapping.is_contiguous() &&
              context_slots.is_contiguous() && mask.is_contiguous() && query_starts.is_contiguous(),
              "attention metadata must be contiguous int64 slots / query starts and a bool mask");
  const int64_t B = query_starts.size(0) - 1, Lk = context_slots.size(1);
  return {slot_mapping.data_ptr<int64_t>(), context_slots.data_ptr<int64_t>(), Lk,
          visible_lists(context_slots.data_ptr<int64_t>(), Lk, mask.data_ptr<bool>(), mask.size(1),
                        query_starts.data_ptr<int64_t>(), B)};
}

void decoder_layer(const Layer& L, float* xp, int64_t T, int64_t H, const float* cos, const float* ssin,
                   torch::Tensor& k_pool, torch::Tensor& v_pool, const StepLayout& step, double scale) {
  const int64_t D = L.head_dim, Hq = L.n_heads, Hkv = L.n_kv;
  const int64_t W = (Hq + 2 * Hkv) * D, inter = L.gate_up.N() / 2;
  // per calling thread, grown as needed and never cleared (every element is written before it is read): no
  // allocation or zero fill per layer
  static thread_local std::vector<float> h_buf, qkv_buf, attn_buf, out_buf;
  static thread_local QAct qx;
  float* h = grow(h_buf, T * std::max(H, inter));
  float* qkv = grow(qkv_buf, T * W);
  float* attn = grow(attn_buf, T * Hq * D);
  float* out = grow(out_buf, T * std::max(H, 2 * inter));

  if (L.ln1.numel() > 0) rms_norm_rows(xp, L.ln1.data_ptr<float>(), (float)L.eps, T, H, h);
  else std::memcpy(h, xp, T * H * sizeof(float));  // no input norm (an EAGLE head's first layer)
  matmul(L.qkv, h, T, H, qx, qkv, W);
  if (L.qkv_b.numel() > 0) {
    const float* bias = L.qkv_b.data_ptr<float>();
    for (int64_t t = 0; t < T; t++)
      for (int64_t i = 0; i < W; i++) qkv[t * W + i] += bias[i];
  }
  rope_and_qk_norm(qkv, T, L, cos, ssin);
  with_kv(k_pool, v_pool, [&](auto* kp, auto* vp) {
    for (int64_t t = 0; t < T; t++) {  // the new keys and values go in first: queries see themselves
      narrow(qkv + t * W + Hq * D, kp + step.slot_mapping[t] * Hkv * D, Hkv * D);
      narrow(qkv + t * W + (Hq + Hkv) * D, vp + step.slot_mapping[t] * Hkv * D, Hkv * D);
    }
    attention(qkv, W, Hq, Hkv, D, kp, vp, step.context_slots, step.Lk, step.vis, (float)scale, attn);
    return 0;
  });

  matmul(L.o, attn, T, Hq * D, qx, out, H);
  for (int64_t i = 0; i < T * H; i++) xp[i] += out[i];

  rms_norm_rows(xp, L.ln2.data_ptr<float>(), (float)L.eps, T, H, h);
  matmul(L.gate_up, h, T, H, qx, out, 2 * inter);
  for (int64_t t = 0; t < T; t++) silu_mul(out + t * 2 * inter, inter, h + t * inter);
  matmul(L.down, h, T, inter, qx, out, H);
  for (int64_t i = 0; i < T * H; i++) xp[i] += out[i];
}

void check_rows(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& ssin, int64_t D) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be contiguous float32 [T, H]");
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && ssin.dtype() == torch::kFloat32 && cos.is_contiguous() &&
              ssin.is_contiguous() && cos.size(0) == x.size(0) && cos.size(1) == D && ssin.sizes() == cos.sizes(),
              "rotary tables must be contiguous float32 [T, head_dim]");
}

// The attention alone (queries q [T, Hq, D] over pools already holding every visible key): what the layers run
// between their QKV and O projections, for the tests.
torch::Tensor attention_op(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                           const torch::Tensor& context_slots, const torch::Tensor& mask,
                           const torch::Tensor& query_starts, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 3 && q.is_contiguous(), "q must be contiguous float32 [T, Hq, D]");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == q.size(2) &&
              q.size(1) % k_pool.size(1) == 0, "pools must be [slots, Hkv, D] with Hq a multiple of Hkv");
  StepLayout step = step_layout(context_slots.new_empty({0}), context_slots, mask, query_starts);
  TORCH_CHECK(step.vis.T == q.size(0), "query_starts covers ", step.vis.T, " queries, q has ", q.size(0));
  auto out = torch::empty_like(q);
  const int64_t Hq = q.size(1), D = q.size(2);
  with_kv(k_pool, v_pool, [&](auto* kp, auto* vp) {
    attention(q.data_ptr<float>(), Hq * D, Hq, k_pool.size(1), D, kp, vp, step.context_slots, step.Lk, step.vis,
              (float)scale, out.data_ptr<float>());
    return 0;
  });
  return out;
}

// One layer in place on x [T, H] (a draft head's layer).
void layer_forward(const Layer& L, torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& ssin,
                   torch::Tensor k_pool, torch::Tensor v_pool, const torch::Tensor& slot_mapping,
                   const torch::Tensor& context_slots, const torch::Tensor& mask, const torch::Tensor& query_starts,
                   double scale) {
  check_rows(x, cos, ssin, L.head_dim);
  StepLayout step = step_layout(slot_mapping, context_slots, mask, query_starts);
  decoder_layer(L, x.data_ptr<float>(), x.size(0), x.size(1), cos.data_ptr<float>(), ssin.data_ptr<float>(), k_pool,
                v_pool, step, scale);
}

// The first num_layers layers in order, in place on x; returns the final norm of the result, then x after each layer
// listed in `capture`.
struct Stack {
  std::vector<Layer> layers;
  torch::Tensor norm;  // the final RMSNorm's weight [H]
  double eps;
  std::vector<torch::Tensor> forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& ssin,
                                     const std::vector<torch::Tensor>& k_pools, const std::vector<torch::Tensor>& v_pools,
                                     const torch::Tensor& slot_mapping, const torch::Tensor& context_slots,
                                     const torch::Tensor& mask, const torch::Tensor& query_starts, double scale,
                                     int64_t num_layers, const std::vector<int64_t>& capture) const {
    TORCH_CHECK(num_layers <= (int64_t)layers.size() && (int64_t)k_pools.size() >= num_layers &&
                (int64_t)v_pools.size() >= num_layers, "too few layers or pools");
    check_rows(x, cos, ssin, layers.empty() ? 0 : layers[0].head_dim);
    StepLayout step = step_layout(slot_mapping, context_slots, mask, query_starts);
    const int64_t T = x.size(0), H = x.size(1);
    std::vector<torch::Tensor> out(1);
    for (int64_t i = 0; i < num_layers; i++) {
      decoder_layer(layers[i], x.data_ptr<float>(), T, H, cos.data_ptr<float>(), ssin.data_ptr<float>(),
                    const_cast<torch::Tensor&>(k_pools[i]), const_cast<torch::Tensor&>(v_pools[i]), step, scale);
      if (std::find(capture.begin(), capture.end(), i) != capture.end()) out.push_back(x.clone());
    }
    out[0] = torch::empty_like(x);
    rms_norm_rows(x.data_ptr<float>(), norm.data_ptr<float>(), (float)eps, T, H, out[0].data_ptr<float>());
    return out;
  }
};

// The index of each row's largest value, the first one on ties (torch.argmax's rule). logits: float32 [N, V].
torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() == 2, "logits must be float32 [N, V]");
  auto x = logits.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "argmax of an empty row");
  auto out = torch::empty({N}, torch::kInt64);
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
                       torch::Tensor k_norm, QMatrix o, torch::Tensor ln2, QMatrix gate_up, QMatrix down,
                       int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps) {
        return Layer{ln1, qkv_b, q_norm, k_norm, ln2, qkv, o, gate_up, down, n_heads, n_kv, head_dim, eps};
      }))
      .def("forward", &layer_forward);
  py::class_<Stack>(m, "Stack")
      .def(py::init([](std::vector<Layer> layers, torch::Tensor norm, double eps) {
        TORCH_CHECK(norm.dtype() == torch::kFloat32 && norm.is_contiguous(), "norm weight must be contiguous float32");
        return Stack{std::move(layers), norm, eps};
      }))
      .def("forward", &Stack::forward);
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
  m.def("attention", &attention_op, "attention of q [T, Hq, D] over the K/V pools (the layers' own kernel)");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum, float32 [N, V] -> int64 [N]");
  m.def("logprob_rows", &logprob_rows, "log-softmax of each row's token and its k largest values with indices");
  m.def("mask_rows", &mask_rows, "logits float32 [N, V] of tokens a bitmask int32 [N, V / 32] forbids -> -inf");
  m.def("isa", &isa);
}
