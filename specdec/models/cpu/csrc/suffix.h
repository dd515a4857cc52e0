// A retrieval datastore's lookups (drafting/retrieval.py's `Datastore`): the longest suffix of a sequence found in
// the corpus's suffix array, and the chain most of its continuations agree on. The same answers as the numpy path,
// in one call each: after a forward has pushed the interpreter's data out of cache, that path's dozens of small
// array operations took 200 us a request on a Zen 4, a step's largest host cost. Tokens are compared in place, so
// the numpy path's packed keys (8 bytes a corpus token per 64 bits of query, 2 s to pack 5.6 M tokens) are not
// needed.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>
#include <torch/extension.h>

namespace {

// Where the suffix at `at` stands against `query` (its first len tokens): -1 before, 0 starting with it, 1 after.
// Token ids order as the suffix array's ranks do (end of text -2 < separator -1 < tokens), and the padding after
// the corpus (max_match tokens at least) keeps every read inside the array.
inline int suffix_compare(const int32_t* tok, int64_t at, const int64_t* query, int64_t len) {
  for (int64_t j = 0; j < len; j++) {
    const int64_t t = tok[at + j];
    if (t != query[j]) return t < query[j] ? -1 : 1;
  }
  return 0;
}

// [lo, hi) of the suffixes that start with `query`: two binary searches over the suffix array, comparing tokens.
inline std::pair<int64_t, int64_t> suffix_find(const int32_t* sa, const int32_t* tok, int64_t n, const int64_t* query,
                                               int64_t len) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {  // the first suffix not before the query
    const int64_t mid = lo + (hi - lo) / 2;
    if (suffix_compare(tok, sa[mid], query, len) < 0) lo = mid + 1; else hi = mid;
  }
  int64_t a = lo, b = n;
  while (a < b) {  // the first suffix after every one starting with it
    const int64_t mid = a + (b - a) / 2;
    if (suffix_compare(tok, sa[mid], query, len) <= 0) a = mid + 1; else b = mid;
  }
  return {lo, a};
}

// (length, lo, hi) of the longest suffix of `context` of min_match..max_match tokens in the corpus (0, 0, 0: none),
// by bisection on the length as `Datastore.longest_match` (a present suffix's shorter suffixes are present too).
std::vector<int64_t> suffix_longest_match(const torch::Tensor& sa, const torch::Tensor& tokens,
                                          const std::vector<int64_t>& context, int64_t min_match, int64_t max_match) {
  TORCH_CHECK(sa.scalar_type() == torch::kInt32 && tokens.scalar_type() == torch::kInt32 && sa.is_contiguous() &&
              tokens.is_contiguous() && tokens.numel() >= sa.numel() + max_match,
              "suffix_longest_match: int32 suffix array and tokens padded by max_match");
  const int32_t* s = sa.data_ptr<int32_t>();
  const int32_t* tok = tokens.data_ptr<int32_t>();
  const int64_t n = sa.numel(), size = (int64_t)context.size();
  int64_t lo_m = min_match - 1, hi_m = std::min(max_match, size);
  std::vector<int64_t> best = {0, 0, 0};
  while (lo_m < hi_m) {
    const int64_t mid = (lo_m + hi_m + 1) / 2;
    const auto [a, b] = suffix_find(s, tok, n, context.data() + size - mid, mid);
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
