"""NVIDIA apex's multi-tensor interface over apex_lite's kernels: ``amp_C``'s ops and
``apex.multi_tensor_apply.multi_tensor_applier``.

This module is what ``import amp_C`` and ``apex.multi_tensor_apply`` give through apex_lite's
``apex`` (the ``compat/apex`` distribution, or ``apex_lite.install_apex_alias()``), for code that
calls apex's fused ops itself (fairseq's and Megatron's gradient clipping, apex-style
optimizers)::

    from apex.multi_tensor_apply import multi_tensor_applier
    import amp_C
    overflow_buf = torch.zeros(1, dtype=torch.int, device=device)
    norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)

apex's calling convention: ``op(chunk_size, noop_flag, tensor_lists, *args)``, the lists in
apex's order, apex's return values. ``chunk_size`` is accepted and not used: the kernels choose
their own chunks, and no result depends on it (l2norm's only through fp32 rounding).

``noop_flag`` is apex's ``noop_flag_buffer``: a 1-element tensor on the tensors' device, int32
in apex (any integer, bool or float dtype is accepted). Where an op sets it (scale, axpby and
l2norm set it to 1 when they meet inf or NaN, and never write 0), an fp32 copy is made on the
device, handed to the kernel as its ``found_inf`` flag and copied back: two small device ops, no
host sync; an fp32 flag is used in place. ``multi_tensor_sgd`` reads it (a set flag: nothing is
written); ``multi_tensor_adam``, ``multi_tensor_lamb``, ``multi_tensor_novograd``,
``multi_tensor_adagrad`` and the two LAMB stages ignore it, as apex's kernels do. Both backends
read the flag and the step counts on the device, without a host sync.

What does not map (each raises, naming it): apex's double-precision tensors; the capturable
Adam variants (``lr`` and ``step`` as device tensors, fp32 master lists); LAMB with
``max_grad_norm <= 0``; and the ops of amp_C not listed in ``AMP_C_OPS``. Where results differ
from apex's by rounding only, the op's docstring says so.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .. import multi_tensor
from ..multi_tensor._backend import ops_for
from ..optimizers.update import unit_scalars
from .amp_c_args import (arg_lists, check_aligned, check_noop, flag_where, fp32_state,
                         host_number, noop_as_found_inf, scalar_tensor, set_noop, step_counts,
                         write_back)
# apex's two-stage LAMB (DeepLearningExamples' BERT looks these up when imported).
from .lamb_stages import multi_tensor_lamb_stage1_cuda, multi_tensor_lamb_stage2_cuda  # noqa: F401

__all__ = ["MultiTensorApply", "multi_tensor_applier", "multi_tensor_scale",
           "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_sgd", "multi_tensor_adam",
           "multi_tensor_lamb", "AMP_C_OPS"]

AMP_C_OPS = ("multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm",
             "multi_tensor_sgd", "multi_tensor_adam", "multi_tensor_lamb")


class MultiTensorApply:
    """apex's ``MultiTensorApply``: ``applier(op, noop_flag_buffer, tensor_lists, *args)`` calls
    ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)``. ``available`` is True: apex_lite's
    kernels serve every device (native where built, torch's foreach ops elsewhere)."""

    available = True
    warned = False

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """apex raised here when amp_C was not built; apex_lite always has its kernels."""

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)


class _AdamFamilyCall:
    """The checked arguments of apex's Adam and LAMB ops, as the kernels take them: the lists
    ``[grads, params, exp_avgs, exp_avg_sqs]``, fp32 moments (``write_back`` rounds them into
    apex's half ones), one step count per parameter, ``lr`` a number."""

    def __init__(self, op: str, noop_flag, tensor_lists, lr, step, mode):
        names = ["grads", "params", "exp_avgs", "exp_avg_sqs"]
        lists = arg_lists(op, tensor_lists, [", ".join(names)])
        check_aligned(op, names, lists)
        if mode not in (0, 1):
            raise ValueError(f"amp_C.{op}: mode={mode!r}; apex's modes are 0 (L2 "
                             f"regularisation, Adam) and 1 (decoupled weight decay, AdamW)")
        self.grads, self.params, self.exp_avgs, self.exp_avg_sqs = lists
        if not self.params:
            return
        self.device = self.params[0].device
        check_noop(op, noop_flag, self.device)
        self.steps = step_counts(op, step, len(self.params), self.device)
        self.lr = host_number(op, "lr", lr)
        self.m, self.v = fp32_state(self.exp_avgs), fp32_state(self.exp_avg_sqs)

    def write_back(self) -> None:
        write_back(self.exp_avgs, self.m)
        write_back(self.exp_avg_sqs, self.v)


# ---- the ops --------------------------------------------------------------------------------

def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """apex's ``amp_C.multi_tensor_scale``: lists ``[inputs, outputs]``, ``out = in * scale`` in
    fp32 rounded once (outputs may be the inputs); sets ``noop_flag`` when an input holds inf or
    NaN."""
    inputs, outputs = arg_lists("multi_tensor_scale", tensor_lists, ["inputs, outputs"])
    if not inputs and not outputs:
        return
    device = (inputs or outputs)[0].device
    found_inf = noop_as_found_inf("multi_tensor_scale", noop_flag, device)
    multi_tensor.scale(inputs, outputs, scale, found_inf)
    set_noop(noop_flag, found_inf)


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check) -> None:
    """apex's ``amp_C.multi_tensor_axpby``: lists ``[xs, ys, outputs]``, ``out = a*x + b*y``;
    sets ``noop_flag`` when a checked input holds inf or NaN: ``arg_to_check`` -1 both, 0 the
    xs, 1 the ys (checked before anything is written)."""
    op = "multi_tensor_axpby"
    xs, ys, outputs = arg_lists(op, tensor_lists, ["xs, ys, outputs"])
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"amp_C.{op}: arg_to_check={arg_to_check!r}; apex's values are -1 "
                         f"(check xs and ys), 0 (xs) and 1 (ys)")
    if not xs and not ys and not outputs:
        return
    device = (xs or ys or outputs)[0].device
    found_inf = noop_as_found_inf(op, noop_flag, device)
    if arg_to_check == -1:
        multi_tensor.axpby(xs, ys, outputs, a, b, found_inf)
    else:
        checked = xs if arg_to_check == 0 else ys
        if checked:
            flag_where(found_inf, multi_tensor.nonfinite_flags(checked).any())
        # The kernel checks both lists; its flag is not apex's here.
        multi_tensor.axpby(xs, ys, outputs, a, b,
                           torch.zeros(1, dtype=torch.float32, device=device))
    set_noop(noop_flag, found_inf)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=None
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """apex's ``amp_C.multi_tensor_l2norm``: lists ``[tensors]``; returns ``(total_norm,
    per_tensor_norms)``, fp32 on the tensors' device, shapes [1] and [len(tensors)] (or [0]
    when ``per_tensor`` is not True), accumulated in fp32. Sets ``noop_flag`` when the norm is
    inf or NaN (apex: when one chunk's sum of squares is)."""
    return _l2norm("multi_tensor_l2norm", noop_flag, tensor_lists, per_tensor)


def _l2norm(op: str, noop_flag, tensor_lists, per_tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    (tensors,) = arg_lists(op, tensor_lists, ["tensors"])
    if not tensors:
        device = noop_flag.device if isinstance(noop_flag, torch.Tensor) else None
        return (torch.zeros(1, dtype=torch.float32, device=device),
                torch.zeros(0, dtype=torch.float32, device=device))
    if not isinstance(tensors[0], torch.Tensor):
        raise TypeError(f"amp_C.{op}: tensor_lists[0][0] is a {type(tensors[0]).__name__}, not "
                        f"a tensor")
    found_inf = noop_as_found_inf(op, noop_flag, tensors[0].device)
    if per_tensor:
        total, norms = multi_tensor.l2norm(tensors, per_tensor=True)
    else:
        total = multi_tensor.l2norm(tensors)
        norms = total.new_zeros(0)
    flag_where(found_inf, ~torch.isfinite(total))
    set_noop(noop_flag, found_inf)
    return total, norms


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov,
                     first_run, wd_after_momentum, scale=1.0) -> None:
    """apex's ``amp_C.multi_tensor_sgd`` (apex's FusedSGD): lists ``[grads, params,
    momentum_buffers]`` or ``[grads, params, momentum_buffers, model_params]`` (the last
    receives the updated values rounded to its dtype); ``scale`` multiplies the gradients (apex
    passes 1/loss_scale). A set ``noop_flag`` skips the step, as apex's kernel does. The update
    is apex's, in fp32, each parameter rounded once (``apex_lite.optimizers.FusedSGD``'s op);
    half momentum buffers are updated in fp32 and rounded once."""
    op = "multi_tensor_sgd"
    lists = arg_lists(op, tensor_lists, ["grads, params, momentum_buffers",
                                      "grads, params, momentum_buffers, model_params"])
    names = ["grads", "params", "momentum_buffers", "model_params"]
    check_aligned(op, names, lists)
    grads, params, buffers = lists[:3]
    model_params = lists[3] if len(lists) == 4 else []
    if not params:
        return
    device = params[0].device
    found_inf = noop_as_found_inf(op, noop_flag, device)
    momentum = float(momentum)
    staged = fp32_state(buffers) if momentum != 0.0 else []
    inv_scale = torch.full((1,), float(scale), dtype=torch.float32, device=device)
    ops_for(device).fused_sgd_(params, grads, staged, model_params, inv_scale, found_inf,
                               float(lr), momentum, float(dampening), float(wd), bool(nesterov),
                               bool(wd_after_momentum), bool(first_run))
    write_back(buffers, staged)


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode,
                      bias_correction, weight_decay) -> None:
    """apex's ``amp_C.multi_tensor_adam`` (apex's FusedAdam): lists ``[grads, params,
    exp_avgs, exp_avg_sqs]``; ``step`` the number of the step being taken (the same for every
    tensor); ``mode`` 0 Adam (L2 in the gradient), 1 AdamW (decoupled decay). ``noop_flag`` is
    not read, as in apex. The update is apex's in fp32, rounded once per tensor; apex's CUDA
    kernel may fuse multiply-adds, so results agree to fp32 rounding, not bit for bit."""
    op = "multi_tensor_adam"
    call = _AdamFamilyCall(op, noop_flag, tensor_lists, lr, step, mode)
    if call.params:
        inv_scale, found_inf = unit_scalars(call.device)   # apex's kernel reads neither
        ops_for(call.device).fused_adam_(
            call.params, call.grads, call.m, call.v, [], call.steps, inv_scale, found_inf,
            call.lr, float(beta1), float(beta2), float(eps), float(weight_decay), mode == 1,
            bool(bias_correction))
        call.write_back()


def multi_tensor_lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step,
                      bias_correction, weight_decay, grad_averaging, mode, global_grad_norm,
                      max_grad_norm, use_nvlamb=False) -> None:
    """apex's ``amp_C.multi_tensor_lamb`` (apex's FusedLAMB): lists ``[grads, params, exp_avgs,
    exp_avg_sqs]``; the gradients are divided by ``global_grad_norm / max_grad_norm`` when the
    norm exceeds ``max_grad_norm``; per-tensor trust ratios from the fp32 parameter and update
    norms (all tensors when ``use_nvlamb``, else those with weight decay). ``noop_flag`` is not
    read, as in apex. Differences from apex: the gradients are left as they are (apex's kernel
    overwrites them with the update), and the update of half tensors stays in fp32 until the
    parameter is written (apex rounds it to half first), so half parameters agree with apex to
    half rounding. ``max_grad_norm <= 0`` is refused: apex's kernel then divides every gradient
    by ``norm / 0``."""
    op = "multi_tensor_lamb"
    max_grad_norm = host_number(op, "max_grad_norm", max_grad_norm)
    if not max_grad_norm > 0.0:
        raise ValueError(f"amp_C.{op}: max_grad_norm={max_grad_norm}; apex's kernel divides "
                         f"the gradients by global_grad_norm / max_grad_norm, which is inf (or "
                         f"NaN) here, and apex_lite's does not clip at all: this does not map. "
                         f"Pass a positive max_grad_norm (apex's FusedLAMB default is 1.0), or "
                         f"use apex_lite.optimizers.FusedLAMB(max_grad_norm=0) to turn clipping "
                         f"off.")
    call = _AdamFamilyCall(op, noop_flag, tensor_lists, lr, step, mode)
    if not call.params:
        return
    if not isinstance(global_grad_norm, torch.Tensor) or global_grad_norm.numel() != 1 \
            or global_grad_norm.device != call.device:
        raise TypeError(f"amp_C.{op}: global_grad_norm must be the 1-element norm tensor on "
                        f"{call.device} that multi_tensor_l2norm returned")
    inv_scale, found_inf = unit_scalars(call.device)
    ops_for(call.device).fused_lamb_(
        call.params, call.grads, call.m, call.v, [], call.steps, inv_scale, found_inf,
        global_grad_norm.reshape(1).to(torch.float32), call.lr, float(beta1), float(beta2),
        float(eps), float(weight_decay), mode == 1, bool(bias_correction), bool(grad_averaging),
        max_grad_norm, bool(use_nvlamb))
    call.write_back()


# What code that probes amp_C for other ops (try/except, hasattr) should learn.
_NOT_PROVIDED_HINT = {
    "multi_tensor_adam_capturable": "apex_lite.optimizers.FusedAdam",
    "multi_tensor_adam_capturable_master": "apex_lite.optimizers.FusedAdam under amp at O2",
    "multi_tensor_l2norm_scale": "multi_tensor_l2norm, then multi_tensor_scale",
}


def __getattr__(name):
    if name.startswith("multi_tensor_"):
        hint = _NOT_PROVIDED_HINT.get(name)
        raise AttributeError(f"amp_C.{name} is not provided by apex_lite, whose amp_C has "
                             f"{', '.join(AMP_C_OPS)}" + (f"; use {hint}" if hint else ""))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- issue 27: the ops of apex's FusedMixedPrecisionLamb ----

__all__ += ["multi_tensor_l2norm_mp", "multi_tensor_lamb_mp"]
AMP_C_OPS += ("multi_tensor_l2norm_mp", "multi_tensor_lamb_mp")


def multi_tensor_l2norm_mp(chunk_size, noop_flag, tensor_lists, per_tensor=None
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """apex's ``amp_C.multi_tensor_l2norm_mp`` (apex's FusedMixedPrecisionLamb):
    ``multi_tensor_l2norm``, which accumulates in fp32 whatever the dtype. apex's kernel does
    nothing when ``noop_flag`` is already set and returns an unspecified norm; this one computes
    the norm all the same."""
    return _l2norm("multi_tensor_l2norm_mp", noop_flag, tensor_lists, per_tensor)


def multi_tensor_lamb_mp(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step,
                         bias_correction, weight_decay, grad_averaging, mode, global_grad_norm,
                         max_grad_norm, use_nvlamb, found_inf, inv_scale) -> None:
    """apex's ``amp_C.multi_tensor_lamb_mp`` (apex's FusedMixedPrecisionLamb): lists ``[grads,
    params, exp_avgs, exp_avg_sqs]`` or ``[grads, master_params, exp_avgs, exp_avg_sqs,
    model_params]`` (the last receives the updated masters rounded once to its dtype). ``lr``,
    ``step`` (the number of the step being taken, which the caller increments),
    ``global_grad_norm``, ``max_grad_norm``, ``found_inf`` and ``inv_scale`` are 1-element
    tensors on the device (numbers are accepted too), read there: no host sync with the native
    kernels. ``grad * inv_scale`` is the gradient; the gradients are divided by
    ``global_grad_norm / max_grad_norm`` when that exceeds 1 (both of the scaled gradients, as
    apex's optimizer passes them). The step is skipped when ``noop_flag`` (apex's kernel's test)
    or ``found_inf`` is set. Differences from apex as ``multi_tensor_lamb``'s: the gradients are
    left as they are, and the update stays in fp32 until the parameter is written."""
    op = "multi_tensor_lamb_mp"
    names = ["grads", "params", "exp_avgs", "exp_avg_sqs", "model_params"]
    lists = arg_lists(op, tensor_lists, [", ".join(names[:4]), ", ".join(names)])
    check_aligned(op, names, lists)
    if mode not in (0, 1):
        raise ValueError(f"amp_C.{op}: mode={mode!r}; apex's modes are 0 (L2 regularisation) "
                         f"and 1 (decoupled weight decay)")
    grads, params, exp_avgs, exp_avg_sqs = lists[:4]
    model_params = lists[4] if len(lists) == 5 else []
    if not params:
        return
    device = params[0].device
    if not isinstance(step, torch.Tensor) and host_number(op, "step", step, int) < 1:
        raise ValueError(f"amp_C.{op}: step={step}; apex passes the number of the step being "
                         f"taken, 1 for the first")
    skip = torch.maximum(noop_as_found_inf(op, noop_flag, device),
                         scalar_tensor(op, "found_inf", found_inf, device))
    # The clip divisor from the ratio of the two scaled norms: the op clips when its grad_norm
    # exceeds max_grad_norm (here 1) and divides by grad_norm / 1.
    ratio = (scalar_tensor(op, "global_grad_norm", global_grad_norm, device)
             / scalar_tensor(op, "max_grad_norm", max_grad_norm, device))
    m, v = fp32_state(exp_avgs), fp32_state(exp_avg_sqs)
    with torch.no_grad():    # apex's kernels write parameters outside autograd
        ops_for(device).fused_lamb_mp_(
            params, grads, m, v, model_params, scalar_tensor(op, "step", step, device),
            scalar_tensor(op, "lr", lr, device),
            scalar_tensor(op, "inv_scale", inv_scale, device), skip, ratio, float(beta1),
            float(beta2), float(epsilon), float(weight_decay), mode == 1, bool(bias_correction),
            bool(grad_averaging), 1.0, bool(use_nvlamb))
        write_back(exp_avgs, m)
        write_back(exp_avg_sqs, v)

# ---- end issue 27 ----


# ---- NovoGrad and Adagrad ---------------------------------------------------------------------

def multi_tensor_novograd(chunk_size, noop_flag, tensor_lists, grad_norms, lr, beta1, beta2,
                          epsilon, step, bias_correction, weight_decay, grad_averaging,
                          moment_mode, norm_type) -> None:
    """apex's ``amp_C.multi_tensor_novograd`` (apex's FusedNovoGrad): lists ``[grads, params,
    exp_avgs]``; ``grad_norms`` the fp32 tensor of one blended gradient norm per parameter,
    updated in place (``norm_type`` 2: ``sqrt(beta2 * v**2 + (1 - beta2) * n**2)``; 0, the inf
    norm: ``beta2 * v + (1 - beta2) * n``: apex's FusedNovoGrad fills it with the first step's
    norms itself unless ``init_zero``); ``step`` the number of the step being taken;
    ``moment_mode`` 0 normalises and decays the gradient inside the moment, 1 the update.
    ``noop_flag`` is not read, as in apex. The update is apex's in fp32 (the norms accumulated
    in fp32 in an order of their own), each tensor rounded once; half moments are updated in fp32
    and rounded once."""
    op = "multi_tensor_novograd"
    names = ["grads", "params", "exp_avgs"]
    lists = arg_lists(op, tensor_lists, [", ".join(names)])
    check_aligned(op, names, lists)
    if moment_mode not in (0, 1):
        raise ValueError(f"amp_C.{op}: moment_mode={moment_mode!r}; apex's modes are 0 "
                         f"(regularisation inside the moment) and 1 (decoupled)")
    if norm_type not in (0, 2):
        raise ValueError(f"amp_C.{op}: norm_type={norm_type!r}; apex's norms are 2 (L2) and 0 "
                         f"(the inf norm)")
    grads, params, exp_avgs = lists
    if not params:
        return
    device = params[0].device
    check_noop(op, noop_flag, device)
    if not isinstance(grad_norms, torch.Tensor) or grad_norms.numel() != len(params) \
            or grad_norms.device != device or not grad_norms.is_floating_point():
        raise TypeError(f"amp_C.{op}: grad_norms must be a floating tensor on {device} with one "
                        f"norm per parameter ({len(params)}), as apex's FusedNovoGrad keeps it")
    norms = grad_norms.detach().reshape(-1)
    staged_norms = norms if norms.dtype == torch.float32 and norms.is_contiguous() \
        else norms.to(torch.float32).contiguous()
    steps = step_counts(op, step, len(params), device)
    m = fp32_state(exp_avgs)
    inv_scale, found_inf = unit_scalars(device)   # apex's kernel reads neither
    ops_for(device).fused_novograd_(
        params, grads, m, list(staged_norms.unbind(0)), [], steps, inv_scale, found_inf,
        host_number(op, "lr", lr), float(beta1), float(beta2), float(epsilon), float(weight_decay),
        bool(bias_correction), bool(grad_averaging), moment_mode == 0, int(norm_type), True)
    write_back(exp_avgs, m)
    if staged_norms is not norms:
        norms.copy_(staged_norms)


def multi_tensor_adagrad(chunk_size, noop_flag, tensor_lists, lr, epsilon, mode,
                         weight_decay) -> None:
    """apex's ``amp_C.multi_tensor_adagrad`` (apex's FusedAdagrad): lists ``[grads, params,
    sums]``; ``mode`` 0 adds the weight decay to the gradient (L2), 1 to the update (decoupled).
    ``noop_flag`` is not read, as in apex. The update is apex's in fp32, each tensor rounded
    once; half sums are updated in fp32 and rounded once."""
    op = "multi_tensor_adagrad"
    names = ["grads", "params", "sums"]
    lists = arg_lists(op, tensor_lists, [", ".join(names)])
    check_aligned(op, names, lists)
    if mode not in (0, 1):
        raise ValueError(f"amp_C.{op}: mode={mode!r}; apex's modes are 0 (L2 regularisation) "
                         f"and 1 (decoupled weight decay)")
    grads, params, sums = lists
    if not params:
        return
    device = params[0].device
    check_noop(op, noop_flag, device)
    h = fp32_state(sums)
    # The kernels count steps (torch's Adagrad keeps the count); apex's lists have none.
    steps = list(torch.zeros(len(params), dtype=torch.float32, device=device).unbind(0))
    inv_scale, found_inf = unit_scalars(device)   # apex's kernel reads neither
    ops_for(device).fused_adagrad_(params, grads, h, [], steps, inv_scale, found_inf,
                                   host_number(op, "lr", lr), float(epsilon), float(weight_decay),
                                   mode == 1)
    write_back(sums, h)


AMP_C_OPS += ("multi_tensor_novograd", "multi_tensor_adagrad")
__all__ += ["multi_tensor_novograd", "multi_tensor_adagrad"]
AMP_C_OPS += ("multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda")
__all__ += ["multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda"]
