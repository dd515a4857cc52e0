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
// one with many queries (prefill) splits by blocks of queries, each folding as it goes. The units are shared out
// evenly in order, so a thread knows its own before the layer starts and reads their K/V rows in ahead
// (touch_share). With AVX2 the kernel reads the pools itself (chunk_group: each K/V row widened once in registers
// for the query heads that share it); the portable build widens a chunk's rows into a buffer (chunk_partial).
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

// window > 0: a sliding-window layer's lists, each query's last `window` visible keys (a key is visible to a query at
// position p when its position is > p - window; a query sees its whole prefix and, in a tree, one ancestor per
// position, so its visible keys in slot order are at consecutive positions ending at p). Such a trimmed list no
// longer starts with its context row (shared 0: it is read as a list of its own).
Visible visible_lists(const int64_t* context_slots, int64_t Lk, const bool* mask, int64_t S, const int64_t* starts,
                      int64_t B, int64_t window = 0) {
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
      if (window <= 0 || e <= window) v.row_len[b] = std::max(v.row_len[b], e);
      if (rest == 0 && (window <= 0 || e <= window)) {  // causal: a prefix of the context row
        v.list[t] = row;
        v.len[t] = e;
      } else if (rest == 0) {  // causal in a window: the prefix's last `window` slots
        v.list[t] = row + (e - window);
        v.len[t] = window;
        v.shared[t] = 0;
      } else {
        std::vector<int64_t> own(row, row + e);
        for (int64_t j = e; j < Lk; j++)
          if (m[j]) own.push_back(row[j]);
        if (window > 0 && (int64_t)own.size() > window) {
          own.erase(own.begin(), own.end() - window);
          v.shared[t] = 0;
        }
        v.own.push_back(std::move(own));
      }
    }
  }
  size_t k = 0;  // pointers into `own` once it stops growing
  for (int64_t t = 0; t < v.T; t++)
    if (v.list[t] == nullptr) { v.list[t] = v.own[k].data(); v.len[t] = (int64_t)v.own[k++].size(); }
  return v;
}

// Gemma 2's attention soft-cap: each scaled score s becomes cap * tanh(s / cap) (cap 0: none), element by element.
inline void cap_scores(float* s, int64_t m, float cap) {
  if (cap <= 0.f) return;
  for (int64_t k = 0; k < m; k++) s[k] = cap * std::tanh(s[k] / cap);
}

// The partial of one query head over m (1..32) keys: rows of kc, vc (D floats each, `ld` apart; rows >= m are
// never used). Writes o[D] (unnormalized) and returns {max score, sum of exps}. The portable build's path, and a
// vector build's for head sizes that are no multiple of 8 (the others run chunk_group).
inline std::pair<float, float> chunk_partial(const float* q, const float* kc, const float* vc, int64_t m, int64_t D,
                                             int64_t ld, float scale, float softcap, float* o) {
  alignas(32) float p[KCHUNK];
  float top = -INFINITY, total = 0.f;
  for (int64_t k = 0; k < m; k++) p[k] = dot_f32(q, kc + k * ld, D) * scale;
  cap_scores(p, m, softcap);
  for (int64_t k = 0; k < m; k++) top = std::max(top, p[k]);
  for (int64_t k = 0; k < m; k++) { p[k] = std::exp(p[k] - top); total += p[k]; }
  for (int64_t d = 0; d < D; d++) {
    float a = 0.f;
    for (int64_t k = 0; k < m; k++) a += p[k] * vc[k * ld + d];
    o[d] = a;
  }
  return {top, total};
}

#ifdef SPECDEC_AVX2
// Chunk partials read straight from the pools (f16 or float32; key k at kh + slots[k] * ld, value at vh + slots[k]
// * ld) for every query head that reads one KV head over the same keys: its group's heads, and those of the other
// queries of a step whose chunk is the same 32 keys of the context row (a verification's rows, a prefill block).
// Each key and value row is widened once, in registers, for all the heads of a tile. Every number of a head comes
// from its own 8-lane accumulators in one fixed order (keys in order, one reduction tree), whatever the tile or
// the company: the same bits for a query alone, among a batch or in a verification step, and in every vector
// build (the tiles differ with the register count: 16 under AVX2, 32 under AVX-512).
template <class KV>
inline __m256 load8(const KV* p) {
  if constexpr (std::is_same_v<KV, float>) return _mm256_loadu_ps(p);
  else return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

// Lanes 0..3: the sums of a0..a3, each ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of its own lanes.
inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#ifdef SPECDEC_AVX512
constexpr int QK_HEADS = 4, PV_LANES = 24;  // accumulators per tile: 4 heads x 4 keys; 24 vectors of o
#else
constexpr int QK_HEADS = 2, PV_LANES = 8;
#endif

// Scores (scaled) of NH heads (queries q[h]) against 4 keys at a time into sc[h][k] (past m: key 0's row again,
// masked later).
template <class KV, int NH>
inline void score_tile(const float* const* q, int64_t D, const KV* kh, const int64_t* slots, int64_t m, int64_t ld,
                       float scale, float (*sc)[KCHUNK]) {
  for (int64_t k0 = 0; k0 < m; k0 += 4) {
    const KV* kr[4];
    for (int i = 0; i < 4; i++) kr[i] = kh + slots[k0 + i < m ? k0 + i : k0] * ld;
    __m256 acc[NH][4];
    for (int h = 0; h < NH; h++)
      for (int i = 0; i < 4; i++) acc[h][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 kv[4];
      for (int i = 0; i < 4; i++) kv[i] = load8(kr[i] + d);
      for (int h = 0; h < NH; h++) {
        const __m256 qv = _mm256_loadu_ps(q[h] + d);
        for (int i = 0; i < 4; i++) acc[h][i] = _mm256_fmadd_ps(qv, kv[i], acc[h][i]);
      }
    }
    for (int h = 0; h < NH; h++)
      _mm_storeu_ps(sc[h] + k0, _mm_mul_ps(sum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]), _mm_set1_ps(scale)));
  }
}

// res[h][2 + d0 .. 2 + d0 + 8 DB) = the sum over keys in order of p[h][k] v[k], for NH heads.
template <class KV, int NH, int DB>
inline void value_tile(const float (*p)[KCHUNK], const KV* vh, const int64_t* slots, int64_t m, int64_t ld, int64_t d0,
                       float* const* res) {
  __m256 acc[NH][DB];
  for (int h = 0; h < NH; h++)
    for (int j = 0; j < DB; j++) acc[h][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < m; k++) {
    const KV* vr = vh + slots[k] * ld + d0;
    for (int j = 0; j < DB; j++) {
      const __m256 v = load8(vr + 8 * j);
      for (int h = 0; h < NH; h++) acc[h][j] = _mm256_fmadd_ps(_mm256_set1_ps(p[h][k]), v, acc[h][j]);
    }
  }
  for (int h = 0; h < NH; h++)
    for (int j = 0; j < DB; j++) _mm256_storeu_ps(res[h] + 2 + d0 + 8 * j, acc[h][j]);
}

template <class KV, int DB>
inline void value_rows(const float (*p)[KCHUNK], int64_t nh, int64_t D, const KV* vh, const int64_t* slots, int64_t m,
                       int64_t ld, float* const* res) {
  constexpr int NH = PV_LANES / DB > 0 ? PV_LANES / DB : 1;
  for (int64_t d0 = 0; d0 < D; d0 += 8 * DB) {
    int64_t h = 0;
    for (; h + NH <= nh; h += NH) value_tile<KV, NH, DB>(p + h, vh, slots, m, ld, d0, res + h);
    for (; h < nh; h++) value_tile<KV, 1, DB>(p + h, vh, slots, m, ld, d0, res + h);
  }
}

constexpr int64_t GROUP_HEADS = 8;  // query heads per pass (their scores stay on the stack)

// The partials of nh query heads (q[h], each D floats) that read one KV head's rows over the same m keys; head h's
// result at res[h]: {max score, sum of exps, o[D] unnormalized}.
template <class KV>
inline void chunk_group(const float* const* q, int64_t nh, int64_t D, const KV* kh, const KV* vh,
                        const int64_t* slots, int64_t m, int64_t ld, float scale, float softcap, float* const* res) {
  alignas(32) float sc[GROUP_HEADS][KCHUNK];
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), ninf = _mm256_set1_ps(-INFINITY);
  const int64_t groups = (m + 7) / 8;
  for (int64_t h0 = 0; h0 < nh; h0 += GROUP_HEADS, q += GROUP_HEADS, res += GROUP_HEADS) {
    const int64_t n = std::min(GROUP_HEADS, nh - h0);
    int64_t h = 0;
    for (; h + QK_HEADS <= n; h += QK_HEADS) score_tile<KV, QK_HEADS>(q + h, D, kh, slots, m, ld, scale, sc + h);
    for (; h < n; h++) score_tile<KV, 1>(q + h, D, kh, slots, m, ld, scale, sc + h);
    for (h = 0; h < n; h++) cap_scores(sc[h], m, softcap);
    for (h = 0; h < n; h++) {  // max, exps (masked lanes exactly 0), their sum
      __m256 mx = ninf;
      for (int64_t g = 0; g < groups; g++) {
        const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(m - 8 * g)), _CMP_LT_OQ);
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_load_ps(sc[h] + 8 * g), valid));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const __m256 tv = _mm256_set1_ps(top);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; g++) {
        const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(m - 8 * g)), _CMP_LT_OQ);
        const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_load_ps(sc[h] + 8 * g), tv)), valid);
        _mm256_store_ps(sc[h] + 8 * g, e);
        sum = _mm256_add_ps(sum, e);
      }
      res[h][0] = top;
      res[h][1] = hsum(sum);
    }
    if (D % 64 == 0) value_rows<KV, 8>(sc, n, D, vh, slots, m, ld, res);
    else if (D % 32 == 0) value_rows<KV, 4>(sc, n, D, vh, slots, m, ld, res);
    else if (D % 16 == 0) value_rows<KV, 2>(sc, n, D, vh, slots, m, ld, res);
    else value_rows<KV, 1>(sc, n, D, vh, slots, m, ld, res);
  }
}
#endif

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

// out = O / L, or with an attention sink (gpt-oss: a learned logit per head that takes its share of the softmax and
// contributes no value) O / (L + exp(sink - M)).
inline void finish(const float* st, const float* O, int64_t D, float* out, const float* sink = nullptr) {
  const float inv = 1.f / (st[1] + (sink ? std::exp(*sink - st[0]) : 0.f));
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

// This team member's units: every nt-th from its own index on (a fixed share, so touch_share knows it before the
// attention; interleaved, so a prefill's later query blocks, which see more keys, spread over the team).
inline std::pair<int64_t, int64_t> unit_share() { return {omp_get_thread_num(), omp_get_num_threads()}; }

// Read into this member's caches the key and value rows its units will use (at most `budget` bytes), before the
// layer's first product. Rows written a step ago come from memory; read by the attention itself they arrive one
// dependent wait at a time (the kernel computes between them), read here together they stream at the bus's speed.
// Plain loads, not prefetch instructions: the CPU may drop those (measured on Zen 4: no effect), and it never drops
// a load. Returns a value that depends on every load, so the compiler keeps them.
template <class KV>
int touch_share(const AttentionPlan& plan, const Visible& vis, const KV* kp, const KV* vp, int64_t HD,
                int64_t budget) {
  const auto [first, stride] = unit_share();
  const int64_t row = HD * (int64_t)sizeof(KV);
  int sum = 0;
  for (int64_t i = first; i < (int64_t)plan.units.size() && budget > 0; i += stride) {
    const AttentionPlan::Unit& u = plan.units[i];
    int64_t len = 0;
    const int64_t* list = nullptr;
    for (int64_t t = u.t0; t < u.t1; t++)
      if (vis.len[t] > len) { len = vis.len[t]; list = vis.list[t]; }
    for (int64_t k = u.c0 * KCHUNK; k < std::min(len, u.c1 * KCHUNK) && budget > 0; k++, budget -= 2 * row) {
      const char *kr = (const char*)(kp + list[k] * HD), *vr = (const char*)(vp + list[k] * HD);
      for (int64_t o = 0; o < row; o += 64) sum += kr[o] + vr[o];
    }
  }
  return sum;
}

// out [T, Hq, D] = attention of every query head (q in qkv rows [T, W], head h at h * D) over the pools [slots, Hkv,
// D], by every thread of the enclosing OpenMP team (each calls it; its worksharing loops end in barriers).
template <class KV>
void attention_team(const AttentionPlan& plan, const float* qkv, int64_t W, int64_t Hq, int64_t Hkv, int64_t D,
                    const KV* kp, const KV* vp, const int64_t* context_slots, int64_t Lk, const Visible& vis,
                    float scale, float softcap, float* out, const float* sinks = nullptr) {
  const int64_t G = Hq / Hkv, HD = Hkv * D, nunits = (int64_t)plan.units.size();
  const int64_t* chunks = plan.nchunks.data();
  const int64_t* part_base = plan.part_base.data();
  float* parts = const_cast<float*>(plan.parts.data());  // each partial written by the one unit that owns it
  static thread_local std::vector<float> buf, state;  // per worker thread, kept across calls
  if ((int64_t)buf.size() < 4 * KCHUNK * HD + D) buf.assign(4 * KCHUNK * HD + D, 0.f);
#ifdef SPECDEC_AVX2
  const bool direct = D % 8 == 0;  // chunk_group reads the pools itself
#endif
  float *kc = buf.data(), *vc = kc + KCHUNK * HD, *kown = vc + KCHUNK * HD, *vown = kown + KCHUNK * HD;
  float* o = vown + KCHUNK * HD;
#ifdef SPECDEC_AVX2
  // Chunk c of n queries ts[] over the same m keys: for each KV head, every query head of theirs that reads it in
  // one chunk_group (each K/V row widened once for all of them); partials kept, or folded into the unit's state.
  static thread_local std::vector<int64_t> together;
  static thread_local std::vector<const float*> qs;
  static thread_local std::vector<float*> rs;
  static thread_local std::vector<float> scratch;
  auto chunk_queries = [&](const int64_t* ts, int64_t n, const int64_t* slots, int64_t m,
                           const AttentionPlan::Unit& u, int64_t c) {
    qs.resize(n * G);
    rs.resize(n * G);
    if (!u.keep) grow(scratch, n * G * (D + 2));
    for (int64_t hk = 0; hk < Hkv; hk++) {
      for (int64_t i = 0; i < n; i++)
        for (int64_t g = 0; g < G; g++) {
          const int64_t t = ts[i], h = hk * G + g;
          qs[i * G + g] = qkv + t * W + h * D;
          rs[i * G + g] = u.keep ? parts + part_base[t] + (h * chunks[t] + c) * (D + 2)
                                 : scratch.data() + (i * G + g) * (D + 2);
        }
      chunk_group(qs.data(), n * G, D, kp + hk * D, vp + hk * D, slots, m, HD, scale, softcap, rs.data());
      if (!u.keep)
        for (int64_t i = 0; i < n; i++)
          for (int64_t g = 0; g < G; g++) {
            float* st = state.data() + ((ts[i] - u.t0) * Hq + hk * G + g) * (D + 2);
            const float* r = rs[i * G + g];
            fold(st, st + 2, r[0], r[1], r + 2, D, c == 0);
          }
    }
  };
#endif
  const auto [first, stride] = unit_share();
  for (int64_t i = first; i < nunits; i += stride) {
    const AttentionPlan::Unit& u = plan.units[i];
    const int64_t* row = context_slots + u.b * Lk;
    if (!u.keep && (int64_t)state.size() < (u.t1 - u.t0) * Hq * (D + 2)) state.resize((u.t1 - u.t0) * Hq * (D + 2));
    for (int64_t c = u.c0; c < u.c1; c++) {
#ifdef SPECDEC_AVX2
      if (direct) {  // the queries whose chunk c is 32 keys of the context row together, the others alone
        together.clear();
        for (int64_t t = u.t0; t < u.t1; t++) {
          if (c * KCHUNK >= vis.len[t]) continue;
          if (reads_shared(vis, t, c) && vis.len[t] >= (c + 1) * KCHUNK) together.push_back(t);
          else chunk_queries(&t, 1, vis.list[t] + c * KCHUNK, std::min(KCHUNK, vis.len[t] - c * KCHUNK), u, c);
        }
        if (!together.empty())
          chunk_queries(together.data(), (int64_t)together.size(), row + c * KCHUNK, KCHUNK, u, c);
        continue;
      }
#endif
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
            auto [mx, l] = chunk_partial(q, k + hk * D, v + hk * D, m, D, HD, scale, softcap, pt + 2);
            pt[0] = mx; pt[1] = l;
          } else {
            float* st = state.data() + ((t - u.t0) * Hq + h) * (D + 2);
            auto [mx, l] = chunk_partial(q, k + hk * D, v + hk * D, m, D, HD, scale, softcap, o);
            fold(st, st + 2, mx, l, o, D, c == 0);
          }
        }
      }
    }
    if (!u.keep)
      for (int64_t t = u.t0; t < u.t1; t++)
        for (int64_t h = 0; h < Hq; h++) {
          const float* st = state.data() + ((t - u.t0) * Hq + h) * (D + 2);
          finish(st, st + 2, D, out + (t * Hq + h) * D, sinks ? sinks + h : nullptr);
        }
  }
#pragma omp barrier
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
    finish(st, st + 2, D, out + (t * Hq + h) * D, sinks ? sinks + h : nullptr);
  }
}

// attention_team in a team of its own (a layer called alone).
template <class KV>
void attention(const float* qkv, int64_t W, int64_t Hq, int64_t Hkv, int64_t D, const KV* kp, const KV* vp,
               const int64_t* context_slots, int64_t Lk, const Visible& vis, float scale, float softcap, float* out,
               const float* sinks = nullptr) {
  static thread_local AttentionPlan own;
  AttentionPlan& plan = own;  // the calling thread's, shared with the team (inside, `own` names each member's)
  const int64_t nthreads = at::get_num_threads();
  plan_attention(vis, Hq, D, nthreads, plan);
#pragma omp parallel num_threads(nthreads)
  attention_team(plan, qkv, W, Hq, Hkv, D, kp, vp, context_slots, Lk, vis, scale, softcap, out, sinks);
}

}  // namespace
