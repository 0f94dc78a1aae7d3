// Two ops of the training step that ATen runs as several generic kernels, each one pass here.
//
//   dot_interaction(x [B, N, D]) -> [B, N(N-1)/2]
//       DLRM's pairwise dots: out[b, p] = <x[b, i], x[b, j]> for the pairs i > j in
//       torch.tril_indices(N, N, -1)'s order. ATen: bmm to [B, N, N], then index_select of the
//       pairs; its backward zero-fills [B, N * N] and scatter-adds (at batch 512, N = 27: ~1.3 ms
//       a step of fresh pages, strided copies and two more bmm; here ~0.1 ms).
//   dot_interaction_backward(grad [B, P], x) -> [B, N, D]
//       dx[b, i] = sum over j != i of grad[b, pair(i, j)] * x[b, j], j ascending.
//   gather_rows(rows [U, D], index [*S]) -> [*S, D]              rows.index_select(0, index)
//   gather_rows_backward(grad [*S, D] of any strides, index, U) -> [U, D]
//       the sum of each row's gradients, in index order (index_add's order: the same values),
//       read in the layout autograd hands over (a transposed view), so nothing is copied first.
//
// dot_interaction: CPU tensors of float32 / bf16 / half, summed in float32 (converted there and back),
// each sample's dots over d ascending with no fused multiply-add (the build's -ffp-contract=off), so
// every ISA clone below computes the same bits; vectorized across independent outputs only. Other
// devices and dtypes take the ATen composition in deeprec/ops/step.py (under autocast, as any bmm).
// gather_rows: any device; its backward's one loop on CPU float32, index_add elsewhere.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "clones.h"

#include <algorithm>
#include <vector>

namespace deeprec {
namespace {

// 16 floats: one AVX-512 register; GCC/clang lower it to two AVX2 or four SSE registers.
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // an unaligned load or store
constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 4;  // rows a pass: independent sums that hide the add's latency

// always inlined into the ISA clones (a 64-byte vector passed across a call changes ABI by target)
__attribute__((always_inline)) inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
__attribute__((always_inline)) inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

// One sample's pairs. xt is x[b] transposed and zero-padded to [D, padded] (padded: a multiple of
// kLanes, at least n + kRows), so rows i..i+3 meet 16 columns j at once, each dot summed over d in
// order. Only the blocks holding some j < i are computed; gram is [padded, padded] scratch.
DEEPREC_CLONES void sample_dots(const float* __restrict xt, int64_t n, int64_t padded, int64_t d,
                                float* __restrict out, float* __restrict gram) {
  for (int64_t i0 = 0; i0 < n; i0 += kRows) {
    for (int64_t jb = 0; jb < i0 + kRows - 1; jb += kLanes) {
      v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t k = 0; k < d; ++k) {
        const float* row = xt + k * padded;
        const v16 c = load(row + jb);
        a0 += row[i0] * c;
        a1 += row[i0 + 1] * c;
        a2 += row[i0 + 2] * c;
        a3 += row[i0 + 3] * c;
      }
      store(gram + i0 * padded + jb, a0);
      store(gram + (i0 + 1) * padded + jb, a1);
      store(gram + (i0 + 2) * padded + jb, a2);
      store(gram + (i0 + 3) * padded + jb, a3);
    }
  }
  int64_t p = 0;
  for (int64_t i = 1; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) out[p++] = gram[i * padded + j];
}

// One sample's gradient: g is the symmetric [n + kRows, n] matrix of the pairs' gradients (zero
// diagonal and padding rows); dx[i] = sum over j of g[i, j] x[j], j ascending, rows i..i+3 and 16 of
// d at a time (d's tail, under 16, one by one).
DEEPREC_CLONES void sample_dots_backward(const float* __restrict g, const float* __restrict x, int64_t n, int64_t d,
                                         float* __restrict dx) {
  for (int64_t i0 = 0; i0 < n; i0 += kRows) {
    const int64_t rows = std::min(kRows, n - i0);
    const float* g0 = g + i0 * n;
    int64_t kb = 0;
    for (; kb + kLanes <= d; kb += kLanes) {
      v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t j = 0; j < n; ++j) {
        const v16 xj = load(x + j * d + kb);
        a0 += g0[j] * xj;
        a1 += g0[n + j] * xj;
        a2 += g0[2 * n + j] * xj;
        a3 += g0[3 * n + j] * xj;
      }
      const v16 acc[kRows] = {a0, a1, a2, a3};
      for (int64_t r = 0; r < rows; ++r) store(dx + (i0 + r) * d + kb, acc[r]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = kb; k < d; ++k) {
        float acc = 0.f;
        for (int64_t j = 0; j < n; ++j) acc += g0[r * n + j] * x[j * d + k];
        dx[(i0 + r) * d + k] = acc;
      }
    }
  }
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3, "dot_interaction: x must be [batch, vectors, dim], got shape ", x.sizes());
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
              "dot_interaction: x must be float32, bfloat16 or float16 (summed in float32), got ", t,
              "; deeprec.ops.step.dot_interaction takes bmm for the others");
}

at::Tensor dot_interaction(const at::Tensor& x_in) {
  check_x(x_in);
  const int64_t b = x_in.size(0), n = x_in.size(1), d = x_in.size(2), pairs = n * (n - 1) / 2;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();  // bf16 / half: summed in float32
  at::Tensor out = at::empty({b, pairs}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t padded = (n + kRows + kLanes - 1) / kLanes * kLanes;
  at::parallel_for(0, b, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> xt(d * padded, 0.f), gram(padded * padded);
    for (int64_t s = begin; s < end; ++s) {
      const float* xs = xp + s * n * d;
      for (int64_t i = 0; i < n; ++i)
        for (int64_t k = 0; k < d; ++k) xt[k * padded + i] = xs[i * d + k];
      sample_dots(xt.data(), n, padded, d, op + s * pairs, gram.data());
    }
  });
  return out.to(x_in.scalar_type());
}

at::Tensor dot_interaction_backward(const at::Tensor& grad_in, const at::Tensor& x_in) {
  check_x(x_in);
  const int64_t b = x_in.size(0), n = x_in.size(1), d = x_in.size(2), pairs = n * (n - 1) / 2;
  TORCH_CHECK(grad_in.dim() == 2 && grad_in.size(0) == b && grad_in.size(1) == pairs,
              "dot_interaction_backward: grad must be [", b, ", ", pairs, "], got ", grad_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous(), grad = grad_in.to(at::kFloat).contiguous();
  at::Tensor dx = at::empty({b, n, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* gp = grad.data_ptr<float>();
  float* dp = dx.data_ptr<float>();
  at::parallel_for(0, b, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> g((n + kRows) * n, 0.f);  // rows past n stay zero
    for (int64_t s = begin; s < end; ++s) {
      const float* gs = gp + s * pairs;
      int64_t p = 0;
      for (int64_t i = 1; i < n; ++i)
        for (int64_t j = 0; j < i; ++j, ++p) g[i * n + j] = g[j * n + i] = gs[p];
      sample_dots_backward(g.data(), xp + s * n * d, n, d, dp + s * n * d);
    }
  });
  return dx.to(x_in.scalar_type());
}

at::Tensor gather_rows(const at::Tensor& rows, const at::Tensor& index) {
  TORCH_CHECK(rows.dim() == 2, "gather_rows: rows must be [U, dim], got shape ", rows.sizes());
  TORCH_CHECK(index.scalar_type() == at::kLong, "gather_rows: index must be int64");
  std::vector<int64_t> shape(index.sizes().begin(), index.sizes().end());
  shape.push_back(rows.size(1));
  return rows.index_select(0, index.reshape(-1)).view(shape);
}

DEEPREC_CLONES void add_rows(const float* __restrict grad, const int64_t* __restrict index, int64_t outer,
                             int64_t inner, int64_t stride_outer, int64_t stride_inner, int64_t d, int64_t stride_d,
                             float* __restrict out) {
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      const float* __restrict src = grad + o * stride_outer + i * stride_inner;
      float* __restrict dst = out + index[o * inner + i] * d;
      if (stride_d == 1) {
        for (int64_t k = 0; k < d; ++k) dst[k] += src[k];
      } else {
        for (int64_t k = 0; k < d; ++k) dst[k] += src[k * stride_d];
      }
    }
  }
}

at::Tensor gather_rows_backward(const at::Tensor& grad, const at::Tensor& index_in, int64_t num_rows) {
  TORCH_CHECK(grad.dim() == index_in.dim() + 1 && grad.sizes().slice(0, index_in.dim()) == index_in.sizes(),
              "gather_rows_backward: grad ", grad.sizes(), " does not match index ", index_in.sizes());
  const int64_t d = grad.size(-1);
  at::Tensor out = at::zeros({num_rows, d}, grad.options());
  if (!grad.device().is_cpu() || grad.scalar_type() != at::kFloat || index_in.dim() > 2 || grad.numel() == 0) {
    return out.index_add_(0, index_in.reshape(-1), grad.reshape({index_in.numel(), d}));
  }
  const at::Tensor index = index_in.contiguous();
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < num_rows, "gather_rows_backward: index ", ip[i], " out of range [0, ",
                num_rows, ")");
  }
  // [*S, D] as outer x inner rows with their strides (S of one or two dims)
  const int64_t outer = index.dim() == 2 ? index.size(0) : 1, inner = index.dim() == 2 ? index.size(1) : index.numel();
  const int64_t stride_outer = index.dim() == 2 ? grad.stride(0) : 0, stride_inner = grad.stride(index.dim() - 1);
  add_rows(grad.data_ptr<float>(), ip, outer, inner, stride_outer, stride_inner, d, grad.stride(-1),
           out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deeprec, m) {
  m.def("dot_interaction(Tensor x) -> Tensor");
  m.def("dot_interaction_backward(Tensor grad, Tensor x) -> Tensor");
  m.def("gather_rows(Tensor rows, Tensor index) -> Tensor");
  m.def("gather_rows_backward(Tensor grad, Tensor index, SymInt num_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(deeprec, CPU, m) {
  m.impl("dot_interaction", dot_interaction);
  m.impl("dot_interaction_backward", dot_interaction_backward);
  m.impl("gather_rows", gather_rows);
  m.impl("gather_rows_backward", gather_rows_backward);
}

TORCH_LIBRARY_IMPL(deeprec, CUDA, m) {  // index_select and index_add
  m.impl("gather_rows", gather_rows);
  m.impl("gather_rows_backward", gather_rows_backward);
}

}  // namespace deeprec
