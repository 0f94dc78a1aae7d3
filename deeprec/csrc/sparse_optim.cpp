// Row-sparse optimizer updates in one pass over the touched rows, run without the GIL.
//
// Each op updates weight[rows[i]] and its slots in place from grad[i], rows distinct
// (deeprec.nn.lookup.merge_rows sums duplicates first). One row is read, updated and written
// while it sits in cache, where the composition of torch ops it replaces made ~8
// gathers, elementwise passes and scatters over all rows.
//
//   sparse_sgd_(weight, rows, grad, lr)                         w -= lr g
//   sparse_adagrad_(weight, acc, rows, grad, lr, eps)           a += g^2; w -= lr g / (sqrt(a) + eps)
//   sparse_adam_(weight, m, v, row_step?, rows, grad, lr, beta1, beta2, eps, step)
//       m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//       row_step absent (lazy Adam, bias correction by the global `step` t):
//           w -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps sqrt(1 - b2^t))
//       row_step given (AdamAsync: each row counts its own updates t_r, stored as float):
//           t_r += 1;  w -= lr (m / (1 - b1^t_r)) / (sqrt(v / (1 - b2^t_r)) + eps)
//
// weight and per-element slots are [R, dim] with contiguous rows (a DenseGroup passes its
// flat buffer as one row). CUDA tensors take the same math as ATen ops (one code per device).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace deeprec {
namespace {

constexpr int64_t kRowGrain = 1024;  // rows per task: small updates stay on the calling thread

struct Rows {
  const int64_t* index;
  const float* grad;
  int64_t n, dim;
};

Rows check_rows(const char* op, const at::Tensor& weight, std::initializer_list<const at::Tensor*> slots,
                const at::Tensor& rows, const at::Tensor& grad) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.stride(1) == 1 &&
                  weight.stride(0) == weight.size(1),
              op, ": weight must be a float32 [R, dim] tensor with contiguous rows");
  for (const at::Tensor* s : slots) {
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->sizes() == weight.sizes() && s->strides() == weight.strides() &&
                    s->device() == weight.device(),
                op, ": slots must be float32 tensors shaped and laid out like weight ", weight.sizes());
  }
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() &&
                  rows.device() == weight.device(),
              op, ": rows must be a contiguous 1-D int64 tensor on the weight's device");
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.dim() == 2 && grad.size(0) == rows.numel() &&
                  grad.size(1) == weight.size(1) && grad.is_contiguous() && grad.device() == weight.device(),
              op, ": grad must be a contiguous float32 [", rows.numel(), ", ", weight.size(1), "] tensor");
  if (!weight.device().is_cpu() || rows.numel() == 0) return {nullptr, nullptr, rows.numel(), weight.size(1)};
  const int64_t* index = rows.data_ptr<int64_t>();
  int64_t lo = 0, hi = 0;
  for (int64_t i = 0; i < rows.numel(); ++i) {  // branch-free min/max: it vectorizes
    lo = std::min(lo, index[i]);
    hi = std::max(hi, index[i]);
  }
  TORCH_CHECK(lo >= 0 && hi < weight.size(0), op, ": row ", lo < 0 ? lo : hi, " out of range [0, ", weight.size(0),
              ")");
  return {index, grad.data_ptr<float>(), rows.numel(), weight.size(1)};
}

// The row loops, compiled for AVX-512, AVX2 and baseline x86-64 and picked at load by the
// CPU (GCC target_clones); -ffp-contract=off keeps every clone's rounding identical.
#define DEEPREC_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

DEEPREC_CPU_CLONES
void sgd_rows(float* w, const int64_t* index, const float* grad, int64_t n, int64_t dim, float lr) {
  for (int64_t i = 0; i < n; ++i) {
    float* wr = w + index[i] * dim;
    const float* g = grad + i * dim;
    for (int64_t d = 0; d < dim; ++d) wr[d] -= lr * g[d];
  }
}

DEEPREC_CPU_CLONES
void adagrad_rows(float* w, float* a, const int64_t* index, const float* grad, int64_t n, int64_t dim, float lr,
                  float eps) {
  for (int64_t i = 0; i < n; ++i) {
    float* wr = w + index[i] * dim;
    float* ar = a + index[i] * dim;
    const float* g = grad + i * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const float sum = ar[d] + g[d] * g[d];
      ar[d] = sum;
      wr[d] -= lr * (g[d] / (std::sqrt(sum) + eps));
    }
  }
}

// t null: lazy Adam, `scale` and `eps` carry the step's bias correction; else AdamAsync's row counts
DEEPREC_CPU_CLONES
void adam_rows(float* w, float* m, float* v, float* t, const int64_t* index, const float* grad, int64_t n,
               int64_t dim, float b1, float b2, float scale, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = index[i] * dim;
    const float* g = grad + i * dim;
    float c1 = 1.f, c2 = 1.f;
    if (t != nullptr) {
      const float count = t[index[i]] += 1.f;
      c1 = 1.f - std::pow(b1, count);
      c2 = 1.f - std::pow(b2, count);
    }
    for (int64_t d = 0; d < dim; ++d) {
      const float md = b1 * m[at + d] + (1.f - b1) * g[d];
      const float vd = b2 * v[at + d] + (1.f - b2) * g[d] * g[d];
      m[at + d] = md;
      v[at + d] = vd;
      w[at + d] -= scale * ((md / c1) / (std::sqrt(vd / c2) + eps));
    }
  }
}

void sparse_sgd_(at::Tensor& weight, const at::Tensor& rows, const at::Tensor& grad, double lr) {
  const Rows r = check_rows("sparse_sgd_", weight, {}, rows, grad);
  if (!weight.device().is_cpu()) {
    weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(grad, lr));
    return;
  }
  float* w = weight.data_ptr<float>();
  at::parallel_for(0, r.n, kRowGrain, [&](int64_t begin, int64_t end) {
    sgd_rows(w, r.index + begin, r.grad + begin * r.dim, end - begin, r.dim, static_cast<float>(lr));
  });
}

void sparse_adagrad_(at::Tensor& weight, at::Tensor& acc, const at::Tensor& rows, const at::Tensor& grad, double lr,
                     double eps) {
  const Rows r = check_rows("sparse_adagrad_", weight, {&acc}, rows, grad);
  if (!weight.device().is_cpu()) {
    at::Tensor a = acc.index_select(0, rows).addcmul_(grad, grad);
    acc.index_copy_(0, rows, a);
    weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(grad / a.sqrt().add_(eps), lr));
    return;
  }
  float* w = weight.data_ptr<float>();
  float* a = acc.data_ptr<float>();
  at::parallel_for(0, r.n, kRowGrain, [&](int64_t begin, int64_t end) {
    adagrad_rows(w, a, r.index + begin, r.grad + begin * r.dim, end - begin, r.dim, static_cast<float>(lr),
                 static_cast<float>(eps));
  });
}

void sparse_adam_(at::Tensor& weight, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                  const c10::optional<at::Tensor>& row_step, const at::Tensor& rows, const at::Tensor& grad, double lr,
                  double beta1, double beta2, double eps, int64_t step) {
  const Rows r = check_rows("sparse_adam_", weight, {&exp_avg, &exp_avg_sq}, rows, grad);
  const bool per_row = row_step.has_value();
  if (per_row) {
    TORCH_CHECK(row_step->scalar_type() == at::kFloat && row_step->dim() == 1 && row_step->is_contiguous() &&
                    row_step->numel() == weight.size(0) && row_step->device() == weight.device(),
                "sparse_adam_: row_step must be a contiguous float32 [", weight.size(0), "] tensor");
  } else {
    TORCH_CHECK(step >= 1, "sparse_adam_: step must be >= 1, got ", step);
  }
  const float b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2);
  // lazy Adam's bias correction is one scalar per step (computed in double, as Python did)
  const double bc2 = 1 - std::pow(beta2, static_cast<double>(step));
  const float scale = per_row ? static_cast<float>(lr)
                              : static_cast<float>(lr * std::sqrt(bc2) / (1 - std::pow(beta1, static_cast<double>(step))));
  const float eps_hat = per_row ? static_cast<float>(eps) : static_cast<float>(eps * std::sqrt(bc2));
  if (!weight.device().is_cpu()) {
    at::Tensor m = exp_avg.index_select(0, rows).mul_(b1).add_(grad, 1 - b1);
    at::Tensor v = exp_avg_sq.index_select(0, rows).mul_(b2).addcmul_(grad, grad, 1 - b2);
    exp_avg.index_copy_(0, rows, m);
    exp_avg_sq.index_copy_(0, rows, v);
    at::Tensor c1 = at::ones({1, 1}, m.options()), c2 = c1;
    if (per_row) {
      at::Tensor t = row_step->index_select(0, rows).add_(1.0);
      row_step->index_copy_(0, rows, t);
      c1 = 1 - at::pow(b1, t).unsqueeze(1);
      c2 = 1 - at::pow(b2, t).unsqueeze(1);
    }
    at::Tensor update = (m / c1).div_((v / c2).sqrt_().add_(eps_hat)).mul_(scale);
    weight.index_copy_(0, rows, weight.index_select(0, rows).sub_(update));
    return;
  }
  float* t = per_row ? row_step->data_ptr<float>() : nullptr;
  at::parallel_for(0, r.n, kRowGrain, [&](int64_t begin, int64_t end) {
    adam_rows(weight.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), t, r.index + begin,
              r.grad + begin * r.dim, end - begin, r.dim, b1, b2, scale, eps_hat);
  });
}

// The EmbeddingVariables' fused apply: one optimizer step over the rows of many variables (a
// collection's, from one backward), each variable's rows then stamped with the step and marked
// dirty (incremental checkpoints, serving deltas; an empty dirty tensor: no flags, as a PS
// arena keeps none). grad holds every part's rows in order.
//   optimizer "sgd": slots none, hyper (lr); "adagrad": (accumulator), (lr, eps);
//   "adam": (exp_avg, exp_avg_sq[, row_step]), (lr, beta1, beta2, eps)
void ev_apply_(c10::string_view optimizer, std::vector<at::Tensor> weights, std::vector<at::Tensor> slots,
               std::vector<at::Tensor> versions, std::vector<at::Tensor> dirty, const std::vector<at::Tensor>& rows,
               const at::Tensor& grad, at::ArrayRef<double> hyper, int64_t step) {
  const size_t parts = weights.size();
  TORCH_CHECK(versions.size() == parts && dirty.size() == parts && rows.size() == parts,
              "ev_apply_: weights, versions, dirty and rows must have one entry per variable");
  TORCH_CHECK(parts == 0 || slots.size() % parts == 0, "ev_apply_: every variable must give the same slots");
  const size_t k = parts ? slots.size() / parts : 0;
  const bool sgd = optimizer == "sgd", adagrad = optimizer == "adagrad", adam = optimizer == "adam";
  TORCH_CHECK((sgd && k == 0 && hyper.size() == 1) || (adagrad && k == 1 && hyper.size() == 2) ||
                  (adam && (k == 2 || k == 3) && hyper.size() == 4),
              "ev_apply_: optimizer must be sgd (no slot, lr), adagrad (1 slot, lr, eps) or adam (2-3 slots, lr, "
              "beta1, beta2, eps); got ", optimizer, " with ", k, " slots and ", hyper.size(), " values");
  int64_t offset = 0;
  for (size_t p = 0; p < parts; ++p) {
    const int64_t n = rows[p].numel();
    TORCH_CHECK(offset + n <= grad.size(0), "ev_apply_: grad has fewer rows than the variables' rows");
    const at::Tensor g = grad.narrow(0, offset, n);
    offset += n;
    if (n == 0) continue;
    if (sgd) {
      sparse_sgd_(weights[p], rows[p], g, hyper[0]);
    } else if (adagrad) {
      sparse_adagrad_(weights[p], slots[p], rows[p], g, hyper[0], hyper[1]);
    } else {
      const c10::optional<at::Tensor> row_step = k == 3 ? c10::optional<at::Tensor>(slots[3 * p + 2]) : c10::nullopt;
      sparse_adam_(weights[p], slots[k * p], slots[k * p + 1], row_step, rows[p], g, hyper[0], hyper[1], hyper[2],
                   hyper[3], step);
    }
    const bool flags = dirty[p].numel() > 0;  // empty: no dirty flags (a PS arena's rows)
    TORCH_CHECK(versions[p].scalar_type() == at::kLong && dirty[p].scalar_type() == at::kBool &&
                    versions[p].is_contiguous() && dirty[p].is_contiguous() &&
                    versions[p].numel() >= weights[p].size(0) && (!flags || dirty[p].numel() >= weights[p].size(0)),
                "ev_apply_: version (int64) and dirty (bool, or empty) must be contiguous, one per row");
    int64_t* version = versions[p].data_ptr<int64_t>();
    bool* flag = flags ? dirty[p].data_ptr<bool>() : nullptr;
    const int64_t* r = rows[p].data_ptr<int64_t>();  // checked in range by the update
    for (int64_t i = 0; i < n; ++i) version[r[i]] = step;
    for (int64_t i = 0; flag && i < n; ++i) flag[r[i]] = true;
  }
  TORCH_CHECK(offset == grad.size(0), "ev_apply_: grad has more rows than the variables' rows");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deeprec, m) {
  m.def("ev_apply_(str optimizer, Tensor(a!)[] weights, Tensor(b!)[] slots, Tensor(c!)[] versions, "
        "Tensor(d!)[] dirty, Tensor[] rows, Tensor grad, float[] hyper, int step) -> ()");
  m.def("sparse_sgd_(Tensor(a!) weight, Tensor rows, Tensor grad, float lr) -> ()");
  m.def("sparse_adagrad_(Tensor(a!) weight, Tensor(b!) acc, Tensor rows, Tensor grad, float lr, float eps) -> ()");
  m.def("sparse_adam_(Tensor(a!) weight, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!)? row_step, "
        "Tensor rows, Tensor grad, float lr, float beta1, float beta2, float eps, int step) -> ()");
}

TORCH_LIBRARY_IMPL(deeprec, CPU, m) {
  m.impl("ev_apply_", ev_apply_);
  m.impl("sparse_sgd_", sparse_sgd_);
  m.impl("sparse_adagrad_", sparse_adagrad_);
  m.impl("sparse_adam_", sparse_adam_);
}

TORCH_LIBRARY_IMPL(deeprec, CUDA, m) {
  m.impl("sparse_sgd_", sparse_sgd_);
  m.impl("sparse_adagrad_", sparse_adagrad_);
  m.impl("sparse_adam_", sparse_adam_);
}

}  // namespace deeprec
