// prepare_bags: the data side of the fused embedding lookup, for all features in one op.
//
//   per feature f: ids (flat int64 values; offsets [B + 1], or none: one id per row / a fixed width)
//     prune ids < 0 -> fill an empty bag with fill_id (when given) -> sorted unique keys, counts
//   all features: inverse into the concatenated uniques, bag offsets [F * B + 1] (feature-major),
//     per-id weights of the combiner (sum 1, mean 1/n, sqrtn 1/sqrt(n); float32, as torch computes them)
//
// Same outputs as the composition of torch ops it replaces (tests/test_embedding.py checks it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <vector>

namespace deeprec {
namespace {

enum Combiner : int64_t { kSum = 0, kMean = 1, kSqrtn = 2 };

struct FeatureBags {
  std::vector<int64_t> values, bag_of;  // kept ids in bag order, and the bag of each
  std::vector<int64_t> lengths;         // ids per bag after pruning and filling
  std::vector<int64_t> unique, counts, inverse;
};

// (key, index in keys) sorted by key. An LSD radix sort, 8 bits a pass, passes where every key has
// the same byte skipped: std::sort's comparisons mispredicted on random keys and took most of the op
// (hashed ids: 63-bit keys, 8 passes; small id ranges: 1-2).
std::vector<std::pair<int64_t, int64_t>> sorted_with_index(const std::vector<int64_t>& keys) {
  const size_t n = keys.size();
  std::vector<std::pair<int64_t, int64_t>> a(n), b(n);
  for (size_t i = 0; i < n; ++i) a[i] = {keys[i], static_cast<int64_t>(i)};
  if (n < 64 || n > UINT32_MAX) {  // few keys; or more than the 32-bit counts hold
    std::sort(a.begin(), a.end());
    return a;
  }
  constexpr uint64_t kSign = 1ULL << 63;  // signed order: the sign bit flipped
  std::vector<std::array<uint32_t, 256>> counts(8);
  for (auto& c : counts) c.fill(0);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t k = static_cast<uint64_t>(keys[i]) ^ kSign;
    for (int d = 0; d < 8; ++d) ++counts[d][(k >> (8 * d)) & 0xff];
  }
  for (int d = 0; d < 8; ++d) {
    auto& c = counts[d];
    if (std::find(c.begin(), c.end(), static_cast<uint32_t>(n)) != c.end()) continue;  // one byte value for all
    uint32_t start = 0;
    for (auto& slot : c) {
      const uint32_t here = slot;
      slot = start;
      start += here;
    }
    for (size_t i = 0; i < n; ++i) {
      const uint64_t k = static_cast<uint64_t>(a[i].first) ^ kSign;
      b[c[(k >> (8 * d)) & 0xff]++] = a[i];
    }
    a.swap(b);
  }
  return a;
}

void build_feature(const at::Tensor& values, const at::Tensor& offsets, int64_t batch, bool has_fill,
                   int64_t fill, FeatureBags& out, int64_t f) {
  const at::Tensor v = values.contiguous();
  const int64_t* ids = v.data_ptr<int64_t>();
  const int64_t n = v.numel();
  std::vector<int64_t> bounds(batch + 1);
  if (offsets.numel()) {
    TORCH_CHECK(offsets.numel() == batch + 1, "prepare_bags: feature ", f, " has ", offsets.numel() - 1,
                " rows, feature 0 has ", batch);
    const at::Tensor o = offsets.contiguous();
    const int64_t* off = o.data_ptr<int64_t>();
    for (int64_t b = 0; b <= batch; ++b) bounds[b] = off[b] - off[0];
    TORCH_CHECK(bounds[batch] <= n, "prepare_bags: feature ", f, " offsets end at ", bounds[batch], " past its ",
                n, " ids");
  } else {
    TORCH_CHECK(batch > 0 ? n % batch == 0 : n == 0, "prepare_bags: feature ", f, " has ", n,
                " ids, not a multiple of the batch ", batch);
    const int64_t width = batch ? n / batch : 0;
    for (int64_t b = 0; b <= batch; ++b) bounds[b] = b * width;
  }
  out.lengths.assign(batch, 0);
  out.values.clear();
  out.bag_of.clear();
  out.values.reserve(n + batch);
  out.bag_of.reserve(n + batch);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = bounds[b]; i < bounds[b + 1]; ++i) {
      if (ids[i] >= 0) {  // prune invalid ids
        out.values.push_back(ids[i]);
        out.bag_of.push_back(b);
        ++out.lengths[b];
      }
    }
    if (out.lengths[b] == 0 && has_fill) {  // an empty bag looks up the default id
      out.values.push_back(fill);
      out.bag_of.push_back(b);
      out.lengths[b] = 1;
    }
  }
  // Dedup by an open-addressing hash table (first-seen order), then sort only the distinct
  // keys (radix: O(n + u)) and renumber, instead of sorting all n ids.
  const int64_t m = static_cast<int64_t>(out.values.size());
  size_t capacity = 16;
  while (capacity < 2 * static_cast<size_t>(m)) capacity <<= 1;
  std::vector<int64_t> slot_key(capacity), slot_index(capacity, -1);
  std::vector<int64_t> seen;  // distinct ids, first-seen order
  std::vector<int64_t> first_index(m);
  for (int64_t k = 0; k < m; ++k) {
    const int64_t id = out.values[k];
    uint64_t h = static_cast<uint64_t>(id) * 0x9e3779b97f4a7c15ULL;
    size_t pos = (h ^ (h >> 32)) & (capacity - 1);
    while (slot_index[pos] >= 0 && slot_key[pos] != id) pos = (pos + 1) & (capacity - 1);
    if (slot_index[pos] < 0) {
      slot_key[pos] = id;
      slot_index[pos] = static_cast<int64_t>(seen.size());
      seen.push_back(id);
    }
    first_index[k] = slot_index[pos];
  }
  const int64_t u = static_cast<int64_t>(seen.size());
  const std::vector<std::pair<int64_t, int64_t>> by_value = sorted_with_index(seen);
  std::vector<int64_t> rank(u);
  out.unique.resize(u);
  for (int64_t r = 0; r < u; ++r) {
    rank[by_value[r].second] = r;
    out.unique[r] = by_value[r].first;
  }
  out.counts.assign(u, 0);
  out.inverse.resize(m);
  for (int64_t k = 0; k < m; ++k) {
    out.inverse[k] = rank[first_index[k]];
    ++out.counts[out.inverse[k]];
  }
}

at::Tensor to_tensor(const std::vector<int64_t>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kLong);
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t;
}

// One flat list [uniques (F)..., inverse, offsets, weights, counts (F)...]: AOTInductor binds the
// unbacked sizes of a fallback op's outputs only in a flat list, not in a tuple holding lists.
std::vector<at::Tensor> prepare_bags(
    at::TensorList values, at::TensorList offsets, int64_t batch, at::IntArrayRef combiners,
    at::IntArrayRef fill_ids, at::IntArrayRef has_fill) {
  const int64_t features = static_cast<int64_t>(values.size());
  TORCH_CHECK(offsets.size() == values.size() && combiners.size() == values.size() &&
                  fill_ids.size() == values.size() && has_fill.size() == values.size(),
              "prepare_bags: values, offsets, combiners and fill ids need one entry per feature");
  for (int64_t f = 0; f < features; ++f) {
    TORCH_CHECK(values[f].scalar_type() == at::kLong && values[f].device().is_cpu(), "prepare_bags: feature ", f,
                " ids must be an int64 CPU tensor, got ", values[f].scalar_type(), " on ", values[f].device());
    TORCH_CHECK(combiners[f] >= kSum && combiners[f] <= kSqrtn, "prepare_bags: combiner code ", combiners[f]);
  }
  std::vector<FeatureBags> bags(features);
  at::parallel_for(0, features, 1, [&](int64_t begin, int64_t end) {
    for (int64_t f = begin; f < end; ++f)
      build_feature(values[f], offsets[f], batch, has_fill[f] != 0, fill_ids[f], bags[f], f);
  });
  std::vector<at::Tensor> uniques, counts;
  int64_t total = 0;
  for (const auto& fb : bags) total += static_cast<int64_t>(fb.values.size());
  at::Tensor inverse = at::empty({total}, at::kLong);
  at::Tensor weights = at::empty({total}, at::kFloat);
  at::Tensor bag_offsets = at::empty({features * batch + 1}, at::kLong);
  int64_t* inv = inverse.data_ptr<int64_t>();
  float* w = weights.data_ptr<float>();
  int64_t* off = bag_offsets.data_ptr<int64_t>();
  off[0] = 0;
  int64_t base = 0, pos = 0;
  for (int64_t f = 0; f < features; ++f) {
    const FeatureBags& fb = bags[f];
    for (int64_t b = 0; b < batch; ++b) off[f * batch + b + 1] = off[f * batch + b] + fb.lengths[b];
    for (size_t k = 0; k < fb.values.size(); ++k, ++pos) {
      inv[pos] = fb.inverse[k] + base;
      const float n = static_cast<float>(std::max<int64_t>(fb.lengths[fb.bag_of[k]], 1));
      w[pos] = combiners[f] == kSum ? 1.0f : combiners[f] == kMean ? 1.0f / n : 1.0f / std::sqrt(n);
    }
    base += static_cast<int64_t>(fb.unique.size());
    uniques.push_back(to_tensor(fb.unique));
    counts.push_back(to_tensor(fb.counts));
  }
  std::vector<at::Tensor> out(uniques);
  out.push_back(inverse);
  out.push_back(bag_offsets);
  out.push_back(weights);
  out.insert(out.end(), counts.begin(), counts.end());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deeprec, m) {
  m.def("prepare_bags(Tensor[] values, Tensor[] offsets, SymInt batch, int[] combiners, int[] fill_ids, "
        "int[] has_fill) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(deeprec, CPU, m) { m.impl("prepare_bags", prepare_bags); }

}  // namespace deeprec
