// The PS arena's row work around its key index (deeprec/distributed/ps/store.py, EmbeddingArena),
// one pass each and without the GIL, where a composition of torch ops made ~8 passes:
//
//   ps_init_rows(fresh, ns, keys, start, row_ns, weight, version, step, slots, slot_values,
//                defaults, offset, count) -> ()
//     rows start, start + 1, ... were just created (by key_index_find) for the places `fresh`
//     of (ns, keys). Row start + j, of place p = fresh[j] and variable v = ns[p], gets:
//       row_ns = v;  weight = defaults[offset[v] + keys[p] mod count[v]] (Python's mod);
//       version = step;  each slot (float [R, dim] or [R]) = its slot_values entry
//   ps_gather_rows(weight, rows, out) -> ()
//     out[i] = weight[rows[i]], zeros where rows[i] < 0; rows are prefetched ahead so that
//     the cache misses of a gather from a large arena overlap
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace deeprec {
namespace {

constexpr int64_t kAhead = 8;  // rows prefetched ahead of the copy

void check(bool ok, const char* op, const char* what) { TORCH_CHECK(ok, op, ": ", what); }

bool longs(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous();
}

bool float_rows(const at::Tensor& t) {  // float [R, dim] with contiguous rows
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1 &&
         t.stride(0) == t.size(1);
}

void ps_init_rows(const at::Tensor& fresh, const at::Tensor& ns, const at::Tensor& keys, int64_t start,
                  const at::Tensor& row_ns, const at::Tensor& weight, const at::Tensor& version, int64_t step,
                  const std::vector<at::Tensor>& slots, at::ArrayRef<double> slot_values, const at::Tensor& defaults,
                  const at::Tensor& offset, const at::Tensor& count) {
  const char* op = "ps_init_rows";
  check(longs(fresh) && longs(ns) && longs(keys) && longs(row_ns) && longs(version) && longs(offset) &&
            longs(count),
        op, "fresh, ns, keys, row_ns, version, offset and count must be contiguous 1-D int64 CPU tensors");
  check(ns.numel() == keys.numel(), op, "ns and keys must have one entry per place");
  check(float_rows(weight) && float_rows(defaults) && defaults.size(1) == weight.size(1), op,
        "weight and defaults must be float32 [rows, dim] of one dim with contiguous rows");
  check(offset.numel() == count.numel(), op, "offset and count must have one entry per variable");
  check(slots.size() == slot_values.size(), op, "slot_values must give one value per slot");
  const int64_t n = fresh.numel(), dim = weight.size(1), places = keys.numel();
  const int64_t end = start + n;
  check(start >= 0 && end <= weight.size(0) && end <= row_ns.numel() && end <= version.numel(), op,
        "the new rows must fit row_ns, weight and version");
  for (const at::Tensor& s : slots) {
    check(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.is_contiguous() && s.size(0) >= end &&
              (s.dim() == 1 || (s.dim() == 2 && s.size(1) == dim)),
          op, "each slot must be a contiguous float32 [R, dim] or [R] tensor holding the new rows");
  }
  if (n == 0) return;
  const int64_t* f = fresh.data_ptr<int64_t>();
  const int64_t* v = ns.data_ptr<int64_t>();
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* off = offset.data_ptr<int64_t>();
  const int64_t* cnt = count.data_ptr<int64_t>();
  const int64_t variables = offset.numel(), spans = defaults.size(0);
  for (int64_t j = 0; j < n; ++j) {  // every argument checked before anything is written
    check(f[j] >= 0 && f[j] < places, op, "a fresh place is out of range of the keys");
    const int64_t var = v[f[j]];
    check(var >= 0 && var < variables, op, "a variable id is out of range of offset and count");
    check(cnt[var] > 0 && off[var] >= 0 && off[var] + cnt[var] <= spans, op,
          "a variable's initializer span is empty or outside defaults");
  }
  const float* init = defaults.data_ptr<float>();
  float* w = weight.data_ptr<float>();
  int64_t* rn = row_ns.data_ptr<int64_t>();
  int64_t* ver = version.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t p = f[j], var = v[p], m = cnt[var];
    const int64_t pick = off[var] + ((k[p] % m) + m) % m;
    std::memcpy(w + (start + j) * dim, init + pick * dim, dim * sizeof(float));
    rn[start + j] = var;
    ver[start + j] = step;
  }
  for (size_t s = 0; s < slots.size(); ++s) {
    const int64_t width = slots[s].dim() == 2 ? dim : 1;
    float* data = slots[s].data_ptr<float>();
    std::fill(data + start * width, data + end * width, static_cast<float>(slot_values[s]));
  }
}

template <int64_t D>
void gather(const float* w, const int64_t* r, int64_t n, int64_t dim, float* out) {
  const int64_t width = D > 0 ? D : dim;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n && r[i + kAhead] >= 0) __builtin_prefetch(w + r[i + kAhead] * width);
    if (r[i] >= 0) {
      std::memcpy(out, w + r[i] * width, width * sizeof(float));  // a constant size for D > 0: inlined
    } else {
      std::fill(out, out + width, 0.0f);
    }
    out += width;
  }
}

void ps_gather_rows(const at::Tensor& weight, const at::Tensor& rows, const at::Tensor& out) {
  const char* op = "ps_gather_rows";
  check(float_rows(weight), op, "weight must be a float32 [R, dim] CPU tensor with contiguous rows");
  check(longs(rows), op, "rows must be a contiguous 1-D int64 CPU tensor");
  const int64_t n = rows.numel(), dim = weight.size(1);
  check(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
            out.size(0) == n && out.size(1) == dim,
        op, "out must be a contiguous float32 [len(rows), dim] tensor");
  if (n == 0) return;
  const int64_t* r = rows.data_ptr<int64_t>();
  int64_t hi = -1;
  for (int64_t i = 0; i < n; ++i) hi = std::max(hi, r[i]);
  check(hi < weight.size(0), op, "a row is out of range of weight");
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  switch (dim) {
    case 8: return gather<8>(w, r, n, dim, o);
    case 16: return gather<16>(w, r, n, dim, o);
    case 32: return gather<32>(w, r, n, dim, o);
    case 64: return gather<64>(w, r, n, dim, o);
    default: return gather<0>(w, r, n, dim, o);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deeprec, m) {
  m.def("ps_init_rows(Tensor fresh, Tensor ns, Tensor keys, int start, Tensor(a!) row_ns, Tensor(b!) weight, "
        "Tensor(c!) version, int step, Tensor(d!)[] slots, float[] slot_values, Tensor defaults, Tensor offset, "
        "Tensor count) -> ()");
  m.def("ps_gather_rows(Tensor weight, Tensor rows, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(deeprec, CPU, m) {
  m.impl("ps_init_rows", ps_init_rows);
  m.impl("ps_gather_rows", ps_gather_rows);
}

}  // namespace deeprec
