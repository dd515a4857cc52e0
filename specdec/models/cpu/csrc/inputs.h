// A step's causal layout over the paged cache in one call: `kv_cache.paged_inputs` for steps without a tree (plain
// decoding, chain verification, prefill chunks, a chain drafter's steps). The same arrays the numpy path builds;
// here they cost one call instead of about twenty small array operations, which after a forward has pushed the
// interpreter's data out of cache took 100 us a call.
#pragma once
#include "simd.h"

namespace {

// feeds[b] goes into slots starts[b].. of the sequence owning blocks tables[b] (slot of position p:
// tables[b][p / bs] * bs + p % bs; a position past the table, or past the sequence's end, reads the null block).
// Returns {tokens [T], positions [T], slot_mapping [T], context_slots [B, L], mask bool [B, S, L], query_starts
// [B + 1] (the first row of each sequence, and T)}: T the fed
// tokens of every sequence, S the most one feeds, L the longest context. A query sees every key up to its own
// position; a padding query (j >= its sequence's feed) sees key 0 only, so its softmax stays finite.
std::vector<torch::Tensor> causal_inputs(const std::vector<std::vector<int64_t>>& tables,
                                         const std::vector<int64_t>& starts,
                                         const std::vector<std::vector<int64_t>>& feeds, int64_t bs,
                                         int64_t null_block) {
  const int64_t B = (int64_t)feeds.size();
  TORCH_CHECK(B > 0 && (int64_t)tables.size() == B && (int64_t)starts.size() == B && bs > 0,
              "causal_inputs needs one table, start and feed per sequence");
  int64_t S = 0, L = 0, T = 0;
  for (int64_t b = 0; b < B; b++) {
    const int64_t n = (int64_t)feeds[b].size();
    S = std::max(S, n);
    L = std::max(L, starts[b] + n);
    T += n;
  }
  const int64_t columns = (L + bs - 1) / bs;  // block-table columns the numpy path keeps
  const auto opts = torch::TensorOptions().dtype(torch::kInt64);
  auto tokens = torch::empty({T}, opts), positions = torch::empty({T}, opts), slots = torch::empty({T}, opts);
  auto context = torch::empty({B, L}, opts);
  auto mask = torch::zeros({B, S, L}, torch::kBool);
  auto query_starts = torch::empty({B + 1}, opts);
  int64_t* qs = query_starts.data_ptr<int64_t>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* slot = slots.data_ptr<int64_t>();
  bool* m = mask.data_ptr<bool>();
  int64_t t = 0;
  for (int64_t b = 0; b < B; b++) {
    const auto& table = tables[b];
    const int64_t start = starts[b], n = (int64_t)feeds[b].size(), end = start + n;
    const int64_t known = std::min<int64_t>((int64_t)table.size(), columns);
    int64_t* row = context.data_ptr<int64_t>() + b * L;
    qs[b] = t;
    for (int64_t p = 0; p < L; p++) {
      const int64_t c = p / bs;
      row[p] = p < end ? (c < known ? table[c] : null_block) * bs + p % bs : null_block * bs;
    }
    for (int64_t j = 0; j < S; j++) {
      bool* mj = m + (b * S + j) * L;
      if (j < n) {
        tok[t] = feeds[b][j];
        pos[t] = start + j;
        slot[t] = row[start + j];
        t++;
        std::fill(mj, mj + start + j + 1, true);
      } else {
        mj[0] = true;
      }
    }
  }
  qs[B] = t;
  return {tokens, positions, slots, context, mask, query_starts};
}

}  // namespace
