// linear_relu(x [B, K], weight [N, K], bias [N]) -> relu(x @ weight^T + bias) [B, N]
//
// An MLP's hidden layer as one op of the training step. ATen runs it as addmm, whose MKL call first
// copies the bias into every row of the output (a pass over [B, N]), then a ReLU that writes a second
// [B, N]; autograd keeps two nodes (and a transpose's). Here: the GEMM into a fresh output, then the
// bias and the ReLU in one pass over it, in place; one autograd node, written in C++ (a Python
// autograd node costs what the fusion saves). The bias is added after the products' sum, not before:
// values within float rounding of addmm's, not its bits. The backward runs the ATen calls autograd
// runs for F.linear + relu (threshold_backward, the two mm in addmm's layouts, the bias gradient's
// sum), in that order.
//
// Under CPU autocast the inputs are cast as F.linear's are (the autocast dtype, weights from its
// cache). Float32 takes the fused pass; other dtypes addmm, then the ReLU in place (bf16 sums keep the
// bias added in float32, as F.linear's do). CPU only: deeprec.ops.step.linear_relu composes elsewhere.
#include <torch/library.h>
#include <torch/autograd.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>

#include "clones.h"

namespace deeprec {
namespace {

// rows of y += bias, then max(., 0) keeping NaN (what relu does): one read and one write of y.
DEEPREC_CLONES void add_bias_relu_rows(float* __restrict y, const float* __restrict bias, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    float* __restrict row = y + i * cols;
    for (int64_t j = 0; j < cols; ++j) {
      const float v = row[j] + bias[j];
      row[j] = v < 0.f ? 0.f : v;
    }
  }
}

void check(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && bias.dim() == 1 && x.size(1) == weight.size(1) &&
                  bias.size(0) == weight.size(0),
              "linear_relu: x [B, K], weight [N, K] and bias [N] expected, got ", x.sizes(), ", ", weight.sizes(),
              " and ", bias.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.scalar_type() == bias.scalar_type(),
              "linear_relu: x, weight and bias must share a dtype, got ", x.scalar_type(), ", ",
              weight.scalar_type(), " and ", bias.scalar_type());
}

at::Tensor linear_relu_kernel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  check(x, weight, bias);
  if (x.scalar_type() != at::kFloat) {  // (a CPU kernel only: the op composes on other devices)
    // bf16 / half: addmm adds the bias to the float32 sums before rounding, as F.linear does (the
    // sum rounded first, then the bias, would round twice); the ReLU in place
    return at::addmm(bias, x, weight.t()).relu_();
  }
  at::Tensor y = at::mm(x, weight.t());
  const at::Tensor b = bias.contiguous();
  float* yp = y.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const int64_t cols = y.size(1);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1));  // rows of ~64 KiB a task
  at::parallel_for(0, y.size(0), grain, [&](int64_t begin, int64_t end) {
    add_bias_relu_rows(yp + begin * cols, bp, end - begin, cols);
  });
  return y;
}

at::Tensor call_kernel(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("deeprec::linear_relu", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(x, weight, bias);
}

class LinearRelu : public torch::autograd::Function<LinearRelu> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    at::AutoDispatchBelowADInplaceOrView below;
    at::Tensor y = call_kernel(x, weight, bias);
    ctx->save_for_backward({x, weight, y});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &y = saved[2];
    const at::Tensor grad = at::threshold_backward(grads[0], y, 0);  // ReluBackward
    at::Tensor dx, dweight, dbias;  // AddmmBackward's: mat1, mat2 (weight^T's transposed layout), self
    if (ctx->needs_input_grad(0)) dx = grad.mm(weight);
    if (ctx->needs_input_grad(1)) dweight = grad.t().mm(x);
    if (ctx->needs_input_grad(2)) dbias = grad.sum(0);
    return {dx, dweight, dbias};
  }
};

at::Tensor linear_relu_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return LinearRelu::apply(x, weight, bias);
}

at::Tensor linear_relu_autocast(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const auto dtype = at::autocast::get_autocast_dtype(at::kCPU);  // F.linear's policy: the lower precision
  return call_kernel(at::autocast::cached_cast(dtype, x, c10::DeviceType::CPU),
                     at::autocast::cached_cast(dtype, weight, c10::DeviceType::CPU),
                     at::autocast::cached_cast(dtype, bias, c10::DeviceType::CPU));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deeprec, m) {
  m.def("linear_relu(Tensor x, Tensor weight, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(deeprec, CPU, m) { m.impl("linear_relu", linear_relu_kernel); }
TORCH_LIBRARY_IMPL(deeprec, Autograd, m) { m.impl("linear_relu", linear_relu_autograd); }
TORCH_LIBRARY_IMPL(deeprec, AutocastCPU, m) { m.impl("linear_relu", linear_relu_autocast); }

}  // namespace deeprec
