// Paged attention of a step's queries over the keys each may see, computed in chunks of the query's own list.
//
//   visible list of a query:  the context slots its mask row lets it see, in slot order (a causal row: a prefix of
//                             its sequence's context row; a tree row: the cached prefix, then its ancestors)
//   chunk c:                  entries 32c .. 32c + 31 of that list
//   partial of a chunk:       m = max score, l = sum exp(s - m), o = sum exp(s - m) v            (one query head)
//   fold, in chunk order:     M' = max(M, m),  O' = O e^(M - M') + o e^(m - M'),  L' likewise;   out = O / L
//
// Chunks are fixed by the list, never by the batch or the thread split, so a query gets the same bits alone, with
// draft rows after it, or beside other sequences. Two schedules run the same arithmetic: a sequence with few
// queries (decode, verification) splits its list across threads by runs of chunks (partials kept, folded after);
// one with many queries (prefill) splits by blocks of queries, each folding as it goes. A chunk's K/V rows (every
// KV head: contiguous in the pool) are widened to float once and shared by every query whose list runs through them.
#pragma once
#include "simd.h"

namespace {

constexpr int64_t KCHUNK = 32;  // keys per chunk of a visible list
constexpr int64_t FEW_QUERIES = 16;  // a sequence with at most this many queries is split by chunk
constexpr int64_t QBLOCK = 16;  // queries per work unit of a sequence split by query block

// Every query's visible list, built once per forward from the mask (all layers share it).
struct Visible {
  std::vector<const int64_t*> list;  // [T] the query's visible slots
  std::vector<int64_t> len;  // [T] how many
  std::vector<int64_t> shared;  // [T] leading entries that are its sequence's context row itself
  std::vector<int64_t> seq;  // [T] its sequence
  std::vector<int64_t> row_len;  // [B] entries of each context row read as a shared prefix
  std::vector<std::vector<int64_t>> own;  // the lists of tree rows, which skip keys
  const int64_t* starts = nullptr;  // [B + 1] first query of each sequence
  int64_t B = 0, T = 0;
};

Visible visible_lists(const int64_t* context_slots, int64_t Lk, const bool* mask, int64_t S, const int64_t* starts,
                      int64_t B) {
  Visible v;
  v.B = B; v.T = starts[B]; v.starts = starts;
  v.list.resize(v.T); v.len.resize(v.T); v.shared.resize(v.T); v.seq.resize(v.T); v.row_len.assign(B, 0);
  for (int64_t b = 0; b < B; b++) {
    const int64_t* row = context_slots + b * Lk;
    for (int64_t t = starts[b]; t < starts[b + 1]; t++) {
      const bool* m = mask + (b * S + (t - starts[b])) * Lk;
      int64_t e = 0;
      while (e < Lk && m[e]) e++;
      int64_t rest = 0;
      for (int64_t j = e; j < Lk; j++) rest += m[j];
      v.seq[t] = b;
      v.shared[t] = e;
      v.row_len[b] = std::max(v.row_len[b], e);
      if (rest == 0) {  // causal: a prefix of the context row
        v.list[t] = row;
        v.len[t] = e;
      } else {
        std::vector<int64_t> own(row, row + e);
        for (int64_t j = e; j < Lk; j++)
          if (m[j]) own.push_back(row[j]);
        v.own.push_back(std::move(own));
      }
    }
  }
  size_t k = 0;  // pointers into `own` once it stops growing
  for (int64_t t = 0; t < v.T; t++)
    if (v.list[t] == nullptr) { v.list[t] = v.own[k].data(); v.len[t] = (int64_t)v.own[k++].size(); }
  return v;
}

// The partial of one query head over m (1..32) keys: rows of kc, vc (D floats each, `ld` apart; rows >= m are
// never used). Writes o[D] (unnormalized) and returns {max score, sum of exps}.
inline std::pair<float, float> chunk_partial(const float* q, const float* kc, const float* vc, int64_t m, int64_t D,
                                             int64_t ld, float scale, float* o) {
  alignas(32) float p[KCHUNK];
  float top = -INFINITY, total = 0.f;
#ifdef SPECDEC_AVX2
  if (D % 8 == 0) {
    const int64_t groups = (m + 7) / 8;
    const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 s[KCHUNK / 8], mx = ninf;
    for (int64_t g = 0; g < groups; g++) {
      __m256 a[8];
      for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kc + (8 * g + i) * ld + d), a[i]);
      }
      // transpose-and-add: lane i = key 8g + i
      __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      __m256 v = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
      const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(m - 8 * g)), _CMP_LT_OQ);
      s[g] = _mm256_blendv_ps(ninf, _mm256_mul_ps(v, sc), valid);
      mx = _mm256_max_ps(mx, s[g]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 tv = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
      const __m256 valid = _mm256_cmp_ps(s[g], ninf, _CMP_NEQ_OQ);
      const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(s[g], tv)), valid);  // masked lanes: exactly 0
      _mm256_store_ps(p + 8 * g, e);
      sum = _mm256_add_ps(sum, e);
    }
    total = hsum(sum);
    for (int64_t d0 = 0; d0 < D; d0 += 32) {  // up to 4 accumulators in registers across the keys
      const int64_t w = std::min<int64_t>(32, D - d0) / 8;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t k = 0; k < m; k++) {
        const __m256 pk = _mm256_set1_ps(p[k]);
        const float* vr = vc + k * ld + d0;
        for (int i = 0; i < w; i++) acc[i] = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vr + 8 * i), acc[i]);
      }
      for (int i = 0; i < w; i++) _mm256_storeu_ps(o + d0 + 8 * i, acc[i]);
    }
    return {top, total};
  }
#endif
  for (int64_t k = 0; k < m; k++) { p[k] = dot_f32(q, kc + k * ld, D) * scale; top = std::max(top, p[k]); }
  for (int64_t k = 0; k < m; k++) { p[k] = std::exp(p[k] - top); total += p[k]; }
  for (int64_t d = 0; d < D; d++) {
    float a = 0.f;
    for (int64_t k = 0; k < m; k++) a += p[k] * vc[k * ld + d];
    o[d] = a;
  }
  return {top, total};
}

// Running state of one query head: {M, L} and O[D].
inline void fold(float* st, float* O, float m, float l, const float* o, int64_t D, bool first) {
  if (first) {
    st[0] = m; st[1] = l;
    std::memcpy(O, o, D * sizeof(float));
    return;
  }
  const float M = std::max(st[0], m), a = std::exp(st[0] - M), b = std::exp(m - M);
  st[0] = M;
  st[1] = st[1] * a + l * b;
  for (int64_t d = 0; d < D; d++) O[d] = O[d] * a + o[d] * b;
}

inline void finish(const float* st, const float* O, int64_t D, float* out) {
  const float inv = 1.f / st[1];
  for (int64_t d = 0; d < D; d++) out[d] = O[d] * inv;
}

// Chunk c's K and V rows, every KV head (a slot's heads are contiguous: Hkv * D values), widened into kc, vc
// [32, Hkv * D]: the shared context row's entries, or the query's own list.
template <class KV>
inline int64_t load_chunk(const KV* kp, const KV* vp, const int64_t* list, int64_t len, int64_t c, int64_t HD,
                          float* kc, float* vc) {
  const int64_t first = c * KCHUNK, m = std::min(KCHUNK, len - first);
  for (int64_t k = 0; k < m; k++) {
    widen(kp + list[first + k] * HD, kc + k * HD, HD);
    widen(vp + list[first + k] * HD, vc + k * HD, HD);
  }
  return m;
}

// A query reads chunk c from the shared buffer when every entry it needs there is its sequence's context row.
inline bool reads_shared(const Visible& vis, int64_t t, int64_t c) {
  return vis.shared[t] >= std::min(vis.len[t], (c + 1) * KCHUNK);
}

// How a step's attention is shared out (the same for every layer of a forward): work units {sequence, queries
// t0..t1, chunks c0..c1, keep partials}. A sequence with few queries is split into runs of chunks (about 4 per
// thread over the whole step) whose partials are kept and folded after; a sequence with many queries into blocks of
// queries that go over all their chunks, folding as they go.
struct AttentionPlan {
  struct Unit { int64_t b, t0, t1, c0, c1; bool keep; };
  std::vector<Unit> units;
  std::vector<int64_t> part_base;  // [T + 1] kept partials of query t: [Hq][chunks(t)][D + 2] from part_base[t]
  std::vector<float> parts;  // the kept partials (every one is written before it is read: never cleared)
  std::vector<int64_t> nchunks;  // [T] chunks of each query's list
};

void plan_attention(const Visible& vis, int64_t Hq, int64_t D, int64_t nthreads, AttentionPlan& plan) {
  const int64_t B = vis.B;
  auto& units = plan.units;
  units.clear();
  plan.nchunks.resize(vis.T);
  for (int64_t t = 0; t < vis.T; t++) plan.nchunks[t] = (vis.len[t] + KCHUNK - 1) / KCHUNK;
  plan.part_base.assign(vis.T + 1, 0);
  int64_t few_chunks = 0;
  for (int64_t b = 0; b < B; b++)
    if (vis.starts[b + 1] - vis.starts[b] <= FEW_QUERIES)
      for (int64_t t = vis.starts[b]; t < vis.starts[b + 1]; t++) few_chunks = std::max(few_chunks, plan.nchunks[t]);
  const int64_t run = std::max<int64_t>(1, few_chunks * B / (4 * nthreads));
  for (int64_t b = 0; b < B; b++) {
    const int64_t t0 = vis.starts[b], t1 = vis.starts[b + 1];
    int64_t nc = 0;
    for (int64_t t = t0; t < t1; t++) nc = std::max(nc, plan.nchunks[t]);
    if (t1 - t0 <= FEW_QUERIES) {
      for (int64_t c = 0; c < nc; c += run) units.push_back({b, t0, t1, c, std::min(c + run, nc), true});
      for (int64_t t = t0; t < t1; t++) plan.part_base[t + 1] = plan.nchunks[t] * Hq * (D + 2);
    } else {
      for (int64_t q = t0; q < t1; q += QBLOCK) units.push_back({b, q, std::min(q + QBLOCK, t1), 0, nc, false});
    }
  }
  for (int64_t t = 0; t < vis.T; t++) plan.part_base[t + 1] += plan.part_base[t];
  grow(plan.parts, plan.part_base[vis.T]);
}

// out [T, Hq, D] = attention of every query head (q in qkv rows [T, W], head h at h * D) over the pools [slots, Hkv,
// D], by every thread of the enclosing OpenMP team (each calls it; its worksharing loops end in barriers).
template <class KV>
void attention_team(const AttentionPlan& plan, const float* qkv, int64_t W, int64_t Hq, int64_t Hkv, int64_t D,
                    const KV* kp, const KV* vp, const int64_t* context_slots, int64_t Lk, const Visible& vis,
                    float scale, float* out) {
  const int64_t G = Hq / Hkv, HD = Hkv * D, nunits = (int64_t)plan.units.size();
  const int64_t* chunks = plan.nchunks.data();
  const int64_t* part_base = plan.part_base.data();
  float* parts = const_cast<float*>(plan.parts.data());  // each partial written by the one unit that owns it
  static thread_local std::vector<float> buf, state;  // per worker thread, kept across calls
  if ((int64_t)buf.size() < 4 * KCHUNK * HD + D) buf.assign(4 * KCHUNK * HD + D, 0.f);
  float *kc = buf.data(), *vc = kc + KCHUNK * HD, *kown = vc + KCHUNK * HD, *vown = kown + KCHUNK * HD;
  float* o = vown + KCHUNK * HD;
#pragma omp for schedule(dynamic, 1)
  for (int64_t i = 0; i < nunits; i++) {
    const AttentionPlan::Unit& u = plan.units[i];
    const int64_t* row = context_slots + u.b * Lk;
    if (!u.keep && (int64_t)state.size() < (u.t1 - u.t0) * Hq * (D + 2)) state.resize((u.t1 - u.t0) * Hq * (D + 2));
    for (int64_t c = u.c0; c < u.c1; c++) {
      bool loaded = false;  // the shared buffer holds this chunk of the context row
      for (int64_t t = u.t0; t < u.t1; t++) {
        if (c * KCHUNK >= vis.len[t]) continue;
        const float *k = kc, *v = vc;
        int64_t m;
        if (reads_shared(vis, t, c)) {
          if (!loaded) load_chunk(kp, vp, row, vis.row_len[u.b], c, HD, kc, vc);
          loaded = true;
          m = std::min(KCHUNK, vis.len[t] - c * KCHUNK);
        } else {
          m = load_chunk(kp, vp, vis.list[t], vis.len[t], c, HD, kown, vown);
          k = kown; v = vown;
        }
        for (int64_t h = 0; h < Hq; h++) {
          const int64_t hk = h / G;
          const float* q = qkv + t * W + h * D;
          if (u.keep) {
            float* pt = parts + part_base[t] + (h * chunks[t] + c) * (D + 2);
            auto [mx, l] = chunk_partial(q, k + hk * D, v + hk * D, m, D, HD, scale, pt + 2);
            pt[0] = mx; pt[1] = l;
          } else {
            float* st = state.data() + ((t - u.t0) * Hq + h) * (D + 2);
            auto [mx, l] = chunk_partial(q, k + hk * D, v + hk * D, m, D, HD, scale, o);
            fold(st, st + 2, mx, l, o, D, c == 0);
          }
        }
      }
    }
    if (!u.keep)
      for (int64_t t = u.t0; t < u.t1; t++)
        for (int64_t h = 0; h < Hq; h++) {
          const float* st = state.data() + ((t - u.t0) * Hq + h) * (D + 2);
          finish(st, st + 2, D, out + (t * Hq + h) * D);
        }
  }
  // fold the kept partials, one query head each
  float* st = kown;  // 2 + D floats of scratch
#pragma omp for schedule(static)
  for (int64_t i = 0; i < vis.T * Hq; i++) {
    const int64_t t = i / Hq, h = i % Hq;
    if (part_base[t + 1] == part_base[t]) continue;  // done by a query block
    for (int64_t c = 0; c < chunks[t]; c++) {
      const float* pt = parts + part_base[t] + (h * chunks[t] + c) * (D + 2);
      fold(st, st + 2, pt[0], pt[1], pt + 2, D, c == 0);
    }
    finish(st, st + 2, D, out + (t * Hq + h) * D);
  }
}

// attention_team in a team of its own (a layer called alone).
template <class KV>
void attention(const float* qkv, int64_t W, int64_t Hq, int64_t Hkv, int64_t D, const KV* kp, const KV* vp,
               const int64_t* context_slots, int64_t Lk, const Visible& vis, float scale, float* out) {
  static thread_local AttentionPlan own;
  AttentionPlan& plan = own;  // the calling thread's, shared with the team (inside, `own` names each member's)
  const int64_t nthreads = at::get_num_threads();
  plan_attention(vis, Hq, D, nthreads, plan);
#pragma omp parallel num_threads(nthreads)
  attention_team(plan, qkv, W, Hq, Hkv, D, kp, vp, context_slots, Lk, vis, scale, out);
}

}  // namespace
