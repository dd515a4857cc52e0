// A retrieval datastore's lookups (drafting/retrieval.py's `Datastore`): the longest suffix of a sequence found in
// the corpus's suffix array, and the chain most of its continuations agree on. The same answers as the numpy path,
// in one call each: after a forward has pushed the interpreter's data out of cache, that path's dozens of small
// array operations took 200 us a request on a Zen 4, a step's largest host cost.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>
#include <torch/extension.h>

namespace {

// [lo, hi) of the suffixes starting with `query` (tokens), keys: per chunk of per_key tokens, [n] uint64 (stored as
// int64) in suffix-array order, each token ranked t + 2 in `bits` bits. Empty (lo, lo) for a token outside the ranks.
inline std::pair<int64_t, int64_t> suffix_find(const std::vector<const uint64_t*>& keys, int64_t n,
                                               const int64_t* query, int64_t len, int64_t bits) {
  const int64_t per = 64 / bits;
  const uint64_t top = (uint64_t(1) << bits) - 1;
  int64_t lo = 0, hi = n;
  for (int64_t c = 0; c < len; c += per) {
    const int64_t part = std::min(per, len - c);
    uint64_t low = 0;
    for (int64_t j = 0; j < part; j++) {
      const int64_t t = query[c + j] + 2;
      if (t < 0 || (uint64_t)t > top) return {lo, lo};
      low = (low << bits) | (uint64_t)t;
    }
    const int64_t free = bits * (per - part);
    const uint64_t first = low << free, last = first | ((free ? (uint64_t(1) << free) : uint64_t(1)) - 1);
    const uint64_t* k = keys[c / per];
    const int64_t a = std::lower_bound(k + lo, k + hi, first) - k;
    const int64_t b = std::upper_bound(k + lo, k + hi, free ? last : first) - k;
    lo = a, hi = b;
    if (lo >= hi) return {lo, lo};
  }
  return {lo, hi};
}

// (length, lo, hi) of the longest suffix of `context` of min_match..max_match tokens in the corpus (0, 0, 0: none),
// by bisection on the length as `Datastore.longest_match`.
std::vector<int64_t> suffix_longest_match(const std::vector<torch::Tensor>& keys, const std::vector<int64_t>& context,
                                          int64_t bits, int64_t min_match, int64_t max_match) {
  TORCH_CHECK(!keys.empty() && bits > 0 && bits <= 32, "suffix_longest_match needs keys and 1-32 bits a token");
  std::vector<const uint64_t*> k;
  for (const auto& t : keys) {
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.numel() == keys[0].numel(),
                "the datastore's keys: contiguous int64 views of equal length");
    k.push_back(reinterpret_cast<const uint64_t*>(t.data_ptr<int64_t>()));
  }
  const int64_t n = keys[0].numel(), size = (int64_t)context.size();
  TORCH_CHECK(max_match <= (64 / bits) * (int64_t)keys.size(), "a query longer than the datastore's keys");
  int64_t lo_m = min_match - 1, hi_m = std::min(max_match, size);
  std::vector<int64_t> best = {0, 0, 0};
  while (lo_m < hi_m) {
    const int64_t mid = (lo_m + hi_m + 1) / 2;
    const auto [a, b] = suffix_find(k, n, context.data() + size - mid, mid, bits);
    if (b > a) {
      lo_m = mid;
      best = {mid, a, b};
    } else {
      hi_m = mid - 1;
    }
  }
  return best;
}

// The chain most of the continuations of suffix-array range [lo, hi) after m matched tokens agree on, token by token
// (`retrieval.voted_chain` over `Datastore.continuations`: up to max_candidates occurrences spread evenly over the
// range, each position's most frequent token among the rows that agree so far, ties to the one met first), up to
// `depth` tokens or a document's end (a negative id).
std::vector<int64_t> suffix_voted_chain(const torch::Tensor& sa, const torch::Tensor& tokens, int64_t lo, int64_t hi,
                                        int64_t m, int64_t depth, int64_t max_candidates) {
  TORCH_CHECK(sa.scalar_type() == torch::kInt32 && tokens.scalar_type() == torch::kInt32 && sa.is_contiguous() &&
              tokens.is_contiguous() && 0 <= lo && lo < hi && hi <= sa.numel() && max_candidates > 0,
              "suffix_voted_chain: int32 suffix array and tokens, a non-empty range");
  const int32_t* s = sa.data_ptr<int32_t>();
  const int32_t* tok = tokens.data_ptr<int32_t>();
  const int64_t count = std::min(hi - lo, max_candidates), span = hi - 1 - lo, size = tokens.numel();
  std::vector<int64_t> rows;  // the candidates' first continuation token index, in order
  for (int64_t i = 0; i < count; i++) {
    const int64_t idx = count > 1 ? lo + (i * (2 * span) + (count - 1)) / (2 * (count - 1)) : lo;
    rows.push_back((int64_t)s[idx] + m);
  }
  std::vector<int64_t> chain;
  std::vector<std::pair<int32_t, int64_t>> counts;  // token, rows: in the order first met
  for (int64_t j = 0; j < depth; j++) {
    counts.clear();
    for (int64_t r : rows) {
      TORCH_CHECK(r + j < size, "a continuation runs past the datastore's padding");
      const int32_t t = tok[r + j];
      if (t < 0) continue;
      auto it = std::find_if(counts.begin(), counts.end(), [t](const auto& c) { return c.first == t; });
      if (it == counts.end()) counts.push_back({t, 1}); else it->second++;
    }
    if (counts.empty()) break;
    auto best = counts.begin();
    for (auto it = counts.begin(); it != counts.end(); ++it) if (it->second > best->second) best = it;
    const int32_t token = best->first;
    chain.push_back(token);
    std::vector<int64_t> agree;
    for (int64_t r : rows) if (tok[r + j] == token) agree.push_back(r);
    rows.swap(agree);
  }
  return chain;
}

}  // namespace
