// The EmbeddingVariables' fused lookup: for many variables in one call (a collection's, or one
// free variable's), find or insert every key (key_index.h), give each new row its initial
// value, version and dirty flag, count frequencies, and gather every row's values into one
// output. Runs without the GIL (torch.ops releases it); the callers hold the variables' locks.
//
//   ev_lookup(tables, row_keys, freqs, weights, versions, dirty, defaults, keys, counts, sizes,
//             steps, no_permission, insert, dedup) -> (values, rows, inverse, stats)
//     part i: a variable's index table, its row arrays (keys, freq, weight [R, D], version,
//             dirty), its initializer matrix defaults [M, D] (a new key k starts as row k % M),
//             the keys looked up and their counts (empty: 1 each), its rows held (sizes[i]), its
//             global step, and the value read for a key not held (no_permission[i])
//     values  float [sum of places, D]: every part's places in order (dedup: distinct keys)
//     rows[i], inverse[i]    as key_index_find's
//     stats   int64 [parts, 4]: (places not held, repeated positions, places, rows created)
#include "key_index.h"

namespace deeprec {
namespace {

using namespace key_index;

void check_rows(const at::Tensor& t, at::ScalarType dtype, int64_t rows, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.size(0) >= rows,
              "ev_lookup: ", what, " must be a contiguous CPU tensor of ", c10::toString(dtype), " with at least ",
              rows, " rows");
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor> ev_lookup(
    const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& row_keys,
    const std::vector<at::Tensor>& freqs, const std::vector<at::Tensor>& weights,
    const std::vector<at::Tensor>& versions, const std::vector<at::Tensor>& dirty,
    const std::vector<at::Tensor>& defaults, const std::vector<at::Tensor>& keys,
    const std::vector<at::Tensor>& counts, at::IntArrayRef sizes, at::IntArrayRef steps,
    at::ArrayRef<double> no_permission, bool insert, bool dedup) {
  const size_t parts = tables.size();
  TORCH_CHECK(parts > 0 && row_keys.size() == parts && freqs.size() == parts && weights.size() == parts &&
                  versions.size() == parts && dirty.size() == parts && defaults.size() == parts &&
                  keys.size() == parts && counts.size() == parts && sizes.size() == parts &&
                  steps.size() == parts && no_permission.size() == parts,
              "ev_lookup: every argument must have one entry per variable");
  const int64_t dim = weights[0].size(1);
  const at::Tensor none = at::empty({0}, at::kLong);  // no freq counted (not inserting), namespace 0
  std::vector<Part> found;
  found.reserve(parts);
  int64_t total = 0;
  at::Tensor stats = at::empty({static_cast<int64_t>(parts), 4}, at::kLong);
  int64_t* sp = stats.data_ptr<int64_t>();
  for (size_t p = 0; p < parts; ++p) {
    TORCH_CHECK(weights[p].dim() == 2 && weights[p].size(1) == dim && defaults[p].dim() == 2 &&
                    defaults[p].size(1) == dim && defaults[p].size(0) > 0,
                "ev_lookup: every variable's weight and initializer must be [rows, ", dim, "]");
    const int64_t size = sizes[p];
    const int64_t needed = insert ? size + keys[p].numel() : size;
    check_rows(weights[p], at::kFloat, needed, "weight");
    check_rows(defaults[p], at::kFloat, 1, "the initializer");
    if (insert) {
      check_rows(versions[p], at::kLong, needed, "version");
      check_rows(dirty[p], at::kBool, needed, "dirty");
    }
    Part part = find_part(tables[p], row_keys[p], insert ? freqs[p] : none, none, keys[p], counts[p], size, insert,
                          dedup);
    const int64_t created = part.fresh.numel();
    if (created) {  // new rows are size, size + 1, ...: initial values, version, dirty
      const int64_t* rk = row_keys[p].data_ptr<int64_t>();
      const float* init = defaults[p].data_ptr<float>();
      const int64_t m = defaults[p].size(0);
      float* w = weights[p].data_ptr<float>();
      int64_t* version = versions[p].data_ptr<int64_t>();
      bool* flag = dirty[p].data_ptr<bool>();
      for (int64_t row = size; row < size + created; ++row) {
        const int64_t pick = ((rk[row] % m) + m) % m;  // Python's remainder: never negative
        std::copy(init + pick * dim, init + (pick + 1) * dim, w + row * dim);
        version[row] = steps[p];
        flag[row] = true;
      }
    }
    sp[4 * p] = part.missing;
    sp[4 * p + 1] = part.repeated;
    sp[4 * p + 2] = part.rows.numel();
    sp[4 * p + 3] = created;
    total += part.rows.numel();
    found.push_back(std::move(part));
  }
  at::Tensor values = at::empty({total, dim}, weights[0].options());
  float* out = values.data_ptr<float>();
  std::vector<at::Tensor> rows, inverse;
  constexpr int64_t kAhead = 8;  // rows prefetched ahead: the gather's misses overlap
  for (size_t p = 0; p < parts; ++p) {
    const float* w = weights[p].data_ptr<float>();
    const int64_t* r = found[p].rows.data_ptr<int64_t>();
    const int64_t n = found[p].rows.numel();
    const float missing = static_cast<float>(no_permission[p]);
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n && r[i + kAhead] >= 0) __builtin_prefetch(w + r[i + kAhead] * dim);
      if (r[i] >= 0) {
        std::copy(w + r[i] * dim, w + (r[i] + 1) * dim, out);
      } else {
        std::fill(out, out + dim, missing);
      }
      out += dim;
    }
    rows.push_back(std::move(found[p].rows));
    inverse.push_back(std::move(found[p].inverse));
  }
  return {values, rows, inverse, stats};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deeprec, m) {
  m.def("ev_lookup(Tensor(a!)[] tables, Tensor(b!)[] row_keys, Tensor(c!)[] freqs, Tensor(d!)[] weights, "
        "Tensor(e!)[] versions, Tensor(f!)[] dirty, Tensor[] defaults, Tensor[] keys, Tensor[] counts, int[] sizes, "
        "int[] steps, float[] no_permission, bool insert, bool dedup) -> (Tensor, Tensor[], Tensor[], Tensor)");
}

TORCH_LIBRARY_IMPL(deeprec, CPU, m) { m.impl("ev_lookup", ev_lookup); }

}  // namespace deeprec
