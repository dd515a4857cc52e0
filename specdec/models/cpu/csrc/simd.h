// What every kernel file shares: the instruction set chosen at build time (`-march=native`, or the flags of
// native.py's ISAS; SPECDEC_ISA_NAME names the path taken, as ISAS does), f16 conversions, and the few vector helpers
// whose fixed operation order the batch invariance relies on.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

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
// 512-bit registers too: two groups of 8 weight rows per vector (gemm.h's x16 tiles), 32 registers for tiles of
// up to 8 activation rows. Each lane still runs the 256-bit path's operations, so the bits are the same.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define SPECDEC_AVX512 1
#define SPECDEC_ISA_NAME "avx512"
#else
#define SPECDEC_ISA_NAME "avx512vnni"
#endif
#elif defined(__AVXVNNI__)
#define SPECDEC_VNNI 1
#define SPECDEC_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define SPECDEC_ISA_NAME "avxvnni"
#else
#define SPECDEC_ISA_NAME "avx2"
#endif
#else
#define SPECDEC_ISA_NAME "portable"  // the scalar code everywhere
#endif

// How the interleaved weights are prefetched, chosen per CPU vendor by native.py (-DSPECDEC_STREAM_NTA on AMD).
#ifdef SPECDEC_AVX2
#ifdef SPECDEC_STREAM_NTA
#define SPECDEC_STREAM_HINT _MM_HINT_NTA
#else
#define SPECDEC_STREAM_HINT _MM_HINT_T0
#endif
#endif

namespace {

// v's storage, grown to at least n elements (kept across calls; contents unspecified).
template <class T>
inline T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// IEEE half <-> float, rounding to nearest even (F16C where the CPU has it; c10's portable conversion otherwise:
// the same values).
inline float half_to_float(uint16_t h) {
#ifdef SPECDEC_AVX2
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

inline uint16_t float_to_half(float f) {
#ifdef SPECDEC_AVX2
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  return c10::detail::fp16_ieee_from_fp32_value(f);
#endif
}

// A row of n values (a K/V cache row: float32, or f16 bits) widened to float, and back.
inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void narrow(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void widen(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef SPECDEC_AVX2
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
  for (; i < n; i++) dst[i] = half_to_float(src[i]);
}

inline void narrow(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#ifdef SPECDEC_AVX2
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; i++) dst[i] = float_to_half(src[i]);
}

#ifdef SPECDEC_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 88 in 8 lanes: 2^n e^r with |r| <= ln 2 / 2, e^r by the Cephes polynomial (~1e-7 relative);
// below -87 it returns e^-87, not 0 (callers zero masked lanes themselves).
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
#endif

// Fixed-order float dot product (8 lanes, then a fixed horizontal sum) over n floats.
inline float dot_f32(const float* a, const float* b, int64_t n) {
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

}  // namespace
