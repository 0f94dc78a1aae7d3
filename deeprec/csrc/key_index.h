// deeprec's key index (see key_index.cpp): the table's layout and the find-or-insert core,
// shared by the index's own ops and the EmbeddingVariable's fused lookup (ev_lookup.cpp).
#pragma once
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace deeprec {
namespace key_index {

inline uint64_t slot_hash(int64_t ns, int64_t key) {  // splitmix64's finalizer over the pair
  uint64_t x = static_cast<uint64_t>(key) ^ (static_cast<uint64_t>(ns) * 0x9E3779B97F4A7C15ULL);
  x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27; x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

constexpr int64_t kRowBits = 40;  // rows < 2^40, namespaces < 2^22
constexpr int64_t kRowMask = (int64_t{1} << kRowBits) - 1;
constexpr int64_t kSeen = int64_t{1} << 62;  // a slot met in this call (dedup: its row field holds the place)
constexpr int64_t kMaxNs = int64_t{1} << (62 - kRowBits);
// A probe is one cache miss into a table far larger than the cache: keys are hashed kAhead
// ahead and their home slots prefetched, so the misses overlap instead of queueing.
constexpr int64_t kAhead = 16;

inline int64_t tag_ns(int64_t tag) { return (tag & ~kSeen) >> kRowBits; }

struct Table {
  int64_t* slots;
  int64_t mask;

  explicit Table(const at::Tensor& t) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(),
                "key_index: the table must be a contiguous 1-D int64 CPU tensor");
    const int64_t c = t.numel() / 2;
    TORCH_CHECK(t.numel() % 2 == 0 && c > 0 && (c & (c - 1)) == 0,
                "key_index: the table must hold 2 x (a power of two) entries, got ", t.numel());
    slots = t.data_ptr<int64_t>();
    mask = c - 1;
  }
  int64_t home(int64_t ns, int64_t key) const { return static_cast<int64_t>(slot_hash(ns, key)) & mask; }
  void prefetch(int64_t slot) const { __builtin_prefetch(slots + 2 * slot); }
  // the slot holding (ns, key), or the empty slot where it would go
  int64_t probe(int64_t slot, int64_t ns, int64_t key) const {
    for (int64_t steps = 0; steps <= mask; ++steps) {
      const int64_t tag = slots[2 * slot + 1];
      if (tag < 0 || (slots[2 * slot] == key && tag_ns(tag) == ns)) return slot;
      slot = (slot + 1) & mask;
    }
    TORCH_CHECK(false, "key_index: the table is full (grow it before inserting)");
  }
  void put(int64_t slot, int64_t ns, int64_t key, int64_t row) {
    slots[2 * slot] = key;
    slots[2 * slot + 1] = (ns << kRowBits) | row;
  }
};

// a 1-D int64 CPU tensor's data, or nullptr for an empty tensor (the default: ns 0, count 1, no freq)
inline const int64_t* longs(const at::Tensor& t, int64_t n, const char* what) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() &&
                  (n < 0 || t.numel() == n),
              "key_index: ", what, " must be a contiguous 1-D int64 CPU tensor", n < 0 ? "" : " of the keys' length",
              " (or empty)");
  return t.data_ptr<int64_t>();
}

inline void check_ns(const int64_t* ns, int64_t n) {
  if (!ns) return;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ns[i] >= 0 && ns[i] < kMaxNs, "key_index: namespace ", ns[i], " out of range [0, 2^22)");
  }
}

inline at::Tensor keys_of(const at::Tensor& keys) {
  TORCH_CHECK(keys.device().is_cpu() && keys.scalar_type() == at::kLong && keys.dim() == 1,
              "key_index: keys must be a 1-D int64 CPU tensor");
  return keys.contiguous();
}

struct Part {
  at::Tensor rows, inverse, fresh;
  int64_t missing = 0, repeated = 0;
};

// one index's find-or-insert (key_index_find's part i)
Part find_part(const at::Tensor& table, const at::Tensor& row_keys, const at::Tensor& freq, const at::Tensor& ns,
               const at::Tensor& keys, const at::Tensor& counts, int64_t size, bool insert, bool dedup);

}  // namespace key_index
}  // namespace deeprec
