"""apex's ``FusedMixedPrecisionLamb``: LAMB whose learning rate and step count are device tensors,
and which keeps fp32 master copies of the parameters of ``reduced_precision_dtype``.

The update is ``FusedLAMB``'s (``apex_lite.optimizers.fused_lamb``), computed by the op
``fused_lamb_mp_`` (csrc/ops.cpp), which is ``fused_lamb_`` with ``lr`` and the step count read
from 1-element tensors where the kernel runs (no host read on CUDA):

- ``param_groups[i]["lr"]``: a 0-dim fp32 tensor on the parameters' device (a number given for
  it is made one); LR schedulers write it in place.
- ``param_groups[i]["step"]``: apex's int32 ``[1]`` tensor, the group's count of steps taken. A
  step adds 1 to every group's count unless the step is skipped (GradScaler's ``found_inf``),
  before the update, whose bias corrections use the new count, as apex does. It is replaced by
  a new tensor rather than changed in place, so a ``state_dict()`` taken earlier keeps its count.
- per parameter (``state[p]``, keyed by the model's parameter as in apex): ``exp_avg`` and
  ``exp_avg_sq`` in fp32 whatever the parameter's dtype, and for a parameter of
  ``reduced_precision_dtype`` its fp32 master ``master_param``, made from the parameter at its
  first step: the update is applied to the master in fp32 and the parameter receives it rounded
  once. apex kept the masters outside the state, so its checkpoints lost them; here they are in
  ``state_dict()`` and come back with ``load_state_dict`` (a state without them, such as apex's,
  makes them again from the parameters). Parameters of other dtypes are stepped in fp32 and
  rounded once into themselves, as ``FusedLAMB`` does (apex kept their moments in their dtype).
"""
from __future__ import annotations

import numbers
from typing import Dict, List, NamedTuple, Optional

import torch

from ..apex_compat.optimizer_attributes import ApexMode, ApexOp
from ._optimizer import FusedOptimizer, Scalars
from .fused_lamb import LambHyper, grads_and_global_norm
from .update import FusedUpdate, fp32_like, state_entry, zeros32
from .watched_state import watch_state

__all__ = ["FusedMixedPrecisionLamb", "MixedPrecisionLambHyper", "MixedPrecisionLambUpdate"]

_REDUCED_DTYPES = (None, torch.float16, torch.bfloat16)


class MixedPrecisionLambHyper(NamedTuple):
    """The hyper-parameters ``fused_lamb_mp_`` takes after ``grad_norm``: LAMB's without ``lr``
    (a tensor, passed apart)."""
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    bias_correction: bool
    grad_averaging: bool
    max_grad_norm: float
    use_nvlamb: bool

    @classmethod
    def from_group(cls, group: dict) -> "MixedPrecisionLambHyper":
        """From a param group of FusedMixedPrecisionLamb (its lr is not read)."""
        return cls(*LambHyper.from_group(dict(group, lr=0.0))[1:])


class _OpCall(NamedTuple):
    """The lists of one ``fused_lamb_mp_`` call: the parameters with masters, or those without."""
    picks: Optional[List[int]]        # indices into the plan's parameters; None: all of them
    params: List[torch.Tensor]        # what the op updates: the masters, or the parameters
    exp_avgs: List[torch.Tensor]
    exp_avg_sqs: List[torch.Tensor]
    model_params: List[torch.Tensor]  # the parameters behind the masters, or empty


class MixedPrecisionLambUpdate(FusedUpdate):
    """The ``fused_lamb_mp_`` calls of one param group on one device: one over the parameters of
    ``reduced_precision_dtype`` (their fp32 masters updated, the parameters written rounded),
    one over the others; a group of one kind makes one call. The arguments (``params``,
    ``grad_sources``, ``model_params``, ``label``) are :class:`FusedUpdate`'s."""

    kind = "lamb"
    needs_whole_parameters = True   # the trust ratio: ||param|| / ||update|| per parameter

    def __init__(self, params, grad_sources=None, model_params=None, *, label: str = "",
                 reduced_precision_dtype: Optional[torch.dtype] = None):
        super().__init__(params, grad_sources, model_params, label=label)
        if self.model_params:
            raise ValueError(f"{self.label}: model_params are not taken; the parameters of "
                             f"reduced_precision_dtype get their fp32 masters from the "
                             f"optimizer itself")
        self.reduced_precision_dtype = reduced_precision_dtype

    @torch.no_grad()
    def __call__(self, state: Dict[torch.Tensor, dict], inv_scale: torch.Tensor,
                 found_inf: torch.Tensor, hyper: MixedPrecisionLambHyper,
                 grad_norm: torch.Tensor, step: torch.Tensor, lr: torch.Tensor, *,
                 grads: Optional[List[Optional[torch.Tensor]]] = None) -> None:
        """One step; ``step`` (the number of the step being taken) and ``lr`` are 1-element
        fp32 tensors on the update's device."""
        self._run(state, inv_scale, found_inf, hyper, grads, (grad_norm, step, lr))

    def _state_lists(self, params: List[torch.Tensor], state, hyper) -> tuple:
        label = self.label
        masters, exp_avgs, exp_avg_sqs = [], [], []
        for p in params:
            s = state_entry(state, p)
            has_moments = ("exp_avg" in s, "exp_avg_sq" in s)
            if any(has_moments) and not all(has_moments):
                raise ValueError(f"{label}: the state of a parameter of shape {tuple(p.shape)} "
                                 f"holds {sorted(s)} but needs exp_avg and exp_avg_sq; load a "
                                 f"state_dict saved by the same kind of optimizer")
            for name in ("exp_avg", "exp_avg_sq"):
                s[name] = fp32_like(s[name], p, name, label) if name in s else zeros32(p)
            master = None
            if p.dtype == self.reduced_precision_dtype:
                if "master_param" in s:
                    master = s["master_param"] = fp32_like(s["master_param"], p,
                                                           "master_param", label)
                else:
                    master = s["master_param"] = p.detach().to(torch.float32, copy=True)
            masters.append(master)
            exp_avgs.append(s["exp_avg"])
            exp_avg_sqs.append(s["exp_avg_sq"])
        with_master = [i for i, m in enumerate(masters) if m is not None]
        without = [i for i, m in enumerate(masters) if m is None]
        calls = []
        for picks, mastered in ((with_master, True), (without, False)):
            if not picks:
                continue
            pick = (lambda xs: xs) if len(picks) == len(params) else \
                (lambda xs: [xs[i] for i in picks])
            calls.append(_OpCall(None if len(picks) == len(params) else picks,
                                 pick(masters) if mastered else pick(list(params)),
                                 pick(exp_avgs), pick(exp_avg_sqs),
                                 pick(list(params)) if mastered else []))
        return (calls,)

    def _launch(self, ops, plan, state, grads, inv_scale, found_inf,
                hyper: MixedPrecisionLambHyper, grad_norm: torch.Tensor, step: torch.Tensor,
                lr: torch.Tensor) -> None:
        (calls,) = plan.lists
        for call in calls:
            call_grads = grads if call.picks is None else [grads[i] for i in call.picks]
            ops.fused_lamb_mp_(call.params, call_grads, call.exp_avgs, call.exp_avg_sqs,
                               call.model_params, step, lr, inv_scale, found_inf, grad_norm,
                               *hyper)


def _lr_tensor(value, device: torch.device) -> torch.Tensor:
    """A group's lr as the 0-dim fp32 tensor on ``device`` the op reads (a new one)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise TypeError(f"lr must be a number or a 1-element floating tensor, got a tensor "
                            f"of {value.numel()} elements of {value.dtype}")
        return value.detach().to(device=device, dtype=torch.float32, copy=True).reshape(())
    FusedOptimizer._check_number("lr", value)
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def _step_tensor(value, device: torch.device) -> torch.Tensor:
    """A group's step count as apex's int32 [1] tensor on ``device`` (a new one)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"step must be a number or a 1-element tensor, got "
                            f"{value.numel()} elements")
        return value.detach().to(device=device, dtype=torch.int32, copy=True).reshape(1)
    if not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"step must be a non-negative integer (the steps taken), got {value!r}")
    return torch.tensor([int(value)], dtype=torch.int32, device=device)


class FusedMixedPrecisionLamb(FusedOptimizer):
    r"""LAMB with device-side ``lr`` and ``step``, and fp32 masters of half parameters: apex's
    ``FusedMixedPrecisionLamb``.

    Args:
        params: parameters or param groups (fp32, fp16 and bf16; apex wanted one dtype per
            group, any mix is stepped here).
        lr: a number or a 1-element tensor; each group holds it as a 0-dim fp32 tensor on its
            parameters' device.
        step: the number of steps already taken (apex's group count starts there).
        bias_correction, betas, eps, weight_decay, adam_w_mode, grad_averaging, use_nvlamb:
            as ``FusedLAMB``'s.
        amsgrad: not supported (refused, as apex did).
        max_grad_norm: as ``FusedLAMB``'s: the gradients are scaled by ``max_grad_norm /
            norm`` when the global norm of all true gradients exceeds it; 0 turns clipping off
            (apex's kernel then zeroed every gradient). Read from each group at every step
            (apex read the constructor's).
        reduced_precision_dtype: None, torch.float16 or torch.bfloat16: parameters of this
            dtype get fp32 masters kept in the optimizer's state (``master_param``).

    The update is computed in fp32 and rounded once into each parameter. Under
    ``torch.amp.GradScaler`` the op unscales the gradients (and their norm) and skips on the
    scaler's ``found_inf`` itself, the step counts included (``_step_supports_amp_scaling``:
    the scaler hands over its scale and ``found_inf``; apex's ``step(grad_scaler=...)`` keyword
    is not taken, as torch's GradScaler is dropping it). Under apex_lite's amp it takes the
    unfused step (``amp.report()`` says so): at O2 amp puts its fp32 masters in the param
    groups, and this optimizer, seeing fp32 parameters only, keeps no masters of its own.
    """

    _kept_attributes = FusedOptimizer._kept_attributes + ("reduced_precision_dtype",)
    # apex's per-instance attributes (its ops here are amp_C's mixed-precision ones).
    multi_tensor_lamb = ApexOp("multi_tensor_lamb_mp")
    multi_tensor_l2norm = ApexOp("multi_tensor_l2norm_mp")
    adam_w_mode = ApexMode("adam_w_mode")
    use_nvlamb = ApexMode("use_nvlamb", to_apex=bool, values=(False, True))

    def __init__(self, params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999),
                 eps=1e-6, weight_decay=0.01, amsgrad=False, adam_w_mode=True,
                 grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False,
                 reduced_precision_dtype=None):
        name = type(self).__name__
        if amsgrad:
            raise RuntimeError(f"{name} does not support the AMSGrad variant; use "
                               f"{name}(amsgrad=False), or torch.optim.Adam(amsgrad=True) if "
                               f"AMSGrad is what you need.")
        if reduced_precision_dtype not in _REDUCED_DTYPES:
            raise ValueError(f"{name}: reduced_precision_dtype={reduced_precision_dtype!r}; "
                             f"pass None, torch.float16 or torch.bfloat16 (the dtype of the "
                             f"parameters that get fp32 masters)")
        self._check_adam_hyper(0.0, betas, eps, weight_decay)
        self._check_number("max_grad_norm", max_grad_norm)
        lr_value = _lr_tensor(lr, torch.device("cpu"))
        self.reduced_precision_dtype = reduced_precision_dtype
        defaults = dict(lr=lr_value, step=_step_tensor(step, torch.device("cpu")),
                        bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, adam_w_mode=adam_w_mode,
                        use_nvlamb=use_nvlamb)
        super().__init__(params, defaults, set_grad_none=True)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._tensor_scalars(self.param_groups[-1])

    @staticmethod
    def _tensor_scalars(group: dict) -> None:
        """The group's lr and step as their own tensors on its parameters' device (a group's
        default would otherwise be the tensor every other group holds)."""
        params = group["params"]
        device = params[0].device if len(params) else torch.device("cpu")
        group["lr"] = _lr_tensor(group["lr"], device)
        group["step"] = _step_tensor(group["step"], device)

    def _update_class(self, params, label: str = "") -> MixedPrecisionLambUpdate:
        return MixedPrecisionLambUpdate(params, label=label,
                                        reduced_precision_dtype=self.reduced_precision_dtype)

    def _hyper(self, group: dict) -> MixedPrecisionLambHyper:
        return MixedPrecisionLambHyper.from_group(group)

    def _fused_step(self, scalars: Scalars) -> None:
        updates = self._fused_updates()
        grads, norms = grads_and_global_norm(updates, scalars)
        # Every group's count, as apex: + 1 unless the step is skipped, used by the update. New
        # tensors, put in the groups once every update has run (a refused call leaves them).
        counts = {}
        for group in self.param_groups:
            count = group["step"]
            _, found_inf = scalars(count.device)
            counts[id(group)] = count + (found_inf == 0).to(count.dtype)
        state = watch_state(self)
        for (group, update), update_grads in zip(updates, grads):
            norm = norms.get(update.device)
            if norm is None:
                continue     # no gradient on that device
            device = update.device
            inv_scale, found_inf = scalars(device)
            step = counts[id(group)].to(device=device, dtype=torch.float32).reshape(1)
            lr = group["lr"].to(device=device, dtype=torch.float32).reshape(1)
            update(state, inv_scale, found_inf, self._hyper(group), norm, step, lr,
                   grads=update_grads)
        for group in self.param_groups:
            group["step"] = counts[id(group)]

    def _take_group_steps(self) -> None:
        """After a load: the groups' lr and step as their own tensors on their devices (the
        group count stays in the group, apex's layout)."""
        for group in self.param_groups:
            self._tensor_scalars(group)
