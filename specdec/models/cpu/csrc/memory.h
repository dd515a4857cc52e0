// Memory on 2 MB pages for what every step streams (the interleaved weights, the K/V pools). On 4 KB pages a step
// over a 100 MB model touches some 25,000 pages: the TLB misses (each a page walk, two-level under a hypervisor)
// and the hardware prefetchers, which stop at every 4 KB boundary, cost 10-15% of a decode step's bandwidth.
// Linux gives transparent huge pages to memory advised with MADV_HUGEPAGE (the default "madvise" policy); where it
// gives none the memory is ordinary pages, and elsewhere plain torch::empty.
#pragma once
#include "simd.h"
#include <memory>
#include <mutex>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace {

constexpr size_t HUGE_PAGE = size_t(2) << 20;
constexpr size_t HUGE_CHUNK = size_t(32) << 20;  // small tensors share chunks of this size

// One mapping, unmapped when the last tensor in it is freed.
struct HugeChunk {
  char* base = nullptr;  // 2 MB aligned
  char* mapped = nullptr;
  size_t size = 0, mapped_size = 0;
  ~HugeChunk() {
#ifdef __linux__
    if (mapped != nullptr) munmap(mapped, mapped_size);
#endif
  }
};

std::shared_ptr<HugeChunk> map_huge(size_t size) {
  auto c = std::make_shared<HugeChunk>();
#ifdef __linux__
  c->mapped_size = size + HUGE_PAGE;  // room to align the start
  void* p = mmap(nullptr, c->mapped_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  c->mapped = (char*)p;
  c->base = (char*)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
  c->size = size;
  madvise(c->base, size, MADV_HUGEPAGE);  // advice only: ignored where the kernel has no huge pages
#endif
  return c;
}

// An uninitialized tensor on 2 MB pages: a chunk of its own when large, else the tail of a shared chunk (handed out
// in order, never reused: freed with the last tensor in it).
torch::Tensor huge_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto opts = torch::TensorOptions().dtype(dtype);
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  const size_t bytes = ((size_t)n * c10::elementSize(dtype) + 63) & ~size_t(63);
#ifdef __linux__
  static std::mutex mu;
  static std::shared_ptr<HugeChunk> shared;
  static size_t used = 0;
  std::shared_ptr<HugeChunk> chunk;
  char* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (bytes >= HUGE_CHUNK / 2) {
      chunk = map_huge((bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
      if (chunk) p = chunk->base;
    } else {
      if (!shared || used + bytes > shared->size) { shared = map_huge(HUGE_CHUNK); used = 0; }
      if (shared) { chunk = shared; p = chunk->base + used; used += bytes; }
    }
  }
  if (p != nullptr) return torch::from_blob(p, sizes, [chunk](void*) mutable { chunk.reset(); }, opts);
#endif
  return torch::empty(sizes, opts);
}

}  // namespace
