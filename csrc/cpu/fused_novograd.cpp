// apex_lite::fused_novograd_ on CPU: one NovoGrad step (apex's FusedNovoGrad) over all
// parameters of a call.
//
// Contract (apex_lite/multi_tensor/_python.py is the reference): per parameter, with
// count = steps[i] + 1 and r1 = 1 / (1 - beta1**count), r2 = 1 / sqrt(1 - beta2**count) in
// double then fp32 (1 without bias_correction), each line one fp32 rounding, hyper-parameters
// converted from double to fp32 once (1 - beta2 in double):
//   g = float(grad) * inv_scale                          (per element)
//   n = ||g||_2 (fp32 squares summed as l2norm.cpp, the root in double then fp32), or
//       max |g| for norm_type 0, NaN elements passed over as apex's fmaxf passes them (the max
//       of the others, 0 when every element is NaN); 0 for an empty parameter
//   v = n                                  when steps[i] == 0 and not init_zero
//   v = sqrt(beta2 * (v * v) + (1 - beta2) * (n * n))     norm_type 2
//   v = beta2 * v + (1 - beta2) * n                       norm_type 0
//   denom = v * r2 + eps
// then per element (beta3 = 1 - beta1 with grad_averaging, else 1):
//   reg_inside_moment:  g = g / denom;  if weight_decay != 0: g = g + weight_decay * p
//   m = beta1 * m + beta3 * g
//   reg_inside_moment:  update = m * r1
//   otherwise:          update = (m * r1) / denom;  if weight_decay != 0:
//                       update = update + weight_decay * p
//   p = p - lr * update
// params[i] = round(p), model_params[i] = round(p), exp_avg_sqs[i] = v, steps[i] += 1. The L2
// norm's accumulation order is this kernel's own, so results match the reference within fp32
// rounding of the norms (the inf norm is exact). Dtypes, lists, found_inf and layouts as
// fused_adam_ (exp_avg_sqs: one 1-element fp32 CPU tensor per parameter); when found_inf is not 0
// nothing is written at all.
//
// Three stages: the per-tensor norms (one parallel pass over the gradients, per-segment partials
// combined in segment order, so the result does not depend on the thread count), the per-tensor
// scalars on the host, and one parallel elementwise pass.
#include "fused_optimizer_cpu.h"

#include <torch/library.h>

#include <algorithm>
#include <cmath>

namespace apex_lite {
namespace cpu {
namespace {

struct NovoGradConstants {
  float inv_scale;
  float lr;
  float beta1;
  float beta3;
  float weight_decay;
  bool decay;
  bool reg_inside_moment;
};

struct NovoGradTensor {
  void* param;
  const void* grad;
  float* exp_avg;
  void* model;  // nullptr: no model parameter
  float* count;
  float denom;  // set after the norms
  float r1;
};

struct NovoGradPlanner {
  using Entry = NovoGradTensor;
  struct Cache {};

  NovoGradTensor entry(const ParamData& d, Cache&) const {
    return NovoGradTensor{d.param, d.grad, d.state[0], d.model, d.count, 1.0f, 1.0f};
  }
};

// The sum of the squares (norm_type 2) or the largest magnitude (norm_type 0) of
// float(grad) * inv_scale over one segment.
template <typename G>
double grad_norm_segment(const void* base, int64_t begin, int64_t n, float inv_scale,
                         bool inf_norm) {
  const G* grad = static_cast<const G*>(base) + begin;
  const FVec s(inv_scale);
  if (inf_norm) {
    // apex's fmaxf: a NaN magnitude is passed over. at::vec::maximum propagates NaN, so NaN lanes
    // become 0 first (no magnitude is below it); std::fmax passes NaN over itself.
    const FVec zero(0.0f);
    const auto magnitude = [&](const FVec& v) {
      const FVec m = (v * s).abs();
      return FVec::blendv(m, zero, m.isnan());
    };
    FVec acc(0.0f);
    float tail = 0.0f;
    int64_t i = 0;
    for (; i + kStep <= n; i += kStep) {
      FVec lo, hi;
      load_fp32(grad + i, lo, hi);
      acc = at::vec::maximum(acc, at::vec::maximum(magnitude(lo), magnitude(hi)));
    }
    for (; i < n; ++i) tail = std::fmax(tail, std::fabs(static_cast<float>(grad[i]) * inv_scale));
    __at_align__ float lanes[FVec::size()];
    acc.store(lanes);
    for (int64_t k = 0; k < FVec::size(); ++k) tail = std::fmax(tail, lanes[k]);
    return tail;
  }
  SquareSum sum;
  for_each_square_block(
      n,
      [&](int64_t i) {
        FVec lo, hi;
        load_fp32(grad + i, lo, hi);
        sum.add(lo * s, hi * s);
      },
      [&](int64_t i) { sum.add(static_cast<float>(grad[i]) * inv_scale); },
      [&] { sum.end_block(); });
  return sum.total();
}

using GradNormFn = double (*)(const void*, int64_t, int64_t, float, bool);

template <typename P, typename G, typename M>
struct NovoGradStep {
  static void run(const NovoGradConstants& constants, const NovoGradTensor& t, int64_t begin,
                  int64_t n) {
    const NovoGradConstants c = constants;  // a local copy: the stores below cannot alias it
    const float denom = t.denom;
    const float r1 = t.r1;
    float* m = t.exp_avg + begin;
    update_segment(element_ptr<P>(t.param, begin), element_ptr<G>(t.grad, begin),
                   element_ptr<M>(t.model, begin), n, [&](auto& p, auto g, int64_t j) {
                     using V = std::decay_t<decltype(p)>;
                     g = g * V(c.inv_scale);
                     if (c.reg_inside_moment) {
                       g = g / V(denom);
                       if (c.decay) g = g + V(c.weight_decay) * p;
                     }
                     const V m_new = V(c.beta1) * load_state<V>(m + j) + V(c.beta3) * g;
                     store_state(m + j, m_new);
                     V update = m_new * V(r1);
                     if (!c.reg_inside_moment) {
                       update = update / V(denom);
                       if (c.decay) update = update + V(c.weight_decay) * p;
                     }
                     p = p - V(c.lr) * update;
                   });
  }
};

using NovoGradStepFn = void (*)(const NovoGradConstants&, const NovoGradTensor&, int64_t,
                                int64_t);

// exp_avg_sqs: one 1-element fp32 CPU tensor per parameter (its second moment).
void check_moment_scalars(const char* op, at::TensorList exp_avg_sqs, at::TensorList params) {
  TORCH_CHECK(exp_avg_sqs.size() == params.size(), "apex_lite::", op, ": params has ",
              params.size(), " tensors but exp_avg_sqs has ", exp_avg_sqs.size(),
              "; pass one 1-element second moment per parameter");
  for (size_t i = 0; i < exp_avg_sqs.size(); ++i) {
    const at::Tensor& v = exp_avg_sqs[i];
    TORCH_CHECK(v.numel() == 1 && v.scalar_type() == at::kFloat && v.device().is_cpu(),
                "apex_lite::", op, ": exp_avg_sqs[", i,
                "] must be a 1-element float32 CPU tensor (the parameter's second moment, a "
                "norm), got ",
                v.numel(), " elements of ", v.scalar_type(), " on ", v.device());
  }
}

void fused_novograd_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList model_params,
                     at::TensorList steps, const at::Tensor& inv_scale,
                     const at::Tensor& found_inf, double lr, double beta1, double beta2,
                     double eps, double weight_decay, bool bias_correction, bool grad_averaging,
                     bool reg_inside_moment, int64_t norm_type, bool init_zero) {
  const char* op = "fused_novograd_";
  TORCH_CHECK(norm_type == 0 || norm_type == 2, "apex_lite::", op, ": norm_type is ", norm_type,
              "; NovoGrad's norms are 2 (L2) and 0 (the inf norm)");
  check_moment_scalars(op, exp_avg_sqs, params);
  PlannedCall<NovoGradPlanner> call(
      op, StepLists{params, grads, model_params, {exp_avgs}, 1, steps, true}, inv_scale,
      found_inf, NovoGradPlanner{}, [&] {
        check_step_args(op, params, grads, model_params, inv_scale, found_inf);
        check_state_list(op, "exp_avgs", exp_avgs, params);
        check_steps(op, steps, params);
      });
  if (read_scalar(found_inf) != 0.0f || params.empty()) return;

  NovoGradConstants c;
  c.inv_scale = read_scalar(inv_scale);
  c.lr = static_cast<float>(lr);
  c.beta1 = static_cast<float>(beta1);
  c.beta3 = static_cast<float>(grad_averaging ? 1.0 - beta1 : 1.0);
  c.weight_decay = static_cast<float>(weight_decay);
  c.decay = weight_decay != 0.0;
  c.reg_inside_moment = reg_inside_moment;
  const bool inf_norm = norm_type == 0;

  // Stage 1: per-segment partials of the norms, combined per tensor in segment order.
  std::vector<NovoGradTensor>& tensors = call.entries();
  const size_t n = call.size();
  std::vector<GradNormFn> norm_kernels(n);
  for (size_t i = 0; i < n; ++i) {
    norm_kernels[i] = visit_storage_type(call.types()[i].grad, [](auto g) {
      return &grad_norm_segment<typename decltype(g)::type>;
    });
  }
  const std::vector<int64_t>& offsets = call.offsets();
  const auto starts = segment_starts(offsets);
  std::vector<double> partials(starts.back());
  parallel_indexed_segments(offsets, starts,
                            [&](int64_t segment, int64_t t, int64_t begin, int64_t length) {
                              partials[segment] = norm_kernels[t](tensors[t].grad, begin, length,
                                                                  c.inv_scale, inf_norm);
                            });
  const auto owners = segment_owners(offsets, starts);
  std::vector<double> totals(n, 0.0);
  if (inf_norm) {
    for (size_t s = 0; s < partials.size(); ++s) {
      totals[owners[s]] = std::fmax(totals[owners[s]], partials[s]);
    }
  } else {
    totals = per_tensor_totals(partials, owners, n);
  }

  // Stage 2: the second moments and the per-tensor scalars, on the host.
  const float b2 = static_cast<float>(beta2);
  const float one_minus_b2 = static_cast<float>(1.0 - beta2);
  const float eps32 = static_cast<float>(eps);
  for (size_t i = 0; i < n; ++i) {
    NovoGradTensor& t = tensors[i];
    const float norm = inf_norm ? static_cast<float>(totals[i])
                                : static_cast<float>(std::sqrt(totals[i]));
    float* v = exp_avg_sqs[i].data_ptr<float>();
    const double count = static_cast<double>(*t.count) + 1.0;
    float value;
    if (*t.count == 0.0f && !init_zero) {
      value = norm;
    } else if (inf_norm) {
      value = b2 * *v + one_minus_b2 * norm;
    } else {
      const float blended = b2 * (*v * *v) + one_minus_b2 * (norm * norm);
      value = std::sqrt(blended);
    }
    *v = value;
    float r2 = 1.0f;
    t.r1 = 1.0f;
    if (bias_correction) {
      t.r1 = static_cast<float>(1.0 / (1.0 - std::pow(beta1, count)));
      r2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, count)));
    }
    t.denom = value * r2 + eps32;
  }

  // Stage 3: the elementwise pass.
  std::vector<NovoGradStepFn> kernels(n);
  for (size_t i = 0; i < n; ++i) kernels[i] = step_kernel_for<NovoGradStep>(call.types()[i]);
  parallel_segments(offsets, [&](int64_t t, int64_t begin, int64_t length) {
    kernels[t](c, tensors[t], begin, length);
  });
  for (const NovoGradTensor& t : tensors) *t.count += 1.0f;
  call.write_back();
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) { m.impl("fused_novograd_", &fused_novograd_); }

}  // namespace cpu
}  // namespace apex_lite
