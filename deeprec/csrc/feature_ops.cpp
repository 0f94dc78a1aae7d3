// deeprec's native feature ops: torch custom ops (namespace `deeprec`) that run
// without the GIL (torch.ops releases it around the dispatcher call).
//
//   string column = (values uint8 [N bytes], offsets int64 [B + 1]): Arrow's binary layout;
//   string b is values[offsets[b] : offsets[b + 1]].
//
//   string_to_hash_bucket(values[], offsets[], num_buckets[], hash) -> int64 [B] each: hash % num_buckets
//   string_to_hash_key(values[], offsets[], hash)                   -> int64 [B] each: hash >> 1 (63-bit key)
//     (many columns per call: one dispatch for all of a model's features)
//   cross_hash_bucket(values[], offsets[], num_buckets, separator, hash) -> int64 [B]
//   bucketize(x, boundaries)                                  -> int64      (TF Bucketize; NaN -> last)
//   dedup(ids)                                                -> (sorted unique, inverse)
//
// hash = "siphash": SipHash-2-4 with key "0123456789123456" then the splitmix64
//        finalizer (= pandas.util.hash_array(categorize=False): deeprec's hash since 0.1);
//        "farmhash": FarmHash Fingerprint64 (farmhashna::Hash64), TensorFlow's
//        tf.strings.to_hash_bucket_fast.
// Other devices: the CPU kernels run on a host copy (the stage runs on CPU by design).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "hashes.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace deeprec {
namespace {

using namespace hashes;

// ---- string columns --------------------------------------------------------------------
enum class Hash { kSip, kFarm };

Hash parse_hash(c10::string_view name) {
  if (name == "siphash") return Hash::kSip;
  if (name == "farmhash") return Hash::kFarm;
  TORCH_CHECK(false, "hash must be 'siphash' or 'farmhash', got '", std::string(name), "'");
}

inline uint64_t hash_one(Hash h, const uint8_t* s, size_t len) {
  return h == Hash::kSip ? siphash_pandas(s, len) : farm_fingerprint64(s, len);
}

// x % d without a division instruction (Lemire, Kaser & Kurz 2019, "Faster remainder by
// direct computation"): exact for every 64-bit x and d >= 1.
struct FastMod {
  uint64_t d;
  __uint128_t m;
  explicit FastMod(uint64_t divisor) : d(divisor), m(~static_cast<__uint128_t>(0) / divisor + 1) {}
  uint64_t operator()(uint64_t x) const {
    const __uint128_t low = m * x;
    const __uint128_t bottom = (static_cast<__uint128_t>(static_cast<uint64_t>(low)) * d) >> 64;
    return static_cast<uint64_t>((bottom + static_cast<__uint128_t>(static_cast<uint64_t>(low >> 64)) * d) >> 64);
  }
};

constexpr int64_t kStringGrain = 4096;  // strings per task: below this, threads cost more than they save

struct StringColumn {
  const uint8_t* bytes;
  const int64_t* offsets;
  int64_t rows;
  at::Tensor keep_values, keep_offsets;  // host copies kept alive

  const uint8_t* at(int64_t i) const { return bytes + offsets[i]; }
  size_t size(int64_t i) const { return static_cast<size_t>(offsets[i + 1] - offsets[i]); }
};

StringColumn string_column(const at::Tensor& values, const at::Tensor& offsets, const char* what) {
  TORCH_CHECK(values.scalar_type() == at::kByte && values.dim() == 1, what,
              ": string values must be a 1-D uint8 tensor (Arrow binary layout), got ", values.scalar_type(),
              " of shape ", values.sizes());
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.numel() >= 1, what,
              ": string offsets must be a 1-D int64 tensor of rows + 1 entries, got ", offsets.scalar_type(),
              " of shape ", offsets.sizes());
  StringColumn col;
  col.keep_values = values.cpu().contiguous();
  col.keep_offsets = offsets.cpu().contiguous();
  col.bytes = col.keep_values.data_ptr<uint8_t>();
  col.offsets = col.keep_offsets.data_ptr<int64_t>();
  col.rows = offsets.numel() - 1;
  const int64_t n = values.numel();
  // Validate before the parallel loop reads: a branch-free pass (it vectorizes); the failing
  // row is searched for only to word the error.
  const int64_t* off = col.offsets;
  bool ok = col.rows == 0 || (off[0] >= 0 && off[col.rows] <= n);
  for (int64_t i = 0; i < col.rows; ++i) ok &= off[i] <= off[i + 1];
  if (!ok) {
    for (int64_t i = 0; i < col.rows; ++i) {
      TORCH_CHECK(off[i] >= 0 && off[i] <= off[i + 1] && off[i + 1] <= n, what,
                  ": offsets must be non-decreasing within [0, ", n, "]; row ", i, " spans [", off[i], ", ",
                  off[i + 1], ")");
    }
  }
  return col;
}

// Raw SipHash of rows [begin, end): groups of kLanes strings through the vector lanes, their
// message words gathered for kGroups groups at a time; strings too long for the word buffer
// (and the last few rows) hashed one by one.
void siphash_rows(const StringColumn& c, int64_t begin, int64_t end, uint64_t* out) {
  constexpr int kGroups = 8;
  constexpr size_t kMaxWords = 8;  // strings of up to 56 bytes
  alignas(64) uint64_t words[kGroups][kMaxWords][kLanes];
  alignas(64) uint64_t nwords[kGroups][kLanes];
  size_t max_words[kGroups];
  int64_t i = begin;
  while (i + kLanes <= end) {
    const int64_t first = i;
    int groups = 0;
    for (; groups < kGroups && i + kLanes <= end; ++groups, i += kLanes) {
      size_t most = 0;
      for (int l = 0; l < kLanes; ++l) most = std::max(most, c.size(i + l) / 8 + 1);
      max_words[groups] = most;
      if (most > kMaxWords) continue;
      for (int l = 0; l < kLanes; ++l) {
        const size_t len = c.size(i + l), n = len / 8 + 1;
        nwords[groups][l] = n;
        for (size_t j = 0; j < most; ++j) words[groups][j][l] = j < n ? message_word(c.at(i + l), len, j) : 0;
      }
    }
    for (int g = 0; g < groups; ++g) {
      const int64_t row = first + g * kLanes;
      if (max_words[g] > kMaxWords) {
        for (int l = 0; l < kLanes; ++l) out[row + l - begin] = siphash_pandas(c.at(row + l), c.size(row + l));
      } else {
        siphash_lanes(words[g], nwords[g], max_words[g], out + (row - begin));
      }
    }
  }
  for (; i < end; ++i) out[i - begin] = siphash_pandas(c.at(i), c.size(i));
}

// Raw 64-bit hashes of rows [begin, end) of a column.
void hash_rows(const StringColumn& c, int64_t begin, int64_t end, Hash h, uint64_t* out) {
  if (h == Hash::kSip) return siphash_rows(c, begin, end, out);
  for (int64_t i = begin; i < end; ++i) out[i - begin] = farm_fingerprint64(c.at(i), c.size(i));
}

// Hashes every column into int64 [rows] tensors; `finish(k, raw)` maps column k's raw hash.
template <typename Finish>
std::vector<at::Tensor> hash_columns(at::TensorList values, at::TensorList offsets, Hash h, const char* what,
                                     Finish&& finish) {
  TORCH_CHECK(values.size() == offsets.size(), what, ": ", values.size(), " values tensors but ", offsets.size(),
              " offsets tensors");
  std::vector<StringColumn> cols;
  std::vector<at::Tensor> outs;
  int64_t total = 0;
  for (size_t k = 0; k < values.size(); ++k) {
    cols.push_back(string_column(values[k], offsets[k], what));
    outs.push_back(at::empty({cols[k].rows}, cols[k].keep_offsets.options()));
    total += cols[k].rows;
  }
  const int64_t n = static_cast<int64_t>(cols.size());
  const int64_t grain = std::max<int64_t>(1, kStringGrain * n / std::max<int64_t>(total, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      auto* dst = reinterpret_cast<uint64_t*>(outs[k].data_ptr<int64_t>());
      hash_rows(cols[k], 0, cols[k].rows, h, dst);
      for (int64_t i = 0; i < cols[k].rows; ++i) dst[i] = finish(k, dst[i]);
    }
  });
  for (size_t k = 0; k < outs.size(); ++k) outs[k] = outs[k].to(offsets[k].device());
  return outs;
}

std::vector<at::Tensor> string_to_hash_bucket(at::TensorList values, at::TensorList offsets,
                                              at::IntArrayRef num_buckets, c10::string_view hash) {
  TORCH_CHECK(num_buckets.size() == values.size(), "string_to_hash_bucket: ", num_buckets.size(),
              " num_buckets for ", values.size(), " columns");
  std::vector<FastMod> mods;
  for (int64_t n : num_buckets) {
    TORCH_CHECK(n >= 1, "string_to_hash_bucket: num_buckets must be >= 1, got ", n);
    mods.emplace_back(static_cast<uint64_t>(n));
  }
  return hash_columns(values, offsets, parse_hash(hash), "string_to_hash_bucket",
                      [&mods](int64_t k, uint64_t raw) { return mods[k](raw); });
}

std::vector<at::Tensor> string_to_hash_key(at::TensorList values, at::TensorList offsets, c10::string_view hash) {
  return hash_columns(values, offsets, parse_hash(hash), "string_to_hash_key",
                      [](int64_t, uint64_t raw) { return raw >> 1; });
}

at::Tensor cross_hash_bucket(at::TensorList values, at::TensorList offsets, int64_t num_buckets,
                             c10::string_view separator, c10::string_view hash) {
  TORCH_CHECK(num_buckets >= 1, "cross_hash_bucket: num_buckets must be >= 1, got ", num_buckets);
  TORCH_CHECK(values.size() >= 2 && values.size() == offsets.size(),
              "cross_hash_bucket needs at least 2 string columns (values and offsets alike), got ", values.size(),
              " values and ", offsets.size(), " offsets");
  const Hash h = parse_hash(hash);
  std::vector<StringColumn> cols;
  for (size_t k = 0; k < values.size(); ++k) {
    cols.push_back(string_column(values[k], offsets[k], "cross_hash_bucket"));
    TORCH_CHECK(cols[k].rows == cols[0].rows, "cross_hash_bucket: column ", k, " has ", cols[k].rows,
                " rows, column 0 has ", cols[0].rows);
  }
  const int64_t rows = cols[0].rows;
  const std::string sep(separator);
  at::Tensor out = at::empty({rows}, cols[0].keep_offsets.options());
  int64_t* dst = out.data_ptr<int64_t>();
  const FastMod mod(static_cast<uint64_t>(num_buckets));
  at::parallel_for(0, rows, kStringGrain / 4, [&](int64_t begin, int64_t end) {
    std::string crossed;  // row i: cols[0][i] + sep + cols[1][i] + ...
    for (int64_t i = begin; i < end; ++i) {
      crossed.clear();
      for (size_t k = 0; k < cols.size(); ++k) {
        if (k) crossed += sep;
        crossed.append(reinterpret_cast<const char*>(cols[k].at(i)), cols[k].size(i));
      }
      dst[i] = static_cast<int64_t>(mod(hash_one(h, reinterpret_cast<const uint8_t*>(crossed.data()), crossed.size())));
    }
  });
  return out.to(offsets[0].device());
}

// ---- numbers -----------------------------------------------------------------------------
at::Tensor bucketize(const at::Tensor& x, const at::Tensor& boundaries) {
  TORCH_CHECK(boundaries.dim() == 1, "bucketize: boundaries must be 1-D, got shape ", boundaries.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "bucketize: x must be a floating tensor, got ", x.scalar_type());
  at::Tensor xs = x.cpu().contiguous().to(at::kDouble);
  at::Tensor bs = boundaries.cpu().contiguous().to(at::kDouble);
  const double* b = bs.data_ptr<double>();
  const int64_t nb = bs.numel();
  for (int64_t i = 1; i < nb; ++i)
    TORCH_CHECK(b[i] > b[i - 1], "bucketize: boundaries must be strictly increasing; boundaries[", i,
                "] = ", b[i], " <= boundaries[", i - 1, "] = ", b[i - 1]);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kLong).device(at::kCPU));
  const double* src = xs.data_ptr<double>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, xs.numel(), 1 << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // number of boundaries <= x; NaN sorts last
      dst[i] = std::isnan(src[i]) ? nb : std::upper_bound(b, b + nb, src[i]) - b;
    }
  });
  return out.to(x.device());
}

std::tuple<at::Tensor, at::Tensor> dedup(const at::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, "dedup: ids must be int64, got ", ids.scalar_type());
  at::Tensor flat = ids.cpu().contiguous().reshape({-1});
  const int64_t n = flat.numel();
  const int64_t* src = flat.data_ptr<int64_t>();
  std::vector<int64_t> sorted(src, src + n);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  at::Tensor unique = at::empty({static_cast<int64_t>(sorted.size())}, flat.options());
  std::copy(sorted.begin(), sorted.end(), unique.data_ptr<int64_t>());
  at::Tensor inverse = at::empty(ids.sizes(), flat.options());
  int64_t* inv = inverse.data_ptr<int64_t>();
  const int64_t* u = sorted.data();
  const int64_t nu = static_cast<int64_t>(sorted.size());
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) inv[i] = std::lower_bound(u, u + nu, src[i]) - u;
  });
  return {unique.to(ids.device()), inverse.to(ids.device())};
}

}  // namespace

TORCH_LIBRARY(deeprec, m) {
  m.def("string_to_hash_bucket(Tensor[] values, Tensor[] offsets, int[] num_buckets, str hash) -> Tensor[]");
  m.def("string_to_hash_key(Tensor[] values, Tensor[] offsets, str hash) -> Tensor[]");
  m.def("cross_hash_bucket(Tensor[] values, Tensor[] offsets, int num_buckets, str separator, str hash) -> Tensor");
  m.def("bucketize(Tensor x, Tensor boundaries) -> Tensor");
  m.def("dedup(Tensor ids) -> (Tensor, Tensor)");
}

// The same kernels for CPU and CUDA inputs: non-CPU inputs are computed on a host copy (see the header).
#define DEEPREC_REGISTER_KERNELS(m)                            \
  m.impl("string_to_hash_bucket", string_to_hash_bucket);      \
  m.impl("string_to_hash_key", string_to_hash_key);            \
  m.impl("cross_hash_bucket", cross_hash_bucket);              \
  m.impl("bucketize", bucketize);                              \
  m.impl("dedup", dedup);

TORCH_LIBRARY_IMPL(deeprec, CPU, m) { DEEPREC_REGISTER_KERNELS(m) }
TORCH_LIBRARY_IMPL(deeprec, CUDA, m) { DEEPREC_REGISTER_KERNELS(m) }

}  // namespace deeprec
