"""apex's two-stage LAMB ops, ``amp_C.multi_tensor_lamb_stage1_cuda`` and
``amp_C.multi_tensor_lamb_stage2_cuda``, which DeepLearningExamples' BERT (``optimization.py``,
imported by run_glue.py, run_squad.py and run_swag.py) looks up when it is imported, and whose
2019 ``BertLAMB`` stepped through them::

    stage1(chunk, noop, [grads, params, exp_avgs, exp_avg_sqs, updates], per_tensor_decay,
           step, beta1, beta2, epsilon, global_grad_norm, max_global_grad_norm)
    stage2(chunk, noop, [params, updates], per_tensor_param_norm, per_tensor_update_norm,
           lr[, weight_decay, use_nvlamb])

Their meaning is that of apex's kernels (csrc/multi_tensor_lamb_stage_1.cu and _2.cu):

- stage 1, per tensor ``i`` with ``g' = g / c``, ``c = global_grad_norm / max_global_grad_norm``
  when the norm exceeds ``max_global_grad_norm``, else 1: ``m = beta1*m + (1-beta1)*g'``,
  ``v = beta2*v + (1-beta2)*g'^2``, ``update = (m/(1-beta1^(step+1))) /
  (sqrt(v/(1-beta2^(step+1))) + epsilon) + per_tensor_decay[i] * p``. ``step + 1``: apex's
  kernel corrects the bias for the step after the one it is given.
- stage 2: ``p -= r * update`` with the trust ratio ``r = lr * param_norm[i] / update_norm[i]``
  (``lr`` where either norm is 0). apex's kernel took ``lr`` alone until April 2020 (the ratio
  applies to every tensor: the form BertLAMB calls); from then on ``weight_decay`` and
  ``use_nvlamb`` too, and the ratio applies only where ``use_nvlamb`` or ``weight_decay != 0``.
  Both forms are accepted.

``global_grad_norm`` is a number (apex before May 2020) or the 1-element tensor
``multi_tensor_l2norm`` returns (apex after). The noop flag is neither read nor written, as in
apex (its kernels let inf and NaN through). The math is fp32 whatever the dtypes (fp32, fp16,
bf16, mixed as apex mixed them: BertLAMB writes fp16 updates for fp32 masters), each output
rounded once; apex's kernels compute in the parameter's dtype, so half parameters agree with
them to half rounding. Implemented with torch's foreach ops on the tensors' device, without a
host sync; on both kernel backends the same code runs.
"""
from __future__ import annotations

import torch

from .amp_c_args import arg_lists, check_aligned, check_noop, fp32_state, host_number, \
    write_back

__all__ = ["multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda"]


def _per_tensor(op: str, name: str, values, count: int, device: torch.device):
    """``values`` (apex: one fp32 entry per tensor of the lists) as ``count`` 0-dim fp32 device
    tensors."""
    if not isinstance(values, torch.Tensor) or values.numel() != count or values.is_complex():
        got = (f"{values.numel()} elements of {values.dtype}" if isinstance(values, torch.Tensor)
               else type(values).__name__)
        raise TypeError(f"amp_C.{op}: {name} must be a real tensor with one entry per tensor of "
                        f"the lists ({count}), as apex's kernel reads {name}[i]; got {got}")
    return list(values.reshape(-1).to(device=device, dtype=torch.float32).unbind(0))


def _scalar(op: str, name: str, value, device: torch.device) -> torch.Tensor:
    """A number or a 1-element tensor as a 1-element fp32 tensor on ``device`` (no host read)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(f"amp_C.{op}: {name} must be a number or a 1-element real tensor, "
                            f"got {value.numel()} elements of {value.dtype}")
        return value.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), host_number(op, name, value), dtype=torch.float32, device=device)


def multi_tensor_lamb_stage1_cuda(chunk_size, noop_flag, tensor_lists, per_tensor_decay, step,
                                  beta1, beta2, epsilon, global_grad_norm,
                                  max_global_grad_norm) -> None:
    """apex's LAMB stage 1 (see the module doc): lists ``[grads, params, exp_avgs, exp_avg_sqs,
    updates]``; the moments are updated in place and the direction written into ``updates``;
    ``step`` is the count apex's kernel adds 1 to; ``chunk_size`` is not used."""
    op = "multi_tensor_lamb_stage1_cuda"
    names = ["grads", "params", "exp_avgs", "exp_avg_sqs", "updates"]
    lists = arg_lists(op, tensor_lists, [", ".join(names)])
    check_aligned(op, names, lists)
    grads, params, exp_avgs, exp_avg_sqs, updates = lists
    if not params:
        return
    device = params[0].device
    check_noop(op, noop_flag, device)
    step = host_number(op, "step", step, int)
    if step < 0:
        raise ValueError(f"amp_C.{op}: step={step}; apex's kernel corrects the bias with "
                         f"1 - beta**(step + 1), step >= 0")
    beta1, beta2 = host_number(op, "beta1", beta1), host_number(op, "beta2", beta2)
    epsilon = host_number(op, "epsilon", epsilon)
    decays = _per_tensor(op, "per_tensor_decay", per_tensor_decay, len(params), device)
    norm = _scalar(op, "global_grad_norm", global_grad_norm, device)
    max_norm = host_number(op, "max_global_grad_norm", max_global_grad_norm)
    clip = torch.where(norm > max_norm, norm / max_norm, torch.ones_like(norm)).reshape(())
    corrections = (1.0 - beta1 ** (step + 1), 1.0 - beta2 ** (step + 1))
    with torch.no_grad():   # apex's kernels write the tensors' data, outside autograd
        _stage1(grads, params, exp_avgs, exp_avg_sqs, updates, decays, clip, beta1, beta2,
                epsilon, corrections)


def _stage1(grads, params, exp_avgs, exp_avg_sqs, updates, decays, clip, beta1, beta2, epsilon,
            corrections) -> None:
    scaled = torch._foreach_div([g.float() for g in grads], clip)   # new tensors
    m, v = fp32_state(exp_avgs), fp32_state(exp_avg_sqs)
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, scaled, alpha=1.0 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, scaled, scaled, value=1.0 - beta2)
    direction = torch._foreach_div(m, corrections[0])
    denominator = torch._foreach_div(v, corrections[1])
    torch._foreach_sqrt_(denominator)
    torch._foreach_add_(denominator, epsilon)
    torch._foreach_div_(direction, denominator)
    torch._foreach_add_(direction, torch._foreach_mul([p.float() for p in params], decays))
    for update, value in zip(updates, direction):
        update.copy_(value)
    write_back(exp_avgs, m)
    write_back(exp_avg_sqs, v)


def multi_tensor_lamb_stage2_cuda(chunk_size, noop_flag, tensor_lists, per_tensor_param_norm,
                                  per_tensor_update_norm, lr, weight_decay=None,
                                  use_nvlamb=None) -> None:
    """apex's LAMB stage 2 (see the module doc): lists ``[params, updates]``; ``p -= r *
    update`` with the trust ratio from the per-tensor norms. Without ``weight_decay`` (apex's
    form before April 2020) the ratio applies to every tensor; with it, only where
    ``use_nvlamb`` or ``weight_decay != 0``. ``chunk_size`` is not used."""
    op = "multi_tensor_lamb_stage2_cuda"
    names = ["params", "updates"]
    lists = arg_lists(op, tensor_lists, [", ".join(names)])
    # check_aligned takes the parameters from the second list: give it them there.
    check_aligned(op, names[::-1], lists[::-1])
    params, updates = lists
    if not params:
        return
    device = params[0].device
    check_noop(op, noop_flag, device)
    lr = host_number(op, "lr", lr)
    adaptive = weight_decay is None or bool(use_nvlamb) or \
        host_number(op, "weight_decay", weight_decay) != 0.0
    if adaptive:
        count = len(params)
        param_norms = torch.stack(_per_tensor(op, "per_tensor_param_norm",
                                              per_tensor_param_norm, count, device))
        update_norms = torch.stack(_per_tensor(op, "per_tensor_update_norm",
                                               per_tensor_update_norm, count, device))
        usable = (param_norms != 0) & (update_norms != 0)
        ratios = torch.where(usable, lr * param_norms / torch.where(usable, update_norms, 1.0),
                             torch.full_like(param_norms, lr))
        factors = list(ratios.unbind(0))
    else:
        factors = lr
    with torch.no_grad():   # apex's kernels write the tensors' data, outside autograd
        steps = torch._foreach_mul([u.float() for u in updates], factors)
        values = fp32_state(params)
        torch._foreach_sub_(values, steps)
        write_back(params, values)
