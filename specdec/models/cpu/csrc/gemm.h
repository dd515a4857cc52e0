// Matrix products against a weight matrix, the only place weights are multiplied: the integer dot-product tiles over
// a format's own blocks (dot_tile) and over its interleaved 8-row records (x8 tiles, and x16 tiles with 512-bit
// registers), the float tiles for F32 / F16 / BF16 weights, QMatrix (a matrix of row ranges in possibly different
// formats), matmul over it, and the Python-facing linear and dequantize_rows. Every tile runs each output element's
// operations in the same order, so no tiling, batch or thread split changes a bit.
#pragma once
#include "formats.h"
#include "memory.h"
#include "activations.h"

namespace {

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
  torch::Tensor out = huge_empty({groups, nrec * F::REC}, torch::kUInt8);  // streamed every step: 2 MB pages
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
  if constexpr (E1 - E0 >= 4) {  // two chains: a product's 4-cycle latency no longer serialises a tile of few rows
    __m256i s1 = _mm256_setzero_si256();
    for (int e = E0; e + 1 < E1; e += 2) {
      s = SPECDEC_DPBUSD(s, u[e], _mm256_set1_epi32(xw[e]));
      s1 = SPECDEC_DPBUSD(s1, u[e + 1], _mm256_set1_epi32(xw[e + 1]));
    }
    if constexpr ((E1 - E0) % 2) s = SPECDEC_DPBUSD(s, u[E1 - 1], _mm256_set1_epi32(xw[E1 - 1]));
    return _mm256_add_epi32(s, s1);  // int32: exact, so the same bits as one chain
  }
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
    // The hint is the CPU's (SPECDEC_STREAM_HINT, simd.h): non-temporal on AMD, where the weights stream once a
    // step and kept out of the shared L3 leave it to what the step reads again (Zen 4 against T0, head's chain of 1
    // alternated in two pairs of runs: plain steps 4.01-4.02 -> 3.61-3.74 ms); T0 elsewhere: on an Intel Xeon the
    // stream stalls under NTA ([8192 x 2048] Q4_1, 1 row: 0.73 ms under NTA, 0.21 under T0).
    for (int64_t o = 0; o < F::REC; o += 64) _mm_prefetch((const char*)(rec + AHEAD + o), SPECDEC_STREAM_HINT);
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

// Every activation row against one group: tiles of as many rows as the registers hold (8 with AVX-512's 32, else
// 4), so a verification step of up to 8 rows unpacks each weight sub-block once.
template <class F>
void x8_rows(const torch::Tensor& packed, const QAct& x, float* y, int64_t ldy, int64_t g, int64_t n0) {
  const uint8_t* recs = packed.data_ptr<uint8_t>() + g * packed.size(1);
  int64_t m = 0;
#ifdef SPECDEC_AVX512
  for (; m + 8 <= x.M; m += 8) x8_tile<F, 8>(recs, x, m, y, ldy, n0);
  switch (x.M - m) {
    case 7: x8_tile<F, 7>(recs, x, m, y, ldy, n0); return;
    case 6: x8_tile<F, 6>(recs, x, m, y, ldy, n0); return;
    case 5: x8_tile<F, 5>(recs, x, m, y, ldy, n0); return;
  }
#endif
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

// Below this many activation rows the 256-bit tiles (x8_rows: 8 rows at once with AVX-512's 32 registers, one
// sequential stream of records where a pair of groups is two) are as fast; from it the 512-bit ones, half the
// broadcasts per product, are ahead. Whole verification steps at context 300 on the default Q4_1 file (Zen 4, the
// threshold alternated in one process, 6 rounds, medians): 8 rows 11.1 ms on 256-bit tiles against 8.9-9.5 on
// 512-bit ones, 10 rows 13.7 against 10.6-12.3, 12 rows 15.6 against 13.4-14.0; 3 to 6 rows within the rounds'
// spread (+-5%) either way. (An earlier build put 5 rows at 7.0 ms on 256-bit tiles against 8.9.)
constexpr int64_t X16_MIN_ROWS = 8;

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
  int64_t N() const { return first.empty() ? 0 : first.back(); }  // an empty matrix (a mixture's dense MLP): 0
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

// y [M, ldy] columns n0..n1 = x @ W.T for x [M, ldx] float32, x quantized in qx where W needs it. Any split of the
// columns gives the same bits: an interleaved group is done by the range holding its first row.
void matmul_columns(const QMatrix& W, const float* xf, int64_t M, int64_t ldx, const QAct& x, float* y, int64_t ldy,
                    int64_t n0, int64_t n1) {
  for (size_t p = 0; p + 1 < W.first.size(); p++) {
    int64_t a = std::max(n0, W.first[p]), b = std::min(n1, W.first[p + 1]);
    if (a >= b) continue;
#ifdef SPECDEC_AVX2
    if (W.x8[p].defined()) {  // groups of 8 rows, each done by the range holding its first row
      const int64_t off = W.first[p], packed = W.x8[p].size(0) * 8;
      with_format(W.formats[p], [&](auto f) {
        int64_t g = (a - off + 7) / 8;
#ifdef SPECDEC_AVX512
        // groups in pairs (2i, 2i + 1), each done by the range holding its first row; only an odd count's last
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
}

// y [M, ldy] (columns 0..N) = x @ W.T for x [M, ldx] float32; qx holds x quantized (done here when W needs it).
void matmul(const QMatrix& W, const float* xf, int64_t M, int64_t ldx, QAct& x, float* y, int64_t ldy) {
  if (W.quantized) quantize_rows(xf, M, W.K, ldx, x);
  const int64_t N = W.N();
  int64_t grain = std::max<int64_t>(8, std::min<int64_t>(64, N / (8 * at::get_num_threads()) + 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { matmul_columns(W, xf, M, ldx, x, y, ldy, n0, n1); });
}

// This team member's share [n0, n1) of N columns: whole pairs of interleaved groups (16 rows), split evenly.
inline std::pair<int64_t, int64_t> team_share(int64_t N) {
  const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num(), units = (N + 15) / 16;
  return {std::min(N, units * tid / nt * 16), std::min(N, units * (tid + 1) / nt * 16)};
}

// matmul for every thread of an OpenMP team at once (called by each, inside the parallel region): each quantizes x
// into its own qx (the same values), computes its share of the columns, and waits for the others (a barrier).
void matmul_team(const QMatrix& W, const float* xf, int64_t M, int64_t ldx, QAct& x, float* y, int64_t ldy) {
  if (W.quantized) quantize_rows(xf, M, W.K, ldx, x);  // serial inside the region
  const auto [n0, n1] = team_share(W.N());
  if (n0 < n1) matmul_columns(W, xf, M, ldx, x, y, ldy, n0, n1);
#pragma omp barrier
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

// Rows `rows` of W as float32 (the token embedding of a quantized model): rows int [...] -> [..., K].
torch::Tensor dequantize_rows(const QMatrix& W, const torch::Tensor& rows) {
  auto idx = rows.to(torch::kInt64).contiguous();
  std::vector<int64_t> shape(idx.sizes().begin(), idx.sizes().end());
  shape.push_back(W.K);
  auto out = torch::empty(shape, torch::kFloat32);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < idx.numel(); t++) {
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

}  // namespace
