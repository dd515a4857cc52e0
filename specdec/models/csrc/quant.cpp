// Native CPU runtime for GGUF block-quantized weights: integer dot products on the file's own blocks.
//
// Activations are quantized per row into blocks of 32 int8 values with one float scale (llama.cpp's Q8_1
// idea: d = max|x| / 127, q = round(x / d), and s = d * sum(q) for the formats with a per-block minimum).
// A weight block times an activation block is an exact integer sum, scaled once. Every output element
// y[m, n] is computed by the same instruction sequence whatever else is in the call (other rows, draft
// tokens, a different thread split), so a row has the same bits alone or in a batch: greedy speculative
// output equals plain greedy output by construction.
//
// The only code that knows a block format is its `Format` struct below (layout, scales, unpacking); the
// GEMM, the fused decoder layer and the dequantizer are written once over it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECDEC_AVX2 1
// u8 x s8 dot products of 4 bytes into int32 lanes in one instruction (AVX512-VNNI with VL, or AVX-VNNI):
// the same integers as maddubs + madd, so the results are bit for bit those of the AVX2 path.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECDEC_VNNI 1
#define SPECDEC_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define SPECDEC_VNNI 1
#define SPECDEC_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#endif

namespace {

constexpr int QK = 32;  // activation block (and the unit every weight format is unpacked in)

float half_to_float(uint16_t h) {
#ifdef SPECDEC_AVX2
  return _cvtsh_ss(h);
#else
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; exp--; }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

uint16_t float_to_half(float f) {
#ifdef SPECDEC_AVX2
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);  // normal values only (the Q4_0 minimums this packs are -8 d of an f16 d)
  uint32_t sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xff, mant = x & 0x7fffffu;
  if (exp == 0) return (uint16_t)sign;
  return (uint16_t)(sign | ((exp - 127 + 15) << 10) | (mant >> 13));
#endif
}

uint16_t read_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// ---------------------------------------------------------------------------------------------------------
// Block formats. Each gives, for sub-block `sub` (32 weights) of a block starting at `b`:
//   quants(b, sub, q)      the 32 integers, as int8 (SIGNED) or as uint8 0..63 (not SIGNED);
//   scales(b, sub, sc, mn) w[i] = sc[i / 16] * q[i] + mn (two scales: Q6_K scales 16 weights at a time).
// BLOCK elements take BYTES bytes; BLOCK / 32 sub-blocks per block.
// ---------------------------------------------------------------------------------------------------------

struct Q8_0 {  // {f16 d; int8 q[32]}: w = d * q
  static constexpr int BLOCK = 32, BYTES = 34;
  static constexpr bool SIGNED = true;
  static void scales(const uint8_t* b, int, float sc[2], float& mn) {
    sc[0] = sc[1] = half_to_float(read_u16(b));
    mn = 0.f;
  }
  static void quants(const uint8_t* b, int, uint8_t q[32]) { std::memcpy(q, b + 2, 32); }
#ifdef SPECDEC_AVX2
  static __m256i quants(const uint8_t* b, int) { return _mm256_loadu_si256((const __m256i*)(b + 2)); }
#endif
};

// {f16 d; u8 qs[16]} or {f16 d; f16 m; u8 qs[16]}: nibble j of byte i is weight i + 16 j.
template <bool HAS_MIN>
struct Q4Legacy {
  static constexpr int BLOCK = 32, BYTES = HAS_MIN ? 20 : 18, OFF = HAS_MIN ? 4 : 2;
  static constexpr bool SIGNED = false;
  static void scales(const uint8_t* b, int, float sc[2], float& mn) {
    float d = half_to_float(read_u16(b));
    sc[0] = sc[1] = d;
    mn = HAS_MIN ? half_to_float(read_u16(b + 2)) : -8.f * d;  // Q4_0: w = d * (q - 8)
  }
  static void quants(const uint8_t* b, int, uint8_t q[32]) {
    for (int i = 0; i < 16; i++) { q[i] = b[OFF + i] & 15; q[i + 16] = b[OFF + i] >> 4; }
  }
#ifdef SPECDEC_AVX2
  static __m256i quants(const uint8_t* b, int) {
    __m128i raw = _mm_loadu_si128((const __m128i*)(b + OFF)), low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
  }
#endif
};
using Q4_0 = Q4Legacy<false>;
using Q4_1 = Q4Legacy<true>;

// {f16 d; f16 dmin; u8 scales[12] (8 x 6-bit scale, 8 x 6-bit min); u8 qs[128]} over 256 weights:
// sub-block s (32 weights) is nibble s % 2 of bytes 32 (s / 2) .. 32 (s / 2) + 31; w = d sc_s q - dmin m_s.
struct Q4_K {
  static constexpr int BLOCK = 256, BYTES = 144;
  static constexpr bool SIGNED = false;
  static void scale_min(const uint8_t* s, int j, int& sc, int& m) {
    if (j < 4) {
      sc = s[j] & 63; m = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4); m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
  }
  static void scales(const uint8_t* b, int sub, float sc[2], float& mn) {
    int s, m;
    scale_min(b + 4, sub, s, m);
    sc[0] = sc[1] = half_to_float(read_u16(b)) * (float)s;
    mn = -half_to_float(read_u16(b + 2)) * (float)m;
  }
  static void quants(const uint8_t* b, int sub, uint8_t q[32]) {
    const uint8_t* qs = b + 16 + 32 * (sub / 2);
    for (int i = 0; i < 32; i++) q[i] = (sub & 1) ? qs[i] >> 4 : qs[i] & 15;
  }
#ifdef SPECDEC_AVX2
  static __m256i quants(const uint8_t* b, int sub) {
    __m256i raw = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * (sub / 2)));
    if (sub & 1) raw = _mm256_srli_epi16(raw, 4);
    return _mm256_and_si256(raw, _mm256_set1_epi8(15));
  }
#endif
};

// {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d} over 256 weights, 6-bit q - 32 with a scale per 16.
// Half h (128 weights) uses ql[64 h ..], qh[32 h ..]; its sub-block k takes low nibbles (k < 2) or high
// nibbles of ql[64 h + 32 (k % 2) + i] and bits 2k, 2k + 1 of qh[32 h + i]; scales 8 h + 2 k (+1).
struct Q6_K {
  static constexpr int BLOCK = 256, BYTES = 210;
  static constexpr bool SIGNED = true;
  static void scales(const uint8_t* b, int sub, float sc[2], float& mn) {
    float d = half_to_float(read_u16(b + 208));
    const int8_t* s = (const int8_t*)(b + 192) + 8 * (sub / 4) + 2 * (sub % 4);
    sc[0] = d * (float)s[0];
    sc[1] = d * (float)s[1];
    mn = 0.f;
  }
  static void quants(const uint8_t* b, int sub, uint8_t q[32]) {
    int h = sub / 4, k = sub % 4;
    const uint8_t* ql = b + 64 * h + 32 * (k % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    for (int i = 0; i < 32; i++) {
      int low = k < 2 ? ql[i] & 15 : ql[i] >> 4;
      q[i] = (uint8_t)(int8_t)((low | (((qh[i] >> (2 * k)) & 3) << 4)) - 32);
    }
  }
#ifdef SPECDEC_AVX2
  static __m256i quants(const uint8_t* b, int sub) {
    int h = sub / 4, k = sub % 4;
    __m256i ql = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32 * (k % 2)));
    __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
    if (k >= 2) ql = _mm256_srli_epi16(ql, 4);
    __m256i low = _mm256_and_si256(ql, _mm256_set1_epi8(15));
    __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
    __m256i q = _mm256_or_si256(low, _mm256_slli_epi16(high, 4));  // 0..63, no bit crosses a byte
    return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
  }
#endif
};

enum FormatId { F_Q8_0 = 0, F_Q4_0 = 1, F_Q4_1 = 2, F_Q4_K = 3, F_Q6_K = 4 };

template <class Fn>
auto with_format(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case F_Q8_0: return fn(Q8_0{});
    case F_Q4_0: return fn(Q4_0{});
    case F_Q4_1: return fn(Q4_1{});
    case F_Q4_K: return fn(Q4_K{});
    case F_Q6_K: return fn(Q6_K{});
  }
  TORCH_CHECK(false, "unknown block format id ", fmt);
}

// ---------------------------------------------------------------------------------------------------------
// Activations: rows of K floats -> int8 blocks of 32 with scale d and s = d * sum(q).
// ---------------------------------------------------------------------------------------------------------

struct QAct {
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d, s;  // [M, K / 32]
  int64_t M = 0, K = 0;
  const int8_t* row(int64_t m) const { return q.data() + m * K; }
  const float* dr(int64_t m) const { return d.data() + m * (K / QK); }
  const float* sr(int64_t m) const { return s.data() + m * (K / QK); }
};

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, QAct& out) {
  out.M = M; out.K = K;
  out.q.resize(M * K); out.d.resize(M * K / QK); out.s.resize(M * K / QK);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < K / QK; b++) {
      const float* xb = x + m * ldx + b * QK;
      float amax = 0.f;
      for (int i = 0; i < QK; i++) amax = std::max(amax, std::fabs(xb[i]));
      float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* qb = out.q.data() + m * K + b * QK;
      int sum = 0;
      for (int i = 0; i < QK; i++) {
        int v = (int)std::nearbyint(xb[i] * id);
        qb[i] = (int8_t)v;
        sum += v;
      }
      out.d[m * (K / QK) + b] = d;
      out.s[m * (K / QK) + b] = d * (float)sum;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// GEMM: y[m, n] = dot(w[n], x[m]) for NR activation rows per weight row (the weight block is unpacked once).
// ---------------------------------------------------------------------------------------------------------

#ifdef SPECDEC_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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
  const int8_t* xq[NR];
  const float *xd[NR], *xs[NR];
  for (int r = 0; r < NR; r++) { xq[r] = x.row(m0 + r); xd[r] = x.dr(m0 + r); xs[r] = x.sr(m0 + r); }
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
    for (int r = 0; r < NR; r++) {
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq[r] + j * QK));
      const __m256 dx = _mm256_set1_ps(xd[r][j]);
      for (int i = 0; i < NW; i++) {
        __m256 p = _mm256_cvtepi32_ps(dot32<F::SIGNED>(q[i], xv));
        acc[i][r] = _mm256_fmadd_ps(p, _mm256_mul_ps(scv[i], dx), acc[i][r]);
        if (!F::SIGNED) accm[i][r] += mn[i] * xs[r][j];
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
        const int8_t* xb = xq[r] + j * QK;
        int lo = 0, hi = 0;
        for (int k = 0; k < 16; k++) {
          int a = F::SIGNED ? (int)(int8_t)q[k] : (int)q[k], b = F::SIGNED ? (int)(int8_t)q[k + 16] : (int)q[k + 16];
          lo += a * xb[k];
          hi += b * xb[k + 16];
        }
        acc[i][r] += (float)lo * (sc[0] * xd[r][j]) + (float)hi * (sc[1] * xd[r][j]);
        if (!F::SIGNED) accm[i][r] += mn * xs[r][j];
      }
    }
  }
  for (int i = 0; i < NW; i++)
    for (int r = 0; r < NR; r++) y[(m0 + r) * ldy + n0 + i] = acc[i][r] + accm[i][r];
#endif
}

// ---------------------------------------------------------------------------------------------------------
// Interleaved layout for the common 32-weight formats (Q4_0, Q4_1, Q8_0): the same values, regrouped at load
// so that 8 weight rows sit in the 8 lanes of a vector. Per group of 8 rows and sub-block of 32 weights a
// record holds the 8 f16 scales (and the 8 f16 minimums for 4-bit) and the quants, 4 consecutive weights
// of row i at bytes 4i..4i+3 of each 32-byte vector (for 4-bit, vector e < 4 in low nibbles, e + 4 in high).
// One broadcast of 4 activation bytes then multiplies all 8 rows, and the 8 results land in 8 lanes: about
// a third of the instructions of the row-at-a-time loop, and no horizontal sums.
// ---------------------------------------------------------------------------------------------------------

template <bool FOUR_BIT>
struct Interleaved {
  static constexpr int64_t REC = FOUR_BIT ? 32 + 128 : 16 + 256;
  static constexpr int64_t PREFETCH = 8;  // records ahead

  template <class F>
  static torch::Tensor pack(const torch::Tensor& data, int64_t K) {
    const int64_t groups = data.size(0) / 8, nsub = K / QK, row_bytes = data.size(1);
    auto out = torch::empty({groups, nsub * REC}, torch::kUInt8);
    const uint8_t* src = data.data_ptr<uint8_t>();
    std::atomic<bool> representable{true};
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      uint8_t q[8][32];
      for (int64_t g = g0; g < g1; g++) {
        for (int64_t j = 0; j < nsub; j++) {
          uint8_t* rec = out.data_ptr<uint8_t>() + g * nsub * REC + j * REC;
          for (int i = 0; i < 8; i++) {
            const uint8_t* blk = src + (g * 8 + i) * row_bytes + j * F::BYTES;
            float sc[2], mn;
            F::scales(blk, 0, sc, mn);
            F::quants(blk, 0, q[i]);
            std::memcpy(rec + 2 * i, blk, 2);  // d, as the file has it
            if (FOUR_BIT) {
              uint16_t m = F::BYTES == 20 ? read_u16(blk + 2) : float_to_half(mn);  // Q4_0: -8 d, exact
              if (!std::isfinite(half_to_float(m))) representable = false;  // -8 d beyond f16's range
              std::memcpy(rec + 16 + 2 * i, &m, 2);
            }
          }
          uint8_t* qs = rec + (FOUR_BIT ? 32 : 16);
          for (int e = 0; e < (FOUR_BIT ? 4 : 8); e++)
            for (int i = 0; i < 8; i++)
              for (int b = 0; b < 4; b++)
                qs[32 * e + 4 * i + b] = FOUR_BIT ? (uint8_t)(q[i][4 * e + b] | (q[i][4 * (e + 4) + b] << 4))
                                                  : q[i][4 * e + b];
        }
      }
    });
    return representable ? out : torch::Tensor();  // undefined: the part keeps the row-at-a-time path
  }

  // y[m0 + r, n0 .. n0 + 7] for NR activation rows against one group of 8 weight rows.
  template <int NR>
  static void tile(const uint8_t* recs, const QAct& x, int64_t m0, float* y, int64_t ldy, int64_t n0) {
    const int64_t nsub = x.K / QK;
#ifdef SPECDEC_AVX2
    const int8_t* xq[NR];
    const float *xd[NR], *xs[NR];
    for (int r = 0; r < NR; r++) { xq[r] = x.row(m0 + r); xd[r] = x.dr(m0 + r); xs[r] = x.sr(m0 + r); }
    __m256 acc[NR];
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t j = 0; j < nsub; j++) {
      const uint8_t* rec = recs + j * REC;
      _mm_prefetch((const char*)(rec + PREFETCH * REC), _MM_HINT_T0);
      _mm_prefetch((const char*)(rec + PREFETCH * REC + 64), _MM_HINT_T0);
      _mm_prefetch((const char*)(rec + PREFETCH * REC + 128), _MM_HINT_T0);
      if (!FOUR_BIT) {
        _mm_prefetch((const char*)(rec + PREFETCH * REC + 192), _MM_HINT_T0);
        _mm_prefetch((const char*)(rec + PREFETCH * REC + 256), _MM_HINT_T0);
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)rec));
      if (FOUR_BIT) {
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(rec + 16)));
        const __m256i low = _mm256_set1_epi8(15);
        __m256i u[8];
        for (int e = 0; e < 4; e++) {
          __m256i raw = _mm256_loadu_si256((const __m256i*)(rec + 32 + 32 * e));
          u[e] = _mm256_and_si256(raw, low);
          u[e + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        for (int r = 0; r < NR; r++) {
          const int32_t* xw = (const int32_t*)(xq[r] + j * QK);
#ifdef SPECDEC_VNNI
          __m256i s = _mm256_setzero_si256();
          for (int e = 0; e < 8; e++) s = SPECDEC_DPBUSD(s, u[e], _mm256_set1_epi32(xw[e]));
          __m256 p = _mm256_cvtepi32_ps(s);
#else
          // int16 sums stay below 8 * 2 * 15 * 127 = 30480: no saturation
          __m256i s = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(xw[0]));
          for (int e = 1; e < 8; e++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[e], _mm256_set1_epi32(xw[e])));
          __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
#endif
          acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_set1_ps(xd[r][j])), acc[r]);
          acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[r][j]), acc[r]);
        }
      } else {
        for (int r = 0; r < NR; r++) {
          const int32_t* xw = (const int32_t*)(xq[r] + j * QK);
          __m256i s = _mm256_setzero_si256();
          for (int e = 0; e < 8; e++) {
            __m256i u = _mm256_loadu_si256((const __m256i*)(rec + 16 + 32 * e));
            s = _mm256_add_epi32(s, dot32<true>(u, _mm256_set1_epi32(xw[e])));
          }
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(xd[r][j])), acc[r]);
        }
      }
    }
    for (int r = 0; r < NR; r++) _mm256_storeu_ps(y + (m0 + r) * ldy + n0, acc[r]);
#else
    for (int r = 0; r < NR; r++) {
      const int8_t* xq = x.row(m0 + r);
      float acc[8] = {};
      for (int64_t j = 0; j < nsub; j++) {
        const uint8_t* rec = recs + j * REC;
        const uint8_t* qs = rec + (FOUR_BIT ? 32 : 16);
        for (int i = 0; i < 8; i++) {
          int sum = 0;
          for (int e = 0; e < 8; e++)
            for (int b = 0; b < 4; b++) {
              int v = FOUR_BIT ? (e < 4 ? qs[32 * e + 4 * i + b] & 15 : qs[32 * (e - 4) + 4 * i + b] >> 4)
                               : (int)(int8_t)qs[32 * e + 4 * i + b];
              sum += v * xq[j * QK + 4 * e + b];
            }
          float d = half_to_float(read_u16(rec + 2 * i));
          acc[i] += (float)sum * (d * x.dr(m0 + r)[j]);
          if (FOUR_BIT) acc[i] += half_to_float(read_u16(rec + 16 + 2 * i)) * x.sr(m0 + r)[j];
        }
      }
      for (int i = 0; i < 8; i++) y[(m0 + r) * ldy + n0 + i] = acc[i];
    }
#endif
  }

  static void rows(const torch::Tensor& packed, const QAct& x, float* y, int64_t ldy, int64_t g, int64_t n0) {
    const uint8_t* recs = packed.data_ptr<uint8_t>() + g * packed.size(1);
    int64_t m = 0;
    for (; m + 4 <= x.M; m += 4) tile<4>(recs, x, m, y, ldy, n0);
    switch (x.M - m) {
      case 3: tile<3>(recs, x, m, y, ldy, n0); break;
      case 2: tile<2>(recs, x, m, y, ldy, n0); break;
      case 1: tile<1>(recs, x, m, y, ldy, n0); break;
    }
  }
};

// A weight matrix: consecutive row ranges ("parts"), each in one block format (q, k and v, or gate and up,
// fused into one matrix may come in different formats from a GGUF).
struct QMatrix {
  std::vector<torch::Tensor> data;  // uint8 [rows, row_bytes] per part: the file's blocks
  std::vector<int64_t> formats, first;  // format id and first output row per part; first has parts + 1
  std::vector<torch::Tensor> x8;  // per part: its first rows / 8 * 8 rows interleaved (see Interleaved), or undefined
  int64_t K = 0;
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

// y [M, ldy] (columns 0..N) = x @ W.T for quantized x.
void qgemm(const QMatrix& W, const QAct& x, float* y, int64_t ldy) {
  const int64_t N = W.N();
  int64_t grain = std::max<int64_t>(8, std::min<int64_t>(64, N / (8 * at::get_num_threads()) + 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (size_t p = 0; p + 1 < W.first.size(); p++) {
      int64_t a = std::max(n0, W.first[p]), b = std::min(n1, W.first[p + 1]);
      if (a >= b) continue;
      if (W.x8[p].defined()) {  // groups of 8 rows, each done by the chunk holding its first row
        const int64_t off = W.first[p], packed = W.x8[p].size(0) * 8;
        for (int64_t g = (a - off + 7) / 8; g * 8 < std::min(b - off, packed); g++) {
          if (W.formats[p] == F_Q8_0) Interleaved<false>::rows(W.x8[p], x, y, ldy, g, off + 8 * g);
          else Interleaved<true>::rows(W.x8[p], x, y, ldy, g, off + 8 * g);
        }
        a = std::max(a, off + packed);
        if (a >= b) continue;
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
    TORCH_CHECK(data[p].dtype() == torch::kUInt8 && data[p].dim() == 2 && data[p].is_contiguous(),
                "quantized data must be contiguous uint8 [rows, row_bytes]");
    int64_t bytes = with_format(formats[p], [&](auto f) {
      using F = decltype(f);
      TORCH_CHECK(K % F::BLOCK == 0, "row length ", K, " is not a multiple of the block size ", F::BLOCK);
      return K / F::BLOCK * F::BYTES;
    });
    TORCH_CHECK(data[p].size(1) == bytes, "part ", p, " has ", data[p].size(1), " bytes per row, expected ", bytes);
    W.data.push_back(data[p]);
    W.formats.push_back(formats[p]);
    torch::Tensor x8;
    if (data[p].size(0) >= 8 && interleave) {
      if (formats[p] == F_Q8_0) x8 = Interleaved<false>::pack<Q8_0>(data[p], K);
      if (formats[p] == F_Q4_0) x8 = Interleaved<true>::pack<Q4_0>(data[p], K);
      if (formats[p] == F_Q4_1) x8 = Interleaved<true>::pack<Q4_1>(data[p], K);
    }
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
  quantize_rows(xc.data_ptr<float>(), xc.size(0), W.K, W.K, qx);
  auto y = torch::empty({xc.size(0), W.N()}, x.options());
  qgemm(W, qx, y.data_ptr<float>(), W.N());
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
    const uint8_t* w = W.data[p].data_ptr<uint8_t>() + (n - W.first[p]) * W.data[p].size(1);
    float* o = out.data_ptr<float>() + t * W.K;
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

// Fixed-order float dot product (8 lanes, then a fixed horizontal sum) over n floats.
float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef SPECDEC_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum(acc);
#endif
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

void rms_norm_rows(const float* x, const float* w, float eps, int64_t T, int64_t H, float* out) {
  for (int64_t t = 0; t < T; t++) {
    const float* xr = x + t * H;
    float ss = dot_f32(xr, xr, H);
    float inv = 1.f / std::sqrt(ss / (float)H + eps);
    for (int64_t i = 0; i < H; i++) out[t * H + i] = w[i] * (xr[i] * inv);
  }
}

struct Layer {
  torch::Tensor ln1, qkv_b, q_norm, k_norm, ln2;  // float32 (absent ones empty)
  QMatrix qkv, o, gate_up, down;
  int64_t n_heads, n_kv, head_dim;
  double eps;
};

// Attention of every query over its sequence's context slots.
// A query's scores, softmax and weighted sum run over its visible keys in slot order, so the result does
// not depend on how many other queries or masked keys share the call.
#ifdef SPECDEC_AVX2
// exp(x) for x <= 0 in 8 lanes: 2^n e^r with |r| <= ln 2 / 2, e^r by the Cephes polynomial (~1e-7 relative).
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Scores of q against 8 keys at once: 8 lane-wise partial sums, then one transpose-and-add tree.
inline __m256 dot8_keys(const float* q, const float* const k[8], int64_t D) {
  __m256 a[8];
  for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i] + d), a[i]);
  }
  __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // lanes: [k0 k1 k2 k3 | k0 k1 k2 k3] halves of keys 0-3, same for 4-7
  __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}
#endif

// Attention of every query over its sequence's context slots.
// A query's visible keys are listed in slot order, and its scores, softmax and weighted sum run over that
// list alone (key i of the list always in lane i % 8), so the result does not depend on how many other
// queries or masked keys share the call.
void attention(const float* qkv, int64_t T, const Layer& L, torch::Tensor& k_pool, torch::Tensor& v_pool,
               const int64_t* context_slots, int64_t Lk, const bool* mask, int64_t S,
               const int64_t* query_starts, int64_t B, double scale, float* out) {
  const int64_t Hq = L.n_heads, Hkv = L.n_kv, D = L.head_dim, G = Hq / Hkv, W = (Hq + 2 * Hkv) * D;
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  // Tasks: (sequence, query head, chunk of QCHUNK queries), so a long prefill splits evenly across threads.
  constexpr int64_t QCHUNK = 16;
  std::vector<int64_t> task_seq, task_first;
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = query_starts[b]; t < query_starts[b + 1]; t += QCHUNK) { task_seq.push_back(b); task_first.push_back(t); }
  const int64_t ntasks = (int64_t)task_seq.size() * Hq;
  at::parallel_for(0, ntasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p(Lk + 8);
    std::vector<const float*> keys(Lk + 8), values(Lk + 8);
    std::vector<float> zero(D, 0.f);
    for (int64_t task = t0; task < t1; task++) {
      const int64_t b = task_seq[task / Hq], h = task % Hq, hk = h / G, first = task_first[task / Hq];
      for (int64_t t = first; t < std::min(first + QCHUNK, query_starts[b + 1]); t++) {
        const bool* mrow = mask + (b * S + (t - query_starts[b])) * Lk;
        const float* q = qkv + t * W + h * D;
        int64_t n = 0;
        for (int64_t j = 0; j < Lk; j++) {
          if (!mrow[j]) continue;
          keys[n] = kp + (context_slots[b * Lk + j] * Hkv + hk) * D;
          values[n++] = vp + (context_slots[b * Lk + j] * Hkv + hk) * D;
        }
        float top = -INFINITY, total = 0.f;
        int64_t i = 0;
#ifdef SPECDEC_AVX2
        if (D % 8 == 0) {
          for (int64_t c = n; c < (n + 7) / 8 * 8; c++) keys[c] = zero.data();  // padding keys, dropped below
          __m256 sc = _mm256_set1_ps((float)scale);
          for (; i < n; i += 8) _mm256_storeu_ps(p.data() + i, _mm256_mul_ps(dot8_keys(q, keys.data() + i, D), sc));
          for (int64_t c = 0; c < n; c++) top = std::max(top, p[c]);
          __m256 tv = _mm256_set1_ps(top), sum = _mm256_setzero_ps();
          for (i = 0; i + 8 <= n; i += 8) {
            __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p.data() + i), tv));
            _mm256_storeu_ps(p.data() + i, e);
            sum = _mm256_add_ps(sum, e);
          }
          if (i < n) {  // the tail: the same lanes, masked keys contribute exact zeros
            alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t c = i; c < n; c++) tail[c - i] = p[c];
            __m256 e = exp_ps(_mm256_sub_ps(_mm256_load_ps(tail), tv));
            alignas(32) float et[8];
            _mm256_store_ps(et, e);
            for (int64_t c = i; c < n; c++) { p[c] = et[c - i]; }
            for (int64_t c = n - i; c < 8; c++) et[c] = 0.f;
            sum = _mm256_add_ps(sum, _mm256_load_ps(et));
          }
          total = hsum(sum);
        } else
#endif
        {
          for (int64_t c = 0; c < n; c++) { p[c] = dot_f32(q, keys[c], D) * (float)scale; top = std::max(top, p[c]); }
          for (int64_t c = 0; c < n; c++) { p[c] = std::exp(p[c] - top); total += p[c]; }
        }
        const float inv = 1.f / total;
        float* o = out + (t * Hq + h) * D;
        int64_t d0 = 0;
#ifdef SPECDEC_AVX2
        for (; d0 + 32 <= D; d0 += 32) {  // 4 accumulators in registers across all keys
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
          for (int64_t c = 0; c < n; c++) {
            const float* v = values[c] + d0;
            __m256 w = _mm256_set1_ps(p[c] * inv);
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
          }
          _mm256_storeu_ps(o + d0, a0); _mm256_storeu_ps(o + d0 + 8, a1);
          _mm256_storeu_ps(o + d0 + 16, a2); _mm256_storeu_ps(o + d0 + 24, a3);
        }
#endif
        for (; d0 < D; d0++) {
          float a = 0.f;
          for (int64_t c = 0; c < n; c++) a += (p[c] * inv) * values[c][d0];
          o[d0] = a;
        }
      }
    }
  });
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
      for (int64_t d = 0; d < D; d++) x[d] = tmp[d] * cos[t * D + d] + tmp[(d + half) % D] * ssin[t * D + d];
    }
  }
}

void decoder_layer(const Layer& L, torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& ssin,
                   torch::Tensor k_pool, torch::Tensor v_pool, const torch::Tensor& slot_mapping,
                   const torch::Tensor& context_slots, const torch::Tensor& mask, const torch::Tensor& query_starts,
                   double scale) {
  const int64_t T = x.size(0), H = x.size(1), D = L.head_dim, Hq = L.n_heads, Hkv = L.n_kv;
  const int64_t W = (Hq + 2 * Hkv) * D, inter = L.gate_up.N() / 2;
  float* xp = x.data_ptr<float>();
  std::vector<float> h(T * std::max(H, inter)), qkv(T * W), attn(T * Hq * D), out(T * std::max(H, 2 * inter));
  QAct qx;

  rms_norm_rows(xp, L.ln1.data_ptr<float>(), (float)L.eps, T, H, h.data());
  quantize_rows(h.data(), T, H, H, qx);
  qgemm(L.qkv, qx, qkv.data(), W);
  if (L.qkv_b.numel() > 0) {
    const float* bias = L.qkv_b.data_ptr<float>();
    for (int64_t t = 0; t < T; t++)
      for (int64_t i = 0; i < W; i++) qkv[t * W + i] += bias[i];
  }
  rope_and_qk_norm(qkv.data(), T, L, cos.data_ptr<float>(), ssin.data_ptr<float>());
  float* kp = k_pool.data_ptr<float>();
  float* vp = v_pool.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++) {  // the new keys and values go in first: queries see themselves
    std::memcpy(kp + slots[t] * Hkv * D, qkv.data() + t * W + Hq * D, Hkv * D * sizeof(float));
    std::memcpy(vp + slots[t] * Hkv * D, qkv.data() + t * W + (Hq + Hkv) * D, Hkv * D * sizeof(float));
  }
  attention(qkv.data(), T, L, k_pool, v_pool, context_slots.data_ptr<int64_t>(), context_slots.size(1),
            mask.data_ptr<bool>(), mask.size(1), query_starts.data_ptr<int64_t>(), query_starts.size(0) - 1, scale,
            attn.data());

  quantize_rows(attn.data(), T, Hq * D, Hq * D, qx);
  qgemm(L.o, qx, out.data(), H);
  for (int64_t i = 0; i < T * H; i++) xp[i] += out[i];

  rms_norm_rows(xp, L.ln2.data_ptr<float>(), (float)L.eps, T, H, h.data());
  quantize_rows(h.data(), T, H, H, qx);
  qgemm(L.gate_up, qx, out.data(), 2 * inter);
  for (int64_t t = 0; t < T; t++) {
    for (int64_t i = 0; i < inter; i++) {
      float g = out[t * 2 * inter + i];
      h[t * inter + i] = g / (1.f + std::exp(-g)) * out[t * 2 * inter + inter + i];
    }
  }
  quantize_rows(h.data(), T, inter, inter, qx);
  qgemm(L.down, qx, out.data(), H);
  for (int64_t i = 0; i < T * H; i++) xp[i] += out[i];
}

// The first num_layers layers in order, in place on x; returns x after each layer listed in `capture`.
struct Stack {
  std::vector<Layer> layers;
  std::vector<torch::Tensor> forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& ssin,
                                     std::vector<torch::Tensor> k_pools, std::vector<torch::Tensor> v_pools,
                                     const torch::Tensor& slot_mapping, const torch::Tensor& context_slots,
                                     const torch::Tensor& mask, const torch::Tensor& query_starts, double scale,
                                     int64_t num_layers, std::vector<int64_t> capture) const {
    TORCH_CHECK(num_layers <= (int64_t)layers.size() && (int64_t)k_pools.size() >= num_layers, "too few layers or pools");
    std::vector<torch::Tensor> out;
    for (int64_t i = 0; i < num_layers; i++) {
      decoder_layer(layers[i], x, cos, ssin, k_pools[i], v_pools[i], slot_mapping, context_slots, mask, query_starts,
                    scale);
      if (std::find(capture.begin(), capture.end(), i) != capture.end()) out.push_back(x.clone());
    }
    return out;
  }
};

std::string isa() {
#ifdef SPECDEC_VNNI
  return "avx2+vnni";
#elif defined(SPECDEC_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

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
      .def("forward", &decoder_layer);
  py::class_<Stack>(m, "Stack")
      .def(py::init([](std::vector<Layer> layers) { return Stack{std::move(layers)}; }))
      .def("forward", &Stack::forward);
  m.def("linear", &linear, "y = x @ W.T with x float32 [M, K] quantized per row to int8 blocks");
  m.def("dequantize_rows", &dequantize_rows);
  m.def("isa", &isa);
}
