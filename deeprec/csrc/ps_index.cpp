// The PS's fused key index: one open-addressing hash table over (variable, key) pairs
// for all embedding variables of one arena (same dim and optimizer), run without the GIL.
//
//   table    int64 [2C] slot s: [2s] = key, [2s + 1] = ns << 40 | row, or -1 if empty;
//                       C a power of two, kept <= half full by the caller (the key is
//                       inline so a probe touches one cache line)
//   row_ns   int64 [R]  row -> variable (namespace) of the row's key
//   row_keys int64 [R]  row -> key
//
//   ps_index_rows(table, row_ns, row_keys, ns, keys, size, insert) -> (rows, fresh, repeated)
//     rows[i] = the row of (ns[i], keys[i]); a pair not yet held gets -1, or with `insert`
//     the next free row (size, size + 1, ... in first-seen order: a pair given twice gets
//     one row). fresh = positions i that created a row, in row order; repeated (int64 scalar)
//     = how many positions named a pair already met in this call (0: the rows are distinct).
//   ps_index_build(table, row_ns, row_keys, size): (re)fill the table with rows [0, size).
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace deeprec {
namespace {

inline uint64_t slot_hash(int64_t ns, int64_t key) {  // splitmix64's finalizer over the pair
  uint64_t x = static_cast<uint64_t>(key) ^ (static_cast<uint64_t>(ns) * 0x9E3779B97F4A7C15ULL);
  x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27; x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

constexpr int64_t kRowBits = 40;  // rows < 2^40, namespaces < 2^23
constexpr int64_t kRowMask = (int64_t{1} << kRowBits) - 1;
constexpr int64_t kSeen = int64_t{1} << 62;  // marks a slot already met in this call (duplicates)

void check_index(const at::Tensor& table, const at::Tensor& row_ns, const at::Tensor& row_keys) {
  for (const at::Tensor* t : {&table, &row_ns, &row_keys}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "ps_index: the index tensors must be contiguous 1-D int64 CPU tensors");
  }
  const int64_t c = table.numel() / 2;
  TORCH_CHECK(table.numel() % 2 == 0 && c > 0 && (c & (c - 1)) == 0,
              "ps_index: table must hold 2 x (a power of two) entries, got ", table.numel());
  TORCH_CHECK(row_ns.numel() == row_keys.numel(), "ps_index: row_ns and row_keys differ in length");
}

// Probe for (ns, key) from its home slot: the slot holding it, or the empty slot where it would go.
inline int64_t probe_from(const int64_t* table, int64_t mask, int64_t slot, int64_t ns, int64_t key) {
  while (true) {
    const int64_t tag = table[2 * slot + 1];
    if (tag < 0 || (table[2 * slot] == key && ((tag & ~kSeen) >> kRowBits) == ns)) return slot;
    slot = (slot + 1) & mask;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ps_index_rows(at::Tensor& table, at::Tensor& row_ns, at::Tensor& row_keys,
                                                 const at::Tensor& ns, const at::Tensor& keys, int64_t size,
                                                 bool insert) {
  check_index(table, row_ns, row_keys);
  TORCH_CHECK(ns.scalar_type() == at::kLong && keys.scalar_type() == at::kLong && ns.dim() == 1 &&
                  keys.dim() == 1 && ns.numel() == keys.numel(),
              "ps_index_rows: ns and keys must be 1-D int64 tensors of one length");
  const int64_t n = keys.numel();
  TORCH_CHECK(size >= 0 && size <= row_keys.numel(), "ps_index_rows: size out of range");
  TORCH_CHECK(!insert || (size + n <= row_keys.numel() && 2 * (size + n) <= table.numel() / 2),
              "ps_index_rows: grow the arena before inserting ", n, " keys (", size, " rows held, ",
              row_keys.numel(), " allocated, table ", table.numel() / 2, ")");
  TORCH_CHECK(size + n <= kRowMask, "ps_index_rows: more than 2^40 rows");
  at::Tensor ns_c = ns.contiguous(), keys_c = keys.contiguous();
  const int64_t* nsp = ns_c.data_ptr<int64_t>();
  const int64_t* kp = keys_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(nsp[i] >= 0 && nsp[i] < (int64_t{1} << (62 - kRowBits)), "ps_index_rows: namespace ", nsp[i],
                " out of range");
  }
  int64_t* tp = table.data_ptr<int64_t>();
  int64_t* rns = row_ns.data_ptr<int64_t>();
  int64_t* rks = row_keys.data_ptr<int64_t>();
  const int64_t mask = table.numel() / 2 - 1;
  at::Tensor rows = at::empty({n}, keys.options());
  int64_t* out = rows.data_ptr<int64_t>();
  std::vector<int64_t> fresh, met;
  met.reserve(n);
  int64_t repeated = 0;
  // a probe is one cache miss into a table far larger than the cache: hash kAhead keys
  // ahead and prefetch their home slots, so the misses overlap instead of queueing
  constexpr int64_t kAhead = 16;
  int64_t home[kAhead];
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) {
    home[i] = static_cast<int64_t>(slot_hash(nsp[i], kp[i])) & mask;
    __builtin_prefetch(tp + 2 * home[i]);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = home[i % kAhead];
    if (i + kAhead < n) {
      home[i % kAhead] = static_cast<int64_t>(slot_hash(nsp[i + kAhead], kp[i + kAhead])) & mask;
      __builtin_prefetch(tp + 2 * home[i % kAhead]);
    }
    const int64_t slot = probe_from(tp, mask, start, nsp[i], kp[i]);
    int64_t& tag = tp[2 * slot + 1];
    int64_t row = -1;
    if (tag >= 0) {
      row = tag & kRowMask;
      repeated += (tag & kSeen) != 0;
    } else if (insert) {
      row = size++;
      rns[row] = nsp[i];
      rks[row] = kp[i];
      tp[2 * slot] = kp[i];
      tag = (nsp[i] << kRowBits) | row;
      fresh.push_back(i);
    }
    if (tag >= 0 && !(tag & kSeen)) {
      tag |= kSeen;
      met.push_back(slot);
    }
    out[i] = row;
  }
  for (int64_t slot : met) tp[2 * slot + 1] &= ~kSeen;
  at::Tensor fresh_t = at::empty({static_cast<int64_t>(fresh.size())}, keys.options());
  std::copy(fresh.begin(), fresh.end(), fresh_t.data_ptr<int64_t>());
  return {rows, fresh_t, at::scalar_tensor(repeated, keys.options())};
}

void ps_index_build(at::Tensor& table, const at::Tensor& row_ns, const at::Tensor& row_keys, int64_t size) {
  check_index(table, row_ns, row_keys);
  TORCH_CHECK(size >= 0 && size <= row_keys.numel() && 2 * size <= table.numel() / 2,
              "ps_index_build: ", size, " rows do not fit a table of ", table.numel() / 2);
  table.fill_(-1);
  int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* rns = row_ns.data_ptr<int64_t>();
  const int64_t* rks = row_keys.data_ptr<int64_t>();
  const int64_t mask = table.numel() / 2 - 1;
  for (int64_t row = 0; row < size; ++row) {
    const int64_t slot = probe_from(tp, mask, static_cast<int64_t>(slot_hash(rns[row], rks[row])) & mask, rns[row],
                                    rks[row]);
    TORCH_CHECK(tp[2 * slot + 1] < 0, "ps_index_build: (", rns[row], ", ", rks[row], ") is held by two rows");
    tp[2 * slot] = rks[row];
    tp[2 * slot + 1] = (rns[row] << kRowBits) | row;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deeprec, m) {
  m.def("ps_index_rows(Tensor(a!) table, Tensor(b!) row_ns, Tensor(c!) row_keys, Tensor ns, Tensor keys, "
        "int size, bool insert) -> (Tensor, Tensor, Tensor)");
  m.def("ps_index_build(Tensor(a!) table, Tensor row_ns, Tensor row_keys, int size) -> ()");
}

TORCH_LIBRARY_IMPL(deeprec, CPU, m) {
  m.impl("ps_index_rows", ps_index_rows);
  m.impl("ps_index_build", ps_index_build);
}

}  // namespace deeprec
