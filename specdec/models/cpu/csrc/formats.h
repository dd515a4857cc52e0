// GGUF block formats: the only code that knows how a format lays out its bytes. Each format is one struct with
// two views of the same weights:
//
//   row view (the file's own blocks), for dequantization, for the rows left over after groups of 8, and for the
//   portable build:
//     scales(b, sub, sc, mn)   w[i] = sc[i / 16] * q[i] + mn for sub-block `sub` (32 weights) of block `b`
//     quants(b, sub, q)        its 32 integers: int8 (SIGNED) or uint8 (not SIGNED); an AVX2 overload gives a vector
//
//   interleaved view (X8, built once at load, vector builds only): 8 weight rows regrouped so that one vector holds
//   4 consecutive weights of each of the 8 rows. Per BLOCK weights of 8 rows a record of REC bytes: a header
//   (the rows' scales, as the file stores them), then per sub-block of 32 the quants as planes:
//     nibbles  128 bytes   byte 32e + 4i + b: weight 4e + b of row i (low nibble), weight 4(e + 4) + b (high)
//     plane    32 bytes    byte 4i + b, bit e: one more bit (bit 4 or 5) of weight 4e + b of row i
//     crumbs   64 bytes    byte 32c + 4i + b, bits 2k, 2k + 1: bits 4-5 of weight 4(c + 2k) + b of row i (Q6_K)
//     bytes    256 bytes   byte 32e + 4i + b: weight 4e + b of row i
//   so u[e] (e = 0..7) = the 8 rows' weights 4e..4e+3 in the 8 lanes, and one broadcast of 4 activation bytes
//   multiplies all 8 rows at once (gemm.h). KIND says how a value u becomes a weight:
//     K_MIN     w = scale * u + minimum              (Q4_1, Q5_1, Q4_K, Q5_K)
//     K_OFFSET  w = scale * (u - OFFSET)             (Q4_0, Q5_0)
//     K_SIGNED  w = scale * u, u int8                (Q8_0, IQ4_NL, IQ4_XS)
//     K_HALVES  w = scale_h * (u - 32), a scale per 16 weights (Q6_K)
//   The header is the file's scales, not products of them, so a record is about as large as the file's blocks
//   and the weights are exactly the file's.
#pragma once
#include "simd.h"

namespace {

constexpr int QK = 32;  // activation block, and the unit every weight format is unpacked in

inline uint16_t read_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

enum Kind { K_MIN, K_OFFSET, K_SIGNED, K_HALVES };

// IQ4_NL / IQ4_XS: a 4-bit index into these 16 non-linear levels.
constexpr int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4: the 16 FP4 (e2m1) values, doubled to integers (ggml's kvalues_mxfp4; the block scale is halved to match).
constexpr int8_t MXFP4_LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// ---- planes: writing them at load (scalar), reading them in the kernels (AVX2) ------------------------------

inline void put_nibbles(const uint8_t u[8][32], uint8_t* out) {
  for (int e = 0; e < 4; e++)
    for (int i = 0; i < 8; i++)
      for (int b = 0; b < 4; b++)
        out[32 * e + 4 * i + b] = (uint8_t)((u[i][4 * e + b] & 15) | ((u[i][4 * (e + 4) + b] & 15) << 4));
}

inline void put_plane(const uint8_t u[8][32], int bit, uint8_t* out) {
  for (int i = 0; i < 8; i++)
    for (int b = 0; b < 4; b++) {
      uint8_t v = 0;
      for (int e = 0; e < 8; e++) v |= (uint8_t)(((u[i][4 * e + b] >> bit) & 1) << e);
      out[4 * i + b] = v;
    }
}

inline void put_bytes(const uint8_t u[8][32], uint8_t* out) {
  for (int e = 0; e < 8; e++)
    for (int i = 0; i < 8; i++)
      for (int b = 0; b < 4; b++) out[32 * e + 4 * i + b] = u[i][4 * e + b];
}

// bits 4 and 5 of each weight, four weights to a byte: byte 32c + 4i + b, bits 2k and 2k + 1: weight 4(c + 2k) + b of
// row i (c = 0, 1; k = 0..3). Two 32-byte vectors give all 8 u[e] their two high bits, 3 operations each.
inline void put_crumbs(const uint8_t u[8][32], uint8_t* out) {
  for (int c = 0; c < 2; c++)
    for (int i = 0; i < 8; i++)
      for (int b = 0; b < 4; b++) {
        uint8_t v = 0;
        for (int k = 0; k < 4; k++) v |= (uint8_t)(((u[i][4 * (c + 2 * k) + b] >> 4) & 3) << (2 * k));
        out[32 * c + 4 * i + b] = v;
      }
}

inline void put_halves(const uint8_t* const blk[8], int at, uint8_t* out) {  // the 8 rows' f16 at byte `at`
  for (int i = 0; i < 8; i++) std::memcpy(out + 2 * i, blk[i] + at, 2);
}

#ifdef SPECDEC_AVX2
inline void get_nibbles(const uint8_t* p, __m256i u[8]) {
  const __m256i low = _mm256_set1_epi8(15);
  for (int e = 0; e < 4; e++) {
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + 32 * e));
    u[e] = _mm256_and_si256(raw, low);
    u[e + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  }
}

// u[e] |= bit e of each plane byte, moved to bit `bit`. A 16-bit shift carries bits across the byte boundary,
// but never onto bit `bit` of the other byte, so the mask leaves exactly the wanted one.
inline void add_plane(const uint8_t* p, int bit, __m256i u[8]) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)p), mask = _mm256_set1_epi8((char)(1 << bit));
  for (int e = 0; e < 8; e++) {
    const __m256i moved = e <= bit ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(bit - e))
                                   : _mm256_srl_epi16(h, _mm_cvtsi32_si128(e - bit));
    u[e] = _mm256_or_si256(u[e], _mm256_and_si256(moved, mask));
  }
}

// u[e] |= bits 4 and 5 from the crumbs (put_crumbs). 16-bit shifts carry bits across the byte boundary, but
// never onto bits 4-5 of the other byte, so the mask leaves exactly the wanted two.
inline void add_crumbs(const uint8_t* p, __m256i u[8]) {
  const __m256i mask = _mm256_set1_epi8(0x30);
  for (int c = 0; c < 2; c++) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)(p + 32 * c));
    u[c] = _mm256_or_si256(u[c], _mm256_and_si256(_mm256_slli_epi16(h, 4), mask));
    u[c + 2] = _mm256_or_si256(u[c + 2], _mm256_and_si256(_mm256_slli_epi16(h, 2), mask));
    u[c + 4] = _mm256_or_si256(u[c + 4], _mm256_and_si256(h, mask));
    u[c + 6] = _mm256_or_si256(u[c + 6], _mm256_and_si256(_mm256_srli_epi16(h, 2), mask));
  }
}

inline __m256 load_halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 u8_to_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline __m256i i8_to_epi32(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

// 32 bits -> 32 bytes, 0xFF where the bit is set (byte i from bit i).
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32((int)bits),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

// A 4-bit format's levels (IQ4's, MXFP4's) as a 16-byte table in both lanes: signed, or + 128 (unsigned, for VNNI's
// u8 x s8 products).
inline __m256i iq4_table(bool biased, const int8_t* levels = IQ4_LEVELS) {
  alignas(16) int8_t t[16];
  for (int i = 0; i < 16; i++) t[i] = (int8_t)(levels[i] + (biased ? 128 : 0));
  const __m128i v = _mm_load_si128((const __m128i*)t);
  return _mm256_set_m128i(v, v);
}

// Signed interleaved values as the dot products take them: biased by 128 to u8 under VNNI, as they are otherwise.
inline void ready_signed(__m256i u[8]) {
#ifdef SPECDEC_VNNI
  for (int e = 0; e < 8; e++) u[e] = _mm256_xor_si256(u[e], _mm256_set1_epi8((char)0x80));
#else
  (void)u;
#endif
}
#endif

// ---- the 32-weight formats ------------------------------------------------------------------------------------

struct Q8_0 {  // {f16 d; int8 q[32]}: w = d * q
  static constexpr int BLOCK = 32, BYTES = 34, REC = 16 + 256;
  static constexpr bool SIGNED = true;
  static constexpr Kind KIND = K_SIGNED;
  static void scales(const uint8_t* b, int, float sc[2], float& mn) {
    sc[0] = sc[1] = half_to_float(read_u16(b));
    mn = 0.f;
  }
  static void quants(const uint8_t* b, int, uint8_t q[32]) { std::memcpy(q, b + 2, 32); }
  static void pack(const uint8_t* const blk[8], uint8_t* rec) {
    uint8_t u[8][32];
    for (int i = 0; i < 8; i++) quants(blk[i], 0, u[i]);
    put_halves(blk, 0, rec);
    put_bytes(u, rec + 16);
  }
#ifdef SPECDEC_AVX2
  static __m256i quants(const uint8_t* b, int) { return _mm256_loadu_si256((const __m256i*)(b + 2)); }
  struct Head {
    __m256 d;
    explicit Head(const uint8_t* rec) : d(load_halves(rec)) {}
    __m256 scale(const uint8_t*, int) const { return d; }
  };
  static void unpack(const uint8_t* rec, int, __m256i u[8]) {
    for (int e = 0; e < 8; e++) u[e] = _mm256_loadu_si256((const __m256i*)(rec + 16 + 32 * e));
    ready_signed(u);
  }
#endif
};

// Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d; f16 m; u8 qs[16]}, Q5_0 {f16 d; u32 qh; u8 qs[16]}, Q5_1 {f16 d; f16 m;
// u32 qh; u8 qs[16]}: weight i is nibble (i / 16) of qs[i % 16] (5-bit: plus bit i of qh as its fifth bit);
// without a minimum w = d (q - 2^(BITS - 1)), with one w = d q + m. Record: d[8], (m[8],) (plane,) nibbles.
template <int BITS, bool HAS_MIN>
struct Legacy {
  static constexpr int OFF = HAS_MIN ? 4 : 2, QH = BITS == 5 ? 4 : 0, BLOCK = 32, BYTES = OFF + QH + 16;
  static constexpr int HEAD = HAS_MIN ? 32 : 16, PLANE = BITS == 5 ? 32 : 0, REC = HEAD + PLANE + 128;
  static constexpr bool SIGNED = false;
  static constexpr Kind KIND = HAS_MIN ? K_MIN : K_OFFSET;
  static constexpr int UMAX = (1 << BITS) - 1, OFFSET = HAS_MIN ? 0 : 1 << (BITS - 1);
  static void scales(const uint8_t* b, int, float sc[2], float& mn) {
    float d = half_to_float(read_u16(b));
    sc[0] = sc[1] = d;
    mn = HAS_MIN ? half_to_float(read_u16(b + 2)) : -(float)OFFSET * d;
  }
  static void quants(const uint8_t* b, int, uint8_t q[32]) {
    uint32_t qh = 0;
    if (QH) std::memcpy(&qh, b + OFF, 4);
    for (int i = 0; i < 16; i++) {
      q[i] = (uint8_t)((b[OFF + QH + i] & 15) | (((qh >> i) & 1) << 4));
      q[i + 16] = (uint8_t)((b[OFF + QH + i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
  }
  static void pack(const uint8_t* const blk[8], uint8_t* rec) {
    uint8_t u[8][32];
    for (int i = 0; i < 8; i++) quants(blk[i], 0, u[i]);
    put_halves(blk, 0, rec);
    if (HAS_MIN) put_halves(blk, 2, rec + 16);
    if (PLANE) put_plane(u, 4, rec + HEAD);
    put_nibbles(u, rec + HEAD + PLANE);
  }
#ifdef SPECDEC_AVX2
  static __m256i quants(const uint8_t* b, int) {
    __m128i raw = _mm_loadu_si128((const __m128i*)(b + OFF + QH)), low = _mm_set1_epi8(15);
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
    if (QH) {
      uint32_t qh;
      std::memcpy(&qh, b + OFF, 4);
      q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(16)));
    }
    return q;
  }
  struct Head {
    __m256 d, m;
    explicit Head(const uint8_t* rec) : d(load_halves(rec)), m(HAS_MIN ? load_halves(rec + 16) : _mm256_setzero_ps()) {}
    __m256 scale(const uint8_t*, int) const { return d; }
    __m256 minimum(const uint8_t*, int) const { return m; }
  };
  static void unpack(const uint8_t* rec, int, __m256i u[8]) {
    get_nibbles(rec + HEAD + PLANE, u);
    if (PLANE) add_plane(rec + HEAD, 4, u);
  }
#endif
};
using Q4_0 = Legacy<4, false>;
using Q4_1 = Legacy<4, true>;
using Q5_0 = Legacy<5, false>;
using Q5_1 = Legacy<5, true>;

// IQ4_NL {f16 d; u8 qs[16]}: weight i is level[nibble (i / 16) of byte i % 16] times d.
struct IQ4_NL {
  static constexpr int BLOCK = 32, BYTES = 18, REC = 16 + 128;
  static constexpr bool SIGNED = true;
  static constexpr Kind KIND = K_SIGNED;
  static void scales(const uint8_t* b, int, float sc[2], float& mn) {
    sc[0] = sc[1] = half_to_float(read_u16(b));
    mn = 0.f;
  }
  static void indices(const uint8_t* qs, uint8_t q[32]) {
    for (int i = 0; i < 16; i++) { q[i] = qs[i] & 15; q[i + 16] = qs[i] >> 4; }
  }
  static void quants(const uint8_t* b, int, uint8_t q[32]) {
    indices(b + 2, q);
    for (int i = 0; i < 32; i++) q[i] = (uint8_t)IQ4_LEVELS[q[i]];
  }
  static void pack(const uint8_t* const blk[8], uint8_t* rec) {
    uint8_t u[8][32];
    for (int i = 0; i < 8; i++) indices(blk[i] + 2, u[i]);
    put_halves(blk, 0, rec);
    put_nibbles(u, rec + 16);
  }
#ifdef SPECDEC_AVX2
  static __m256i levels(const uint8_t* qs) {
    __m128i raw = _mm_loadu_si128((const __m128i*)qs), low = _mm_set1_epi8(15);
    __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
    return _mm256_shuffle_epi8(iq4_table(false), idx);
  }
  static __m256i quants(const uint8_t* b, int) { return levels(b + 2); }
  struct Head {
    __m256 d;
    explicit Head(const uint8_t* rec) : d(load_halves(rec)) {}
    __m256 scale(const uint8_t*, int) const { return d; }
  };
  static void unpack(const uint8_t* rec, int, __m256i u[8]) {
#ifdef SPECDEC_VNNI
    const __m256i table = iq4_table(true);
#else
    const __m256i table = iq4_table(false);
#endif
    get_nibbles(rec + 16, u);
    for (int e = 0; e < 8; e++) u[e] = _mm256_shuffle_epi8(table, u[e]);
  }
#endif
};

// ---- the 256-weight formats (K-quants, IQ4_XS): 8 sub-blocks of 32 ------------------------------------------

// Q4_K {f16 d; f16 dmin; u8 scales[12] (8 x 6-bit scale, 8 x 6-bit min); u8 qs[128]}, Q5_K the same plus
// u8 qh[32] before qs: sub-block s is nibble s % 2 of bytes 32 (s / 2) .. + 31 (Q5_K: plus bit s of qh[i]);
// w = d sc_s q - dmin m_s. Record: d[8], dmin[8], sc[sub][row], m[sub][row], then per sub-block (plane,) nibbles.
template <bool FIVE>
struct QK_Min {
  static constexpr int BLOCK = 256, BYTES = FIVE ? 176 : 144, QS = FIVE ? 48 : 16;
  static constexpr int HEAD = 160, SUB = FIVE ? 160 : 128, REC = HEAD + 8 * SUB;
  static constexpr bool SIGNED = false;
  static constexpr Kind KIND = K_MIN;
  static constexpr int UMAX = FIVE ? 31 : 15, OFFSET = 0;
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
    const uint8_t* qs = b + QS + 32 * (sub / 2);
    for (int i = 0; i < 32; i++) {
      q[i] = (sub & 1) ? qs[i] >> 4 : qs[i] & 15;
      if (FIVE) q[i] |= (uint8_t)(((b[16 + i] >> sub) & 1) << 4);
    }
  }
  static void pack(const uint8_t* const blk[8], uint8_t* rec) {
    put_halves(blk, 0, rec);
    put_halves(blk, 2, rec + 16);
    for (int sub = 0; sub < 8; sub++) {
      uint8_t u[8][32];
      for (int i = 0; i < 8; i++) {
        int s, m;
        scale_min(blk[i] + 4, sub, s, m);
        rec[32 + 8 * sub + i] = (uint8_t)s;
        rec[96 + 8 * sub + i] = (uint8_t)m;
        quants(blk[i], sub, u[i]);
      }
      uint8_t* at = rec + HEAD + SUB * sub;
      if (FIVE) put_plane(u, 4, at);
      put_nibbles(u, at + (FIVE ? 32 : 0));
    }
  }
#ifdef SPECDEC_AVX2
  static __m256i quants(const uint8_t* b, int sub) {
    __m256i raw = _mm256_loadu_si256((const __m256i*)(b + QS + 32 * (sub / 2)));
    if (sub & 1) raw = _mm256_srli_epi16(raw, 4);
    __m256i q = _mm256_and_si256(raw, _mm256_set1_epi8(15));
    if (FIVE) {
      const __m256i hb = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)(b + 16)), _mm_cvtsi32_si128(sub));
      q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(1)), 4));
    }
    return q;
  }
  struct Head {
    __m256 d, neg_dmin;
    explicit Head(const uint8_t* rec)
        : d(load_halves(rec)), neg_dmin(_mm256_sub_ps(_mm256_setzero_ps(), load_halves(rec + 16))) {}
    __m256 scale(const uint8_t* rec, int sub) const { return _mm256_mul_ps(d, u8_to_ps(rec + 32 + 8 * sub)); }
    __m256 minimum(const uint8_t* rec, int sub) const { return _mm256_mul_ps(neg_dmin, u8_to_ps(rec + 96 + 8 * sub)); }
  };
  static void unpack(const uint8_t* rec, int sub, __m256i u[8]) {
    const uint8_t* at = rec + HEAD + SUB * sub;
    get_nibbles(at + (FIVE ? 32 : 0), u);
    if (FIVE) add_plane(at, 4, u);
  }
#endif
};
using Q4_K = QK_Min<false>;
using Q5_K = QK_Min<true>;

// {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d} over 256 weights, 6-bit q - 32 with a scale per 16.
// Half h (128 weights) uses ql[64 h ..], qh[32 h ..]; its sub-block k takes low nibbles (k < 2) or high
// nibbles of ql[64 h + 32 (k % 2) + i] and bits 2k, 2k + 1 of qh[32 h + i]; scales 8 h + 2 k (+1).
// Record: d[8], then per sub-block the 8 rows' two scales (first 16 weights, last 16), then per sub-block
// nibbles and the crumbs (bits 4 and 5) of q (0..63).
struct Q6_K {
  static constexpr int BLOCK = 256, BYTES = 210, HEAD = 16 + 128, SUB = 192, REC = HEAD + 8 * SUB;
  static constexpr bool SIGNED = true;
  static constexpr Kind KIND = K_HALVES;
  static constexpr int UMAX = 63, OFFSET = 32;
  static const int8_t* scale_pair(const uint8_t* b, int sub) {
    return (const int8_t*)(b + 192) + 8 * (sub / 4) + 2 * (sub % 4);
  }
  static void scales(const uint8_t* b, int sub, float sc[2], float& mn) {
    float d = half_to_float(read_u16(b + 208));
    const int8_t* s = scale_pair(b, sub);
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
  static void pack(const uint8_t* const blk[8], uint8_t* rec) {
    put_halves(blk, 208, rec);
    for (int sub = 0; sub < 8; sub++) {
      uint8_t u[8][32];
      for (int i = 0; i < 8; i++) {
        const int8_t* s = scale_pair(blk[i], sub);
        rec[16 + 16 * sub + i] = (uint8_t)s[0];
        rec[16 + 16 * sub + 8 + i] = (uint8_t)s[1];
        quants(blk[i], sub, u[i]);
        for (int w = 0; w < 32; w++) u[i][w] = (uint8_t)((int8_t)u[i][w] + 32);
      }
      uint8_t* at = rec + HEAD + SUB * sub;
      put_nibbles(u, at);
      put_crumbs(u, at + 128);
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
  struct Head {
    __m256 d;
    explicit Head(const uint8_t* rec) : d(load_halves(rec)) {}
    // the integer scales of the first and last 16 weights of sub-block `sub`, one lane per row
    __m256i scale_lo(const uint8_t* rec, int sub) const { return i8_to_epi32(rec + 16 + 16 * sub); }
    __m256i scale_hi(const uint8_t* rec, int sub) const { return i8_to_epi32(rec + 24 + 16 * sub); }
  };
  static void unpack(const uint8_t* rec, int sub, __m256i u[8]) {
    const uint8_t* at = rec + HEAD + SUB * sub;
    get_nibbles(at, u);
    add_crumbs(at + 128, u);
  }
#endif
};

// IQ4_XS {f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]} over 256 weights: sub-block s has the 6-bit scale
// ls = nibble s % 2 of scales_l[s / 2] | bits 2s, 2s + 1 of scales_h << 4, and w = d (ls - 32) level[index],
// the indices as IQ4_NL's in qs[16 s ..]. Record: d[8], (ls - 32)[sub][row], then per sub-block the indices.
struct IQ4_XS {
  static constexpr int BLOCK = 256, BYTES = 136, HEAD = 16 + 64, REC = HEAD + 8 * 128;
  static constexpr bool SIGNED = true;
  static constexpr Kind KIND = K_SIGNED;
  static int sub_scale(const uint8_t* b, int sub) {
    const int low = (b[4 + sub / 2] >> (4 * (sub % 2))) & 15, high = (read_u16(b + 2) >> (2 * sub)) & 3;
    return (low | (high << 4)) - 32;
  }
  static void scales(const uint8_t* b, int sub, float sc[2], float& mn) {
    sc[0] = sc[1] = half_to_float(read_u16(b)) * (float)sub_scale(b, sub);
    mn = 0.f;
  }
  static void quants(const uint8_t* b, int sub, uint8_t q[32]) { IQ4_NL::quants(b + 8 + 16 * sub - 2, 0, q); }
  static void pack(const uint8_t* const blk[8], uint8_t* rec) {
    put_halves(blk, 0, rec);
    for (int sub = 0; sub < 8; sub++) {
      uint8_t u[8][32];
      for (int i = 0; i < 8; i++) {
        rec[16 + 8 * sub + i] = (uint8_t)(int8_t)sub_scale(blk[i], sub);
        IQ4_NL::indices(blk[i] + 8 + 16 * sub, u[i]);
      }
      put_nibbles(u, rec + HEAD + 128 * sub);
    }
  }
#ifdef SPECDEC_AVX2
  static __m256i quants(const uint8_t* b, int sub) { return IQ4_NL::levels(b + 8 + 16 * sub); }
  struct Head {
    __m256 d;
    explicit Head(const uint8_t* rec) : d(load_halves(rec)) {}
    __m256 scale(const uint8_t* rec, int sub) const {
      return _mm256_mul_ps(d, _mm256_cvtepi32_ps(i8_to_epi32(rec + 16 + 8 * sub)));
    }
  };
  static void unpack(const uint8_t* rec, int sub, __m256i u[8]) { IQ4_NL::unpack(rec + HEAD + 128 * sub - 16, 0, u); }
#endif
};

// ---- float weights (F32, F16, BF16): each row as the file or checkpoint stores it, widened to float32 in registers --

struct F32W {
  using T = float;
  static float at(const T* w, int64_t k) { return w[k]; }
#ifdef SPECDEC_AVX2
  static __m256 load8(const T* w) { return _mm256_loadu_ps(w); }
#endif
};
struct F16W {
  using T = uint16_t;
  static float at(const T* w, int64_t k) { return half_to_float(w[k]); }
#ifdef SPECDEC_AVX2
  static __m256 load8(const T* w) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w)); }
#endif
};
struct BF16W {  // bfloat16 is the top half of a float32: widening is exact
  using T = uint16_t;
  static float at(const T* w, int64_t k) { uint32_t b = (uint32_t)w[k] << 16; float f; std::memcpy(&f, &b, 4); return f; }
#ifdef SPECDEC_AVX2
  static __m256 load8(const T* w) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)w)), 16));
  }
#endif
};

// MXFP4 {u8 e; u8 qs[16]} (gpt-oss's experts): weight i is MXFP4_LEVELS[nibble (i / 16) of byte i % 16] times
// 2^(e - 128), ggml's E8M0 half scale (the levels are the FP4 values doubled). The record's header is the 8 rows'
// exponent bytes as the file stores them (padded to 16), the indices as IQ4_NL's.
inline float e8m0_half(uint8_t e) {  // 2^(e - 128), subnormal for e < 2 (ggml's GGML_E8M0_TO_FP32_HALF)
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
struct MXFP4 {
  static constexpr int BLOCK = 32, BYTES = 17, REC = 16 + 128;
  static constexpr bool SIGNED = true;
  static constexpr Kind KIND = K_SIGNED;
  static void scales(const uint8_t* b, int, float sc[2], float& mn) {
    sc[0] = sc[1] = e8m0_half(b[0]);
    mn = 0.f;
  }
  static void quants(const uint8_t* b, int, uint8_t q[32]) {
    IQ4_NL::indices(b + 1, q);
    for (int i = 0; i < 32; i++) q[i] = (uint8_t)MXFP4_LEVELS[q[i]];
  }
  static void pack(const uint8_t* const blk[8], uint8_t* rec) {
    uint8_t u[8][32];
    std::memset(rec, 0, 16);
    for (int i = 0; i < 8; i++) {
      rec[i] = blk[i][0];
      IQ4_NL::indices(blk[i] + 1, u[i]);
    }
    put_nibbles(u, rec + 16);
  }
#ifdef SPECDEC_AVX2
  static __m256i quants(const uint8_t* b, int) {
    __m128i raw = _mm_loadu_si128((const __m128i*)(b + 1)), low = _mm_set1_epi8(15);
    __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
    return _mm256_shuffle_epi8(iq4_table(false, MXFP4_LEVELS), idx);
  }
  struct Head {
    __m256 d;
    explicit Head(const uint8_t* rec) {  // e8m0_half of the 8 rows' exponents, in registers
      const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)rec));
      const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
      const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
      d = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
    }
    __m256 scale(const uint8_t*, int) const { return d; }
  };
  static void unpack(const uint8_t* rec, int, __m256i u[8]) {
#ifdef SPECDEC_VNNI
    const __m256i table = iq4_table(true, MXFP4_LEVELS);
#else
    const __m256i table = iq4_table(false, MXFP4_LEVELS);
#endif
    get_nibbles(rec + 16, u);
    for (int e = 0; e < 8; e++) u[e] = _mm256_shuffle_epi8(table, u[e]);
  }
#endif
};

// The formats by id (quant.py's BlockFormat.kernel_id; the float ones: FLOAT_FORMATS there).
enum FormatId { F_Q8_0 = 0, F_Q4_0 = 1, F_Q4_1 = 2, F_Q4_K = 3, F_Q6_K = 4, F_Q5_0 = 5, F_Q5_1 = 6, F_Q5_K = 7,
                F_IQ4_NL = 8, F_IQ4_XS = 9, F_F32 = 10, F_F16 = 11, F_BF16 = 12, F_MXFP4 = 13 };

inline bool is_float_format(int64_t fmt) { return fmt >= F_F32 && fmt <= F_BF16; }

template <class Fn>
auto with_float(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case F_F32: return fn(F32W{});
    case F_F16: return fn(F16W{});
    case F_BF16: return fn(BF16W{});
  }
  TORCH_CHECK(false, "unknown float format id ", fmt);
}

template <class Fn>
auto with_format(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case F_Q8_0: return fn(Q8_0{});
    case F_Q4_0: return fn(Q4_0{});
    case F_Q4_1: return fn(Q4_1{});
    case F_Q4_K: return fn(Q4_K{});
    case F_Q6_K: return fn(Q6_K{});
    case F_Q5_0: return fn(Q5_0{});
    case F_Q5_1: return fn(Q5_1{});
    case F_Q5_K: return fn(Q5_K{});
    case F_IQ4_NL: return fn(IQ4_NL{});
    case F_IQ4_XS: return fn(IQ4_XS{});
    case F_MXFP4: return fn(MXFP4{});
  }
  TORCH_CHECK(false, "unknown block format id ", fmt);
}

}  // namespace
