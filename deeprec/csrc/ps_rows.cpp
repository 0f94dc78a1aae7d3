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
//   ps_request_ns(keys, counts, ids, num_shards, shard, partition_mod) -> (ns, status)
//     a request's keys checked in one pass (deeprec/distributed/ps/state.py, _rows_request):
//     ns = ids[v] repeated counts[v] times (each key's variable id); status int64 [3] =
//     (1 if every count is >= 0 and they sum to the keys, else 0 (ns then empty); the first
//     negative key's position or -1; the first position of a key another shard owns, key mod
//     partition_mod mod num_shards != shard, or -1)
//   ps_finite_prefix(t) -> int
//     how many of t's elements (flat) come before its first nan or inf: t.numel() if it has
//     none (a float32 tensor: one vectorized pass over its bits)
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
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

std::tuple<at::Tensor, at::Tensor> ps_request_ns(const at::Tensor& keys, const at::Tensor& counts,
                                                 const at::Tensor& ids, int64_t num_shards, int64_t shard,
                                                 int64_t partition_mod) {
  const char* op = "ps_request_ns";
  check(longs(keys) && longs(counts) && longs(ids), op, "keys, counts and ids must be contiguous 1-D int64 CPU tensors");
  check(counts.numel() == ids.numel(), op, "ids must give one id per count");
  check(num_shards >= 1 && shard >= 0 && shard < num_shards && partition_mod >= 1, op,
        "shard must be in [0, num_shards) and partition_mod >= 1");
  at::Tensor status = at::empty({3}, keys.options());
  int64_t* st = status.data_ptr<int64_t>();
  const int64_t n = keys.numel(), vars = counts.numel();
  const int64_t* c = counts.data_ptr<int64_t>();
  int64_t total = 0;
  bool fits = true;
  for (int64_t v = 0; v < vars && fits; ++v) {
    fits = c[v] >= 0 && c[v] <= n - total;
    total += fits ? c[v] : 0;
  }
  st[0] = fits && total == n;
  st[1] = st[2] = -1;
  if (!st[0]) return {at::empty({0}, keys.options()), status};
  at::Tensor ns = at::empty({n}, keys.options());
  int64_t* out = ns.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t v = 0, at = 0; v < vars; at += c[v], ++v) std::fill(out + at, out + at + c[v], id[v]);
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t low = 0;
  for (int64_t i = 0; i < n; ++i) low = std::min(low, k[i]);  // branch-free: it vectorizes
  if (low < 0) {
    st[1] = std::find_if(k, k + n, [](int64_t key) { return key < 0; }) - k;
  } else if (num_shards > 1) {
    for (int64_t i = 0; i < n; ++i) {
      if (k[i] % partition_mod % num_shards != shard) {
        st[2] = i;
        break;
      }
    }
  }
  return {ns, status};
}

#define DEEPREC_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

DEEPREC_CPU_CLONES
bool all_finite(const uint32_t* bits, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= (bits[i] & 0x7f800000u) == 0x7f800000u;  // exponent all ones: inf, nan
  return bad == 0;
}

int64_t ps_finite_prefix(const at::Tensor& t) {
  check(t.device().is_cpu(), "ps_finite_prefix", "t must be a CPU tensor");
  if (t.scalar_type() != at::kFloat || !t.is_contiguous()) {  // another float dtype: ATen's isfinite
    const at::Tensor bad = at::logical_not(at::isfinite(t)).reshape(-1).nonzero();
    return bad.numel() ? bad[0][0].item<int64_t>() : t.numel();
  }
  const int64_t n = t.numel();
  static_assert(sizeof(float) == sizeof(uint32_t), "float32 is 4 bytes");
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(t.data_ptr<float>());
  constexpr int64_t kChunk = 1 << 14;
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t m = std::min(kChunk, n - at);
    if (all_finite(bits + at, m)) continue;
    for (int64_t i = at; i < at + m; ++i) {
      if ((bits[i] & 0x7f800000u) == 0x7f800000u) return i;
    }
  }
  return n;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deeprec, m) {
  m.def("ps_init_rows(Tensor fresh, Tensor ns, Tensor keys, int start, Tensor(a!) row_ns, Tensor(b!) weight, "
        "Tensor(c!) version, int step, Tensor(d!)[] slots, float[] slot_values, Tensor defaults, Tensor offset, "
        "Tensor count) -> ()");
  m.def("ps_gather_rows(Tensor weight, Tensor rows, Tensor(a!) out) -> ()");
  m.def("ps_request_ns(Tensor keys, Tensor counts, Tensor ids, int num_shards, int shard, int partition_mod) "
        "-> (Tensor, Tensor)");
  m.def("ps_finite_prefix(Tensor t) -> int");
}

TORCH_LIBRARY_IMPL(deeprec, CPU, m) {
  m.impl("ps_init_rows", ps_init_rows);
  m.impl("ps_gather_rows", ps_gather_rows);
  m.impl("ps_request_ns", ps_request_ns);
  m.impl("ps_finite_prefix", ps_finite_prefix);
}

}  // namespace deeprec
