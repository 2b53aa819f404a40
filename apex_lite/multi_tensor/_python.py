"""The pure-Python backend: torch foreach ops, no per-tensor host sync.

This is the reference the native kernels are tested against, so its arithmetic is the contract:
every value is computed in fp32 (``opmath``) and rounded once to the output dtype.

- scale: ``out = round(float(x) * float(scale))``
- axpby: ``out = round(float(a) * float(x) + float(b) * float(y))``, two products then one sum,
  no fused multiply-add (so the native kernels build with ``-ffp-contract=off``).
- found_inf: set to 1.0 when an *input* element is inf or NaN; never written 0.

The caller (``apex_lite.multi_tensor``) has validated the arguments: equal-length lists, one device,
floating tensors of fp32/fp16/bf16, matching shapes, ``found_inf`` a 1-element fp32 tensor there.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch

from . import _checks

Tensors = Sequence[torch.Tensor]


def _as_fp32(tensors: Tensors) -> List[torch.Tensor]:
    """fp32 copies of ``tensors`` (the upcast of fp16/bf16 is exact); fp32 tensors are cloned."""
    out = [torch.empty_like(t, dtype=torch.float32) for t in tensors]
    if out:
        torch._foreach_copy_(out, list(tensors))
    return out


def _check_and_scale_(tensors: List[torch.Tensor], scale: Union[float, torch.Tensor],
                      found_inf: torch.Tensor) -> None:
    """In place ``t *= scale`` in fp32 opmath, flagging non-finite elements (torch's fused op).
    ``scale`` may be a 1-element fp32 tensor on the device (amp's device-side loss scale)."""
    if not tensors:
        return
    factor = scale if isinstance(scale, torch.Tensor) else \
        torch.full((1,), scale, dtype=torch.float32, device=found_inf.device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, factor)


def scale_(tensors: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    # fp32 tensors are scaled where they stand; the others through an fp32 temporary (torch's
    # CUDA kernel has no bf16 version), which rounds the product once, as the native kernels do.
    _check_and_scale_([t for t in tensors if t.dtype == torch.float32], scale, found_inf)
    staged = [t for t in tensors if t.dtype != torch.float32]
    if staged:
        tmp = _as_fp32(staged)
        _check_and_scale_(tmp, scale, found_inf)
        torch._foreach_copy_(staged, tmp)


def scale_out(inputs: Tensors, outputs: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    # Outputs in fp32 are scaled where they stand; any other output dtype goes through an fp32
    # temporary so that the product is rounded once, to the output dtype.
    direct = [i for i, o in enumerate(outputs) if o.dtype == torch.float32]
    staged = [i for i, o in enumerate(outputs) if o.dtype != torch.float32]
    if direct:
        outs = [outputs[i] for i in direct]
        torch._foreach_copy_(outs, [inputs[i] for i in direct])
        _check_and_scale_(outs, scale, found_inf)
    if staged:
        tmp = _as_fp32([inputs[i] for i in staged])
        _check_and_scale_(tmp, scale, found_inf)
        torch._foreach_copy_([outputs[i] for i in staged], tmp)


def _axpby_fp32(xs: Tensors, ys: Tensors, a: float, b: float,
                found_inf: torch.Tensor) -> List[torch.Tensor]:
    """fp32 ``a*x + b*y`` for each pair, flagging non-finite elements of x and of y."""
    ax = _as_fp32(xs)
    by = _as_fp32(ys)
    _check_and_scale_(ax, a, found_inf)
    _check_and_scale_(by, b, found_inf)
    torch._foreach_add_(ax, by)
    return ax


def axpby_(xs: Tensors, ys: Tensors, a: float, b: float, found_inf: torch.Tensor) -> None:
    if xs:
        torch._foreach_copy_(list(ys), _axpby_fp32(xs, ys, a, b, found_inf))


def axpby_out(xs: Tensors, ys: Tensors, outputs: Tensors, a: float, b: float,
              found_inf: torch.Tensor) -> None:
    if xs:
        torch._foreach_copy_(list(outputs), _axpby_fp32(xs, ys, a, b, found_inf))


def l2norm(tensors: Tensors, per_tensor: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float32)
    stacked = torch.stack(norms)
    total = torch.linalg.vector_norm(stacked).reshape(1)
    per = stacked if per_tensor else stacked.new_zeros(0)
    return total, per


def nonfinite_flags(tensors: Tensors) -> torch.Tensor:
    if tensors[0].device.type == "cpu":
        return _nonfinite_flags_cpu(tensors)
    # The max-abs of a tensor is inf or NaN exactly when one of its elements is; it has no value
    # for an empty tensor, which is finite by definition (a shared finite 0 stands in for it: no
    # index list is copied to the device).
    filled = [t for t in tensors if t.numel() > 0]
    norms = iter(torch._foreach_norm(filled, float("inf")) if filled else ())
    zero = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    maxima = [next(norms).float() if t.numel() > 0 else zero for t in tensors]
    return ~torch.isfinite(torch.stack(maxima))


def _nonfinite_flags_cpu(tensors: Tensors) -> torch.Tensor:
    """``nonfinite_flags`` on the CPU, where torch's inf-norm of a half tensor is a slow
    reduction (15 ms for 8M bf16 elements in 200 tensors on 2 cores) and one ``aminmax`` per
    tensor is fast (1.8 ms): a tensor holds inf or NaN exactly when ``max - min``, in double (no
    finite pair overflows it), is not finite. An empty tensor spans 0."""
    filled = [t for t in tensors if t.numel() > 0]
    if not filled:
        return torch.zeros(len(tensors), dtype=torch.bool)
    lows, highs = zip(*map(torch.aminmax, filled))
    spans = torch.stack(highs).double() - torch.stack(lows).double()
    if len(filled) < len(tensors):
        full = torch.zeros(len(tensors), dtype=torch.float64)
        full[[i for i, t in enumerate(tensors) if t.numel() > 0]] = spans
        spans = full
    return ~torch.isfinite(spans)


# ---- the fused optimizer steps (apex_lite.optimizers) ----------------------------------------
#
# The reference for csrc/cpu/fused_{sgd,adam,lamb}.cpp and csrc/cuda/fused_{sgd,adam,lamb}.cu.
# Per element, in fp32, each line one rounding (no fused multiply-add; a product by a scalar is
# rounded before it is added), hyper-parameters converted from double to fp32 once:
#
#   g = float(grad) * inv_scale
# SGD:
#   if weight_decay != 0 and not wd_after_momentum:  g = g + weight_decay * p
#   if momentum != 0:
#       buf = g                                          (first_run)
#       buf = momentum * buf + (1 - dampening) * g       (otherwise; 1 - dampening in double)
#       g = g + momentum * buf  (nesterov)  or  g = buf
#   if weight_decay != 0 and wd_after_momentum:      g = g + weight_decay * p
#   p = p - lr * g
# Adam (reciprocal bias corrections r1 = 1 / (1 - beta1**step), r2 = 1 / sqrt(1 - beta2**step),
# each computed in double and then rounded once to fp32; 1 without bias_correction; step is the
# count after this step's increment; reciprocals so that an element costs one division):
#   if weight_decay != 0 and not adam_w_mode:  g = g + weight_decay * p
#   m = beta1 * m + (1 - beta1) * g
#   v = beta2 * v + ((1 - beta2) * g) * g
#   update = (m * r1) / (sqrt(v) * r2 + eps)   (sqrt correctly rounded, see _sqrt_fp32; rounded
#                                               in the order m * r1, sqrt(v), * r2, + eps, /)
#   if weight_decay != 0 and adam_w_mode:      update = update + weight_decay * p
#   p = p - lr * update
# LAMB (apex's): first g = g / clip, where clip = grad_norm / max_grad_norm when max_grad_norm > 0
# and grad_norm > max_grad_norm, else 1; then as Adam, with m = beta1 * m + beta3 * g where
# beta3 = 1 - beta1 with grad_averaging, else 1; and the last line per tensor:
#   ratio = lr * (||p|| / ||update||) when (use_nvlamb or weight_decay != 0) and both norms are
#           not 0 (fp32 norms of the fp32 values), else lr
#   p = p - ratio * update
# Then params[i] = round(p), model_params[i] = round(p) (round: to each tensor's dtype, to
# nearest even) and steps[i] += 1. When found_inf is not 0 nothing is written.
#
# This backend reads nothing on the host (on CUDA a read is a device sync): found_inf and the
# step counts stay on the device. Every new value is computed into a temporary, and ``_commit``
# writes them all at the end where found_inf is 0 (a skipped step computes and drops its
# values). Of the native kernels' argument checks it makes one, as they do: each
# parameter has a step count of its own (_checks.check_own_step_counts; every op that advances
# step counts: Adam, LAMB, NovoGrad, Adagrad).

Writes = List[Tuple[Tensors, Sequence[torch.Tensor]]]


def _commit(writes: Writes, found_inf: torch.Tensor) -> None:
    """``targets[i] = round(values[i])`` for each ``(targets, values)`` of ``writes`` where
    ``found_inf`` is 0, all unchanged otherwise; no host read. Lists of unequal lengths raise
    before anything is written."""
    for targets, values in writes:
        if len(targets) != len(values):
            raise ValueError(f"a fused step got lists of {len(targets)} and {len(values)} "
                             f"tensors where their lengths must be equal")
    keep = found_inf.reshape(()) == 0
    for targets, values in writes:
        for target, value in zip(targets, values):
            target.copy_(torch.where(keep, value, target))


def _true_grads(grads: Tensors, inv_scale: torch.Tensor) -> List[torch.Tensor]:
    """fp32 ``float(grad) * inv_scale`` for each gradient (new tensors)."""
    out = _as_fp32(grads)
    torch._foreach_mul_(out, inv_scale.reshape(()))
    return out


def _fp32_params(params: Tensors) -> List[torch.Tensor]:
    """The fp32 parameters themselves, or fp32 copies of half ones (read only: the update is
    computed into new tensors, written by _finish)."""
    return [p if p.dtype == torch.float32 else p.float() for p in params]


def _finish(params: Tensors, p32: List[torch.Tensor], model_params: Tensors, writes: Writes,
            found_inf: torch.Tensor) -> None:
    """Round the updated fp32 values once into the parameters and into the model's, and make
    the other ``writes``, unless ``found_inf`` is set."""
    writes.append((params, p32))
    if model_params:
        writes.append((model_params, p32))
    _commit(writes, found_inf)


def _plus_scaled(xs: List[torch.Tensor], c: float, ys: List[torch.Tensor]) -> List[torch.Tensor]:
    """New tensors ``x + c * y``: the product rounded, then the sum."""
    return torch._foreach_add(xs, torch._foreach_mul(ys, c))


def _sqrt_fp32(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """Correctly rounded fp32 square roots of fp32 tensors (new tensors).

    torch's fp32 sqrt on the CPU (MKL's vsSqrt) is one ulp off in about one element in six, so
    the roots are taken in float64 and rounded once to fp32: the root of an fp32 value lies at
    least two float64 ulps away from any fp32 rounding boundary, so a float64 root within one
    ulp (MKL's vdSqrt) rounds to the correctly rounded fp32 root, which the native kernels
    compute (vsqrtps / sqrtss)."""
    wide = [torch.empty_like(t, dtype=torch.float64) for t in tensors]
    if not wide:
        return []
    torch._foreach_copy_(wide, tensors)
    torch._foreach_sqrt_(wide)
    out = [torch.empty_like(t) for t in tensors]
    torch._foreach_copy_(out, wide)
    return out


def fused_sgd_(params: Tensors, grads: Tensors, momentum_buffers: Tensors, model_params: Tensors,
               inv_scale: torch.Tensor, found_inf: torch.Tensor, lr: float, momentum: float,
               dampening: float, weight_decay: float, nesterov: bool, wd_after_momentum: bool,
               first_run: bool) -> None:
    if not params:
        return
    writes: Writes = []
    g = _true_grads(grads, inv_scale)
    p = _fp32_params(params)
    if weight_decay != 0.0 and not wd_after_momentum:
        g = _plus_scaled(g, weight_decay, p)
    if momentum != 0.0:
        if first_run:
            bufs = g
        else:
            bufs = torch._foreach_mul(list(momentum_buffers), momentum)
            torch._foreach_add_(bufs, torch._foreach_mul(g, 1.0 - dampening))
        writes.append((momentum_buffers, bufs))
        g = _plus_scaled(g, momentum, bufs) if nesterov else bufs
    if weight_decay != 0.0 and wd_after_momentum:
        g = _plus_scaled(g, weight_decay, p)
    _finish(params, torch._foreach_sub(p, torch._foreach_mul(g, lr)), model_params, writes,
            found_inf)


def _bias_corrections(steps: Tensors, beta1: float, beta2: float, bias_correction: bool
                      ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(r1, r2) per tensor for the step each is about to take, as 0-dim fp32 tensors on the
    steps' device (no host read): 1 / (1 - beta1**count) and 1 / sqrt(1 - beta2**count)
    computed in double as the native kernels do (a negative 1 - beta2**count gives NaN there, as
    in C++, and 1 / 0 an infinity), then rounded once to fp32."""
    if not bias_correction:
        one = torch.ones((), dtype=torch.float32, device=steps[0].device)
        return [one] * len(steps), [one] * len(steps)
    r1, r2 = _bias_correction_tensors(steps, beta1, beta2)
    return list(r1.unbind()), list(r2.unbind())


def _bias_correction_tensors(steps: Tensors, beta1: float, beta2: float
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``_bias_corrections`` with bias correction, as two 1-D fp32 tensors (one element per
    step count), for updates that compute with per-tensor scalars stacked (NovoGrad)."""
    counts = torch.stack([s.reshape(()) for s in steps]).to(torch.float64) + 1.0
    # A strided view: the CPU kernel then takes its element-wise path, C's pow (the native
    # kernels' std::pow, correctly rounded), where a contiguous one takes SLEEF's vector pow,
    # up to an ulp off in double.
    counts = torch.stack([counts, counts], dim=1)[:, 0]
    r1 = torch.reciprocal(1.0 - torch.pow(beta1, counts)).to(torch.float32)
    r2 = torch.reciprocal(torch.sqrt(1.0 - torch.pow(beta2, counts))).to(torch.float32)
    return r1, r2


def _adam_updates(g: List[torch.Tensor], p: List[torch.Tensor], exp_avgs: Tensors,
                  exp_avg_sqs: Tensors, steps: Tensors, beta1: float, beta2: float, beta3: float,
                  eps: float, weight_decay: float, adam_w_mode: bool, bias_correction: bool,
                  writes: Writes) -> List[torch.Tensor]:
    """The Adam directions (new fp32 tensors); the new moments and step counts go to
    ``writes``."""
    if weight_decay != 0.0 and not adam_w_mode:
        g = _plus_scaled(g, weight_decay, p)
    m = torch._foreach_mul(list(exp_avgs), beta1)
    torch._foreach_add_(m, torch._foreach_mul(g, beta3))
    v = torch._foreach_mul(list(exp_avg_sqs), beta2)
    torch._foreach_add_(v, torch._foreach_mul(torch._foreach_mul(g, 1.0 - beta2), g))
    r1, r2 = _bias_corrections(steps, beta1, beta2, bias_correction)
    writes.extend([(exp_avgs, m), (exp_avg_sqs, v), (steps, torch._foreach_add(list(steps), 1.0))])
    denom = _sqrt_fp32(v)
    torch._foreach_mul_(denom, r2)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_mul(m, r1)
    torch._foreach_div_(update, denom)
    if weight_decay != 0.0 and adam_w_mode:
        update = _plus_scaled(update, weight_decay, p)
    return update


def fused_adam_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors,
                model_params: Tensors, steps: Tensors, inv_scale: torch.Tensor,
                found_inf: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, adam_w_mode: bool, bias_correction: bool) -> None:
    _checks.check_own_step_counts("fused_adam_", steps)
    if not params:
        return
    writes: Writes = []
    p = _fp32_params(params)
    update = _adam_updates(_true_grads(grads, inv_scale), p, exp_avgs, exp_avg_sqs, steps, beta1,
                           beta2, 1.0 - beta1, eps, weight_decay, adam_w_mode, bias_correction,
                           writes)
    _finish(params, torch._foreach_sub(p, torch._foreach_mul(update, lr)), model_params, writes,
            found_inf)


def hold_lists(params: Tensors, grad_sources: Tensors, model_params: Tensors,
               state: Sequence[Tensors]) -> None:
    """None: this backend holds no lists between steps (the native one does, to spare a step the
    conversion of every tensor at the call; here each step works per tensor anyway)."""
    return None


# ---- fused_lamb_mp_ (issue 27: apex's FusedMixedPrecisionLamb) ----
#
# LAMB with lr read from a 1-element tensor and one step tensor for all parameters holding the
# number of the step being taken (the bias corrections' count), which the caller increments and
# the op does not write: fused_lamb_ (below) over per-parameter counts of steps taken, step - 1,
# in temporaries that it increments and that are dropped (exact for counts below 2**24).

def fused_lamb_mp_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors,
                   model_params: Tensors, step: torch.Tensor, lr: torch.Tensor,
                   inv_scale: torch.Tensor, found_inf: torch.Tensor, grad_norm: torch.Tensor,
                   beta1: float, beta2: float, eps: float, weight_decay: float,
                   adam_w_mode: bool, bias_correction: bool, grad_averaging: bool,
                   max_grad_norm: float, use_nvlamb: bool) -> None:
    if not params:
        return
    taken = step.reshape(1).to(torch.float32) - 1.0
    steps = list(taken.expand(len(params)).clone().unbind(0))
    fused_lamb_(params, grads, exp_avgs, exp_avg_sqs, model_params, steps, inv_scale, found_inf,
                grad_norm, lr, beta1, beta2, eps, weight_decay, adam_w_mode,
                bias_correction, grad_averaging, max_grad_norm, use_nvlamb)

# ---- end fused_lamb_mp_ ----


def fused_lamb_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors,
                model_params: Tensors, steps: Tensors, inv_scale: torch.Tensor,
                found_inf: torch.Tensor, grad_norm: torch.Tensor,
                lr: Union[float, torch.Tensor], beta1: float, beta2: float, eps: float,
                weight_decay: float, adam_w_mode: bool, bias_correction: bool,
                grad_averaging: bool, max_grad_norm: float, use_nvlamb: bool) -> None:
    _checks.check_own_step_counts("fused_lamb_", steps)
    if not params:
        return
    # lr rounded once to fp32, on the device (fused_lamb_mp_'s is a tensor: no host read).
    lr32 = lr.reshape(()).to(device=found_inf.device, dtype=torch.float32) \
        if isinstance(lr, torch.Tensor) else \
        torch.full((), lr, dtype=torch.float32, device=found_inf.device)
    writes: Writes = []
    g = _true_grads(grads, inv_scale)
    if max_grad_norm > 0.0:
        norm = grad_norm.reshape(1).to(torch.float32)
        limit = torch.full_like(norm, max_grad_norm)
        clip = torch.where(norm > limit, norm / limit, torch.ones_like(norm))
        torch._foreach_div_(g, clip.reshape(()))
    p = _fp32_params(params)
    beta3 = 1.0 - beta1 if grad_averaging else 1.0
    update = _adam_updates(g, p, exp_avgs, exp_avg_sqs, steps, beta1, beta2, beta3, eps,
                           weight_decay, adam_w_mode, bias_correction, writes)
    if use_nvlamb or weight_decay != 0.0:
        p_norms = torch._foreach_norm(p, 2)
        u_norms = torch._foreach_norm(update, 2)
        for u, pn, un in zip(update, p_norms, u_norms):
            trusted = (pn != 0) & (un != 0)
            ratio = torch.where(trusted, lr32 * (pn / torch.where(trusted, un, 1.0)), lr32)
            u.mul_(ratio)
    else:
        torch._foreach_mul_(update, lr32)
    _finish(params, torch._foreach_sub(p, update), model_params, writes, found_inf)


# ---- NovoGrad and Adagrad (csrc/cpu/fused_{novograd,adagrad}.cpp spell out the contract) -----
# NovoGrad, per parameter: n = ||g||_2 (or max |g| for norm_type 0) of the true gradient g; its
# second moment v (one fp32 value) becomes n on a count-0 parameter without init_zero, else
# sqrt(beta2 * (v * v) + (1 - beta2) * (n * n)) (L2) or beta2 * v + (1 - beta2) * n (inf);
# denom = v * r2 + eps (r1, r2 as Adam's); then per element, beta3 as LAMB's:
#   reg_inside_moment:  g = g / denom (+ weight_decay * p);  m = beta1 * m + beta3 * g;
#                       p = p - lr * (m * r1)
#   otherwise:          m = beta1 * m + beta3 * g;
#                       p = p - lr * ((m * r1) / denom (+ weight_decay * p))
# Adagrad, per element: g (+ weight_decay * p unless adagrad_w_mode); h = h + g * g;
#   update = g / (sqrt(h) + eps) (+ weight_decay * p in adagrad_w_mode); p = p - lr * update.
#
# Neither reads anything on the host (found_inf, the step counts and the norms stay on the
# device): every new value is computed into a temporary, and _commit writes them
# all at the end where found_inf is 0.

def _grad_norms(g: List[torch.Tensor], norm_type: int) -> torch.Tensor:
    """fp32 per-tensor norms on the tensors' device (0 for an empty tensor, which has no inf
    norm). The inf norm passes NaN elements over, as apex's fmaxf does (the max of the others,
    0 when all are NaN): a NaN gradient element then makes NaN only where it is, on every
    backend; torch's max would make the whole tensor's update NaN."""
    filled = [t for t in g if t.numel() > 0]
    if norm_type != 2 and filled:
        filled = torch._foreach_abs(filled)
        for t in filled:
            torch.nan_to_num_(t, nan=0.0, posinf=float("inf"))
    norms = iter(torch._foreach_norm(filled, 2 if norm_type == 2 else float("inf"))
                 if filled else ())
    zero = torch.zeros((), dtype=torch.float32, device=g[0].device)
    return torch.stack([next(norms).float() if t.numel() > 0 else zero for t in g])


def fused_novograd_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors,
                    model_params: Tensors, steps: Tensors, inv_scale: torch.Tensor,
                    found_inf: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, bias_correction: bool, grad_averaging: bool,
                    reg_inside_moment: bool, norm_type: int, init_zero: bool) -> None:
    if norm_type not in (0, 2):
        raise RuntimeError(f"apex_lite::fused_novograd_: norm_type is {norm_type}; NovoGrad's "
                           f"norms are 2 (L2) and 0 (the inf norm)")
    _checks.check_own_step_counts("fused_novograd_", steps)
    if not params:
        return
    g = _true_grads(grads, inv_scale)
    p = _fp32_params(params)
    # The per-tensor scalars as fp32 tensors on the device (each operation one rounding).
    n = _grad_norms(g, norm_type)
    v = torch.stack([t.reshape(()) for t in exp_avg_sqs])
    b2, c2, eps32 = (torch.tensor(x, dtype=torch.float32, device=v.device)
                     for x in (beta2, 1.0 - beta2, eps))
    if norm_type == 2:   # the root in double, rounded once (as _sqrt_fp32)
        blended = (b2 * (v * v) + c2 * (n * n)).to(torch.float64).sqrt().to(torch.float32)
    else:
        blended = b2 * v + c2 * n
    counts = torch.stack([t.reshape(()) for t in steps]).to(torch.float32)
    first = torch.zeros_like(counts, dtype=torch.bool) if init_zero else counts == 0
    v = torch.where(first, n, blended)
    if bias_correction:
        r1, r2 = _bias_correction_tensors(steps, beta1, beta2)
        denoms = v * r2 + eps32
    else:
        r1 = torch.ones_like(v)
        denoms = v + eps32
    denom_list, r1_list = list(denoms.unbind()), list(r1.unbind())
    beta3 = 1.0 - beta1 if grad_averaging else 1.0
    if reg_inside_moment:
        g = torch._foreach_div(g, denom_list)
        if weight_decay != 0.0:
            g = _plus_scaled(g, weight_decay, p)
    m = torch._foreach_mul(list(exp_avgs), beta1)
    torch._foreach_add_(m, torch._foreach_mul(g, beta3))
    update = torch._foreach_mul(m, r1_list)
    if not reg_inside_moment:
        torch._foreach_div_(update, denom_list)
        if weight_decay != 0.0:
            update = _plus_scaled(update, weight_decay, p)
    p = torch._foreach_sub(p, torch._foreach_mul(update, lr))
    writes: Writes = [(exp_avgs, m), (exp_avg_sqs, list(v.unbind())),
                       (steps, torch._foreach_add(list(steps), 1.0)), (params, p)]
    if model_params:
        writes.append((model_params, p))
    _commit(writes, found_inf)


def fused_adagrad_(params: Tensors, grads: Tensors, sums: Tensors, model_params: Tensors,
                   steps: Tensors, inv_scale: torch.Tensor, found_inf: torch.Tensor, lr: float,
                   eps: float, weight_decay: float, adagrad_w_mode: bool) -> None:
    _checks.check_own_step_counts("fused_adagrad_", steps)
    if not params:
        return
    g = _true_grads(grads, inv_scale)
    p = _fp32_params(params)
    if weight_decay != 0.0 and not adagrad_w_mode:
        g = _plus_scaled(g, weight_decay, p)
    h = torch._foreach_add(list(sums), torch._foreach_mul(g, g))
    denom = _sqrt_fp32(h)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(g, denom)
    if weight_decay != 0.0 and adagrad_w_mode:
        update = _plus_scaled(update, weight_decay, p)
    p = torch._foreach_sub(p, torch._foreach_mul(update, lr))
    writes: Writes = [(sums, h), (steps, torch._foreach_add(list(steps), 1.0)), (params, p)]
    if model_params:
        writes.append((model_params, p))
    _commit(writes, found_inf)


# The host-side watches amp uses every step (no tensor arithmetic: the same on every backend's
# device, here in Python).
from ._watches import (lazy_grad_slots, referenced_elsewhere, watch_grads,  # noqa: E402,F401
                       watch_tensors)
