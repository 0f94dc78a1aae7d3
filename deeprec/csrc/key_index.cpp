// deeprec's one key index: (namespace, int64 key) -> row, an open-addressing hash table held
// in one int64 tensor. The local EmbeddingVariable, its tiered form (DRAM and disk indexes),
// the counter filter's pending keys and the PS shard's arena all use it (deeprec/nn/key_index.py
// wraps it); every op runs without the GIL (torch.ops releases it) under the owner's lock.
//
//   table int64 [2C]  slot s: [2s] = key, [2s + 1] = tag = ns << 40 | row, or -1 if empty;
//                     C a power of two, kept <= half full by the caller. The key is inline so a
//                     probe touches one cache line; linear probing, deletion by backward shift
//                     (no tombstones).
//
//   key_index_find(tables, row_keys, freqs, ns, keys, counts, sizes, insert, dedup)
//       -> (rows, inverse, fresh, stats)       one call for many indexes (part i: tables[i], ...)
//     rows[i]    the row of each key (dedup: of each distinct key, in first-seen order; a key not
//                held and not inserted keeps a place of its own), -1 if not held; with `insert`
//                a key not held gets the next row (sizes[i], sizes[i] + 1, ...), its key written
//                to row_keys[i][row] and its freq set to 0
//     inverse[i] dedup: position -> its key's place in rows[i] (else empty)
//     fresh[i]   places in rows[i] that created a row, in row order
//     stats      int64 [parts, 3]: (places not held after the call, positions that repeat an
//                earlier key of the call, places)
//     freqs[i]   (unless empty) += counts[i] (empty: 1) at each position's row
//   key_index_assign(table, ns, keys, rows) -> new entries     key -> row, inserted or overwritten
//   key_index_remove(table, ns, keys) -> removed entries
//   key_index_grow(table, old_slots)     in place: the table's first 2 * old_slots entries hold a table
//                                        of old_slots slots; it becomes one of all its slots (a power-of-
//                                        two multiple), the new part's pages touched for the first time
//                                        (an index in reserved address space grows without a copy)
//   key_index_entries(table) -> (ns, keys, rows)                every entry, in slot order
// An empty ns tensor means namespace 0 for every key.
#include "key_index.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace deeprec {
namespace key_index {

Part find_part(const at::Tensor& table_t, const at::Tensor& row_keys_t, const at::Tensor& freq_t,
               const at::Tensor& ns_t, const at::Tensor& keys_t, const at::Tensor& counts_t, int64_t size,
               bool insert, bool dedup) {
  Table table(table_t);
  const at::Tensor keys = keys_of(keys_t);
  const int64_t n = keys.numel();
  const int64_t* kp = keys.data_ptr<int64_t>();
  const int64_t* nsp = longs(ns_t, n, "ns");
  const int64_t* cp = longs(counts_t, n, "counts");
  check_ns(nsp, n);
  int64_t* row_keys = insert ? const_cast<int64_t*>(longs(row_keys_t, -1, "row_keys")) : nullptr;
  int64_t* freq = const_cast<int64_t*>(longs(freq_t, -1, "freq"));
  if (insert) {
    TORCH_CHECK(row_keys != nullptr && size >= 0 && size + n <= row_keys_t.numel(),
                "key_index_find: grow the rows before inserting ", n, " keys (", size, " held, ",
                row_keys_t.numel(), " allocated)");
    TORCH_CHECK(size + n <= kRowMask, "key_index_find: more than 2^40 rows");
  }
  TORCH_CHECK(!freq || freq_t.numel() >= (insert ? size + n : 0), "key_index_find: freq is shorter than the rows");
  Part out;
  out.rows = at::empty({n}, keys.options());
  int64_t* rows = out.rows.data_ptr<int64_t>();
  int64_t* inverse = nullptr;
  if (dedup) {
    out.inverse = at::empty({n}, keys.options());
    inverse = out.inverse.data_ptr<int64_t>();
  } else {
    out.inverse = at::empty({0}, keys.options());
  }
  std::vector<int64_t> fresh;
  std::vector<std::pair<int64_t, int64_t>> met;  // (slot, its tag once the call ends) of the held rows met
  met.reserve(n);
  const int64_t first = size;  // the rows this call creates: first, first + 1, ...
  int64_t places = 0;
  int64_t home[kAhead];
  for (int64_t i = 0; i < std::min(n, kAhead); ++i) {
    home[i] = table.home(nsp ? nsp[i] : 0, kp[i]);
    table.prefetch(home[i]);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ns = nsp ? nsp[i] : 0, key = kp[i];
    const int64_t start = home[i % kAhead];
    if (i + kAhead < n) {
      home[i % kAhead] = table.home(nsp ? nsp[i + kAhead] : 0, kp[i + kAhead]);
      table.prefetch(home[i % kAhead]);
    }
    const int64_t slot = table.probe(start, ns, key);
    int64_t& tag = table.slots[2 * slot + 1];
    int64_t row = -1, place = i;
    if (tag >= 0 && (tag & kSeen)) {  // a held row met earlier in this call
      ++out.repeated;
      if (dedup) {
        place = tag & kRowMask;
        row = rows[place];
      } else {
        row = rows[i] = tag & kRowMask;
      }
    } else if (tag >= 0 && insert && (tag & kRowMask) >= first && (tag & kRowMask) < size) {
      // a row this call created (rows first, first + 1, ... are new): a repeat, known without marking it
      ++out.repeated;
      row = tag & kRowMask;
      if (dedup) {
        place = fresh[row - first];
      } else {
        rows[i] = row;
      }
    } else {
      bool created = false;
      if (tag >= 0) {
        row = tag & kRowMask;
      } else if (insert) {
        row = size++;
        row_keys[row] = key;
        if (freq) freq[row] = 0;
        table.slots[2 * slot] = key;
        tag = (ns << kRowBits) | row;
        created = true;
      }
      if (dedup) place = places++;
      if (row >= 0 && !created) {  // marked met until the call ends (dedup: the row field holds the place)
        met.emplace_back(slot, tag);
        tag = kSeen | (ns << kRowBits) | (dedup ? place : row);
      } else if (row < 0) {
        ++out.missing;
      }
      rows[place] = row;
      if (created) fresh.push_back(place);
    }
    if (dedup) inverse[i] = place;
  }
  for (const auto& [slot, tag] : met) table.slots[2 * slot + 1] = tag;
  if (freq) {  // counted in a pass of its own: each count is a miss too, prefetched ahead
    auto row_of = [&](int64_t i) { return rows[dedup ? inverse[i] : i]; };
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n && row_of(i + kAhead) >= 0) __builtin_prefetch(freq + row_of(i + kAhead), 1);
      const int64_t row = row_of(i);
      if (row >= 0) freq[row] += cp ? cp[i] : 1;
    }
  }
  if (dedup) out.rows = out.rows.narrow(0, 0, places);
  out.fresh = at::empty({static_cast<int64_t>(fresh.size())}, keys.options());
  std::copy(fresh.begin(), fresh.end(), out.fresh.data_ptr<int64_t>());
  return out;
}

}  // namespace key_index

namespace {
using namespace key_index;

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor> key_index_find(
    const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& row_keys, const std::vector<at::Tensor>& freqs,
    const std::vector<at::Tensor>& ns, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& counts,
    at::IntArrayRef sizes, bool insert, bool dedup) {
  const size_t parts = tables.size();
  TORCH_CHECK(row_keys.size() == parts && freqs.size() == parts && ns.size() == parts && keys.size() == parts &&
                  counts.size() == parts && sizes.size() == parts,
              "key_index_find: tables, row_keys, freqs, ns, keys, counts and sizes must have one entry per part");
  std::vector<at::Tensor> rows, inverse, fresh;
  at::Tensor stats = at::empty({static_cast<int64_t>(parts), 3}, at::kLong);
  int64_t* sp = stats.data_ptr<int64_t>();
  for (size_t p = 0; p < parts; ++p) {
    Part part = find_part(tables[p], row_keys[p], freqs[p], ns[p], keys[p], counts[p], sizes[p], insert, dedup);
    sp[3 * p] = part.missing;
    sp[3 * p + 1] = part.repeated;
    sp[3 * p + 2] = part.rows.numel();
    rows.push_back(std::move(part.rows));
    inverse.push_back(std::move(part.inverse));
    fresh.push_back(std::move(part.fresh));
  }
  return {rows, inverse, fresh, stats};
}

int64_t key_index_assign(at::Tensor& table_t, const at::Tensor& ns_t, const at::Tensor& keys_t,
                         const at::Tensor& rows_t) {
  Table table(table_t);
  const at::Tensor keys = keys_of(keys_t), rows_c = keys_of(rows_t);
  const int64_t n = keys.numel();
  TORCH_CHECK(rows_c.numel() == n, "key_index_assign: keys and rows differ in length");
  const int64_t* kp = keys.data_ptr<int64_t>();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  const int64_t* nsp = longs(ns_t, n, "ns");
  check_ns(nsp, n);
  int64_t added = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] <= kRowMask, "key_index_assign: row ", rp[i], " out of range [0, 2^40]");
    const int64_t ns = nsp ? nsp[i] : 0;
    const int64_t slot = table.probe(table.home(ns, kp[i]), ns, kp[i]);
    added += table.slots[2 * slot + 1] < 0;
    table.put(slot, ns, kp[i], rp[i]);
  }
  return added;
}

int64_t key_index_remove(at::Tensor& table_t, const at::Tensor& ns_t, const at::Tensor& keys_t) {
  Table table(table_t);
  const at::Tensor keys = keys_of(keys_t);
  const int64_t n = keys.numel();
  const int64_t* kp = keys.data_ptr<int64_t>();
  const int64_t* nsp = longs(ns_t, n, "ns");
  int64_t* s = table.slots;
  int64_t removed = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ns = nsp ? nsp[i] : 0;
    int64_t hole = table.probe(table.home(ns, kp[i]), ns, kp[i]);
    if (s[2 * hole + 1] < 0) continue;
    ++removed;
    // backward shift: move later entries of the cluster into the hole unless their home lies
    // cyclically in (hole, j], where they would no longer be found
    for (int64_t j = (hole + 1) & table.mask; s[2 * j + 1] >= 0; j = (j + 1) & table.mask) {
      const int64_t h = table.home(tag_ns(s[2 * j + 1]), s[2 * j]);
      const bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
      if (stays) continue;
      s[2 * hole] = s[2 * j];
      s[2 * hole + 1] = s[2 * j + 1];
      hole = j;
    }
    s[2 * hole + 1] = -1;
  }
  return removed;
}

void key_index_grow(at::Tensor& table_t, int64_t old_slots) {
  Table table(table_t);
  const int64_t slots = table.mask + 1;
  TORCH_CHECK(old_slots > 0 && (old_slots & (old_slots - 1)) == 0 && old_slots <= slots,
              "key_index_grow: the old table's slots must be a power of two, at most the table's ", slots, ", got ",
              old_slots);
  int64_t* s = table.slots;
  std::fill(s + 2 * old_slots, s + 2 * slots, int64_t{-1});
  // An entry's new home is its old one plus a multiple of old_slots. Taken in slot order, each is
  // moved from its slot to the first free one from its new home: one at its old home's side lands
  // in slots already taken in order (at the latest in its own, just freed), one past old_slots in
  // the new part, where nothing is taken out again; so no entry is ever cut off from its home.
  // Only the entries of a cluster that wrapped around the old table's end break the order: those
  // before its first free slot are taken out first and put back last.
  std::vector<std::pair<int64_t, int64_t>> wrapped;  // (key, tag)
  int64_t first_free = 0;
  for (; first_free < old_slots && s[2 * first_free + 1] >= 0; ++first_free) {
    wrapped.emplace_back(s[2 * first_free], s[2 * first_free + 1]);
    s[2 * first_free + 1] = -1;
  }
  auto put_back = [&](int64_t key, int64_t tag) {
    const int64_t ns = tag_ns(tag);
    const int64_t slot = table.probe(table.home(ns, key), ns, key);
    s[2 * slot] = key;
    s[2 * slot + 1] = tag;
  };
  for (int64_t slot = first_free; slot < old_slots; ++slot) {
    const int64_t tag = s[2 * slot + 1];
    if (tag < 0) continue;
    s[2 * slot + 1] = -1;
    put_back(s[2 * slot], tag);
  }
  for (const auto& [key, tag] : wrapped) put_back(key, tag);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> key_index_entries(const at::Tensor& table_t) {
  Table table(table_t);
  std::vector<int64_t> ns, keys, rows;
  for (int64_t slot = 0; slot <= table.mask; ++slot) {
    const int64_t tag = table.slots[2 * slot + 1];
    if (tag < 0) continue;
    ns.push_back(tag_ns(tag));
    keys.push_back(table.slots[2 * slot]);
    rows.push_back(tag & kRowMask);
  }
  auto tensor = [](const std::vector<int64_t>& v) {
    at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kLong);
    std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
    return t;
  };
  return {tensor(ns), tensor(keys), tensor(rows)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deeprec, m) {
  m.def("key_index_find(Tensor(a!)[] tables, Tensor(b!)[] row_keys, Tensor(c!)[] freqs, Tensor[] ns, Tensor[] keys, "
        "Tensor[] counts, int[] sizes, bool insert, bool dedup) -> (Tensor[], Tensor[], Tensor[], Tensor)");
  m.def("key_index_assign(Tensor(a!) table, Tensor ns, Tensor keys, Tensor rows) -> int");
  m.def("key_index_remove(Tensor(a!) table, Tensor ns, Tensor keys) -> int");
  m.def("key_index_grow(Tensor(a!) table, int old_slots) -> ()");
  m.def("key_index_entries(Tensor table) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(deeprec, CPU, m) {
  m.impl("key_index_find", key_index_find);
  m.impl("key_index_assign", key_index_assign);
  m.impl("key_index_remove", key_index_remove);
  m.impl("key_index_grow", key_index_grow);
  m.impl("key_index_entries", key_index_entries);
}

}  // namespace deeprec
