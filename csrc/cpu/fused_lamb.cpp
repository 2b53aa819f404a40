// apex_lite::fused_lamb_ on CPU: one LAMB step (apex's FusedLAMB) over all parameters of a call;
// and apex_lite::fused_lamb_mp_ (apex's FusedMixedPrecisionLamb), the same step with lr and one
// count for the call read from tensors (see the end of this file).
//
// Contract (apex_lite/multi_tensor/_python.py is the reference): per element, in fp32, each line
// one rounding, hyper-parameters converted from double to fp32 once:
//   g = float(grad) * inv_scale
//   g = g / clip      where clip = grad_norm / max_grad_norm (fp32), when max_grad_norm > 0 and
//                     grad_norm > max_grad_norm; else no division
//   if weight_decay != 0 and not adam_w_mode:  g = g + weight_decay * p
//   m = beta1 * m + beta3 * g                  (beta3 = 1 - beta1 with grad_averaging, else 1)
//   v = beta2 * v + ((1 - beta2) * g) * g
//   update = (m * r1) / (sqrt(v) * r2 + eps)    (sqrt correctly rounded; rounded in the order
//                                                m * r1, sqrt(v), * r2, + eps, /)
//   if weight_decay != 0 and adam_w_mode:      update = update + weight_decay * p
//   p = p - ratio * update
// per tensor: ratio = lr * (||p|| / ||update||) when (use_nvlamb or weight_decay != 0) and both
// norms are not 0 (fp32 norms of the fp32 values, p before the step), else lr. Then
// params[i] = round(p), model_params[i] = round(p) (each to its own dtype, to nearest even) and
// steps[i] += 1; r1, r2 as Adam's (fused_adam.cpp). grad_norm is the 1-element fp32 norm of the
// true gradients of the whole optimizer, computed by the caller. Dtypes, lists, found_inf and
// layouts as fused_adam_: when found_inf is not 0 nothing is written at all.
//
// With trust ratios the step has two stages inside the op and no buffer the size of the
// parameters: stage 1 updates m and v in place and sums, per segment, the squares of p and of
// the update (computed, never stored); the sums are combined per tensor in segment order (as
// l2norm.cpp, so the norms do not depend on the thread count) into the ratios; stage 2 recomputes
// each update from the stored m, v and the unchanged p (the same bits) and applies it. Without
// trust ratios it is one pass, as Adam's. The norms are accumulated differently from torch's
// _foreach_norm, so this op matches the reference within fp32 rounding of the norms, not bit for
// bit.
#include "fused_optimizer_cpu.h"

#include <torch/library.h>

#include <cmath>
#include <utility>

namespace apex_lite {
namespace cpu {
namespace {

// Stage 1 over one segment: the moments updated from the gradient; returns the sums of the
// squares of p and of the update (SquareSum: reproducible for a given segment).
template <typename P, typename G>
std::pair<double, double> lamb_moments_segment(const AdamConstants& constants,
                                               const AdamTensor& t, int64_t begin, int64_t n) {
  const AdamConstants c = constants;  // a local copy: the stores below cannot alias it
  const BiasCorrection bias = t.bias;
  const P* param = static_cast<const P*>(t.param) + begin;
  const G* grad = static_cast<const G*>(t.grad) + begin;
  float* m = t.exp_avg + begin;
  float* v = t.exp_avg_sq + begin;
  SquareSum p_squares, update_squares;
  for_each_square_block(
      n,
      [&](int64_t i) {
        FVec p_lo, p_hi, g_lo, g_hi;
        load_fp32(param + i, p_lo, p_hi);
        load_fp32(grad + i, g_lo, g_hi);
        const int64_t k = i + FVec::size();
        const FVec u_lo = adam_moments_and_direction(c, bias, p_lo, g_lo, m + i, v + i);
        const FVec u_hi = adam_moments_and_direction(c, bias, p_hi, g_hi, m + k, v + k);
        p_squares.add(p_lo, p_hi);
        update_squares.add(u_lo, u_hi);
      },
      [&](int64_t i) {
        const float p = static_cast<float>(param[i]);
        const float g = static_cast<float>(grad[i]);
        update_squares.add(adam_moments_and_direction(c, bias, p, g, m + i, v + i));
        p_squares.add(p);
      },
      [&] {
        p_squares.end_block();
        update_squares.end_block();
      });
  return {p_squares.total(), update_squares.total()};
}

using LambMomentsFn = std::pair<double, double> (*)(const AdamConstants&, const AdamTensor&,
                                                    int64_t, int64_t);

// Stage 1 over every parameter; sets each tensor's step_size to lr times its trust ratio.
void lamb_trust_ratios(const AdamConstants& c, AdamCall& call, float lr) {
  std::vector<AdamTensor>& tensors = call.entries();
  const size_t n = call.size();
  std::vector<LambMomentsFn> kernels(n);
  for (size_t i = 0; i < n; ++i) {
    kernels[i] = visit_storage_type(call.types()[i].param, [&](auto p) {
      return visit_storage_type(call.types()[i].grad, [&](auto g) {
        return &lamb_moments_segment<typename decltype(p)::type, typename decltype(g)::type>;
      });
    });
  }
  const std::vector<int64_t>& offsets = call.offsets();
  const auto starts = segment_starts(offsets);
  std::vector<double> p_partials(starts.back()), update_partials(starts.back());
  parallel_indexed_segments(offsets, starts,
                            [&](int64_t segment, int64_t t, int64_t begin, int64_t length) {
                              std::tie(p_partials[segment], update_partials[segment]) =
                                  kernels[t](c, tensors[t], begin, length);
                            });
  const auto owners = segment_owners(offsets, starts);
  const std::vector<double> p_squares = per_tensor_totals(p_partials, owners, n);
  const std::vector<double> update_squares = per_tensor_totals(update_partials, owners, n);
  for (size_t i = 0; i < n; ++i) {
    const float p_norm = static_cast<float>(std::sqrt(p_squares[i]));
    const float update_norm = static_cast<float>(std::sqrt(update_squares[i]));
    const bool trusted = p_norm != 0.0f && update_norm != 0.0f;
    tensors[i].step_size = trusted ? lr * (p_norm / update_norm) : lr;
  }
}

// Stage 2 over every parameter: p = p - step_size * update, the update from the stored moments.
void lamb_apply(const AdamConstants& c, const AdamCall& call) {
  const std::vector<AdamTensor>& tensors = call.entries();
  std::vector<AdamStepFn> kernels(call.size());
  for (size_t i = 0; i < call.size(); ++i) {
    kernels[i] = visit_storage_type(call.types()[i].param, [&](auto p) {
      return visit_optional_storage_type(call.types()[i].model, [&](auto m) {
        return &AdamStep<typename decltype(p)::type, void, typename decltype(m)::type>::run;
      });
    });
  }
  parallel_segments(call.offsets(), [&](int64_t t, int64_t begin, int64_t length) {
    kernels[t](c, tensors[t], begin, length);
  });
}

// The step of a checked and planned call that found_inf does not skip: the constants, the
// clip divisor from grad_norm, then one Adam-like pass, or the two stages with trust ratios.
// Shared by fused_lamb_ and fused_lamb_mp_, which differ in where lr and the counts come from.
void lamb_passes(AdamCall& call, const at::Tensor& inv_scale, const at::Tensor& grad_norm,
                 float lr32, double beta1, double beta2, double eps, double weight_decay,
                 bool adam_w_mode, bool grad_averaging, double max_grad_norm, bool use_nvlamb) {
  AdamConstants c = adam_constants(inv_scale, beta1, grad_averaging ? 1.0 - beta1 : 1.0, beta2,
                                   eps, weight_decay, adam_w_mode);
  const float norm = read_scalar(grad_norm);
  const float limit = static_cast<float>(max_grad_norm);
  c.clip_grad = max_grad_norm > 0.0 && norm > limit;
  c.clip = c.clip_grad ? norm / limit : 1.0f;

  if (use_nvlamb || weight_decay != 0.0) {
    lamb_trust_ratios(c, call, lr32);
    lamb_apply(c, call);
  } else {
    adam_step_pass(c, call);
  }
}

void fused_lamb_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, at::TensorList model_params, at::TensorList steps,
                 const at::Tensor& inv_scale, const at::Tensor& found_inf,
                 const at::Tensor& grad_norm, double lr, double beta1, double beta2, double eps,
                 double weight_decay, bool adam_w_mode, bool bias_correction, bool grad_averaging,
                 double max_grad_norm, bool use_nvlamb) {
  const char* op = "fused_lamb_";
  const float lr32 = static_cast<float>(lr);
  AdamCall call(op, params, grads, exp_avgs, exp_avg_sqs, model_params, steps, inv_scale,
                found_inf, beta1, beta2, bias_correction, lr32);
  check_scalar_tensor(op, "grad_norm", grad_norm);
  if (read_scalar(found_inf) != 0.0f || params.empty()) return;
  call.count_step();
  lamb_passes(call, inv_scale, grad_norm, lr32, beta1, beta2, eps, weight_decay, adam_w_mode,
              grad_averaging, max_grad_norm, use_nvlamb);
  call.write_back();
}

// fused_lamb_mp_ (apex's FusedMixedPrecisionLamb): fused_lamb_ with lr read from a tensor and
// one count for all parameters, the number of the step being taken, which the caller has
// incremented (it is read, never written). Every parameter's entry points at that count.
void fused_lamb_mp_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList model_params,
                    const at::Tensor& step, const at::Tensor& lr, const at::Tensor& inv_scale,
                    const at::Tensor& found_inf, const at::Tensor& grad_norm, double beta1,
                    double beta2, double eps, double weight_decay, bool adam_w_mode,
                    bool bias_correction, bool grad_averaging, double max_grad_norm,
                    bool use_nvlamb) {
  const char* op = "fused_lamb_mp_";
  check_scalar_tensor(op, "step", step);
  check_scalar_tensor(op, "lr", lr);
  const float lr32 = read_scalar(lr);
  const std::vector<at::Tensor> counts(params.size(), step);
  AdamCall call(op, params, grads, exp_avgs, exp_avg_sqs, model_params, counts, inv_scale,
                found_inf, beta1, beta2, bias_correction, lr32, /*counts_given=*/true);
  check_scalar_tensor(op, "grad_norm", grad_norm);
  if (read_scalar(found_inf) != 0.0f || params.empty()) return;
  lamb_passes(call, inv_scale, grad_norm, lr32, beta1, beta2, eps, weight_decay, adam_w_mode,
              grad_averaging, max_grad_norm, use_nvlamb);
  call.write_back();
}

}  // namespace

TORCH_LIBRARY_IMPL(apex_lite, CPU, m) {
  m.impl("fused_lamb_", &fused_lamb_);
  m.impl("fused_lamb_mp_", &fused_lamb_mp_);
}

}  // namespace cpu
}  // namespace apex_lite
