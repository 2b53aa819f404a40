"""What the fused optimizers (FusedSGD, FusedAdam, FusedLAMB, ...) share as torch optimizers: parameter checks, the cached
per-(group, device) updates, GradScaler's hand-over, ``zero_grad``, fp32 state on load."""
from __future__ import annotations

import logging
import numbers
from itertools import chain
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..apex_compat.optimizer_attributes import DummyOverflowBuf
from ..multi_tensor import _torch_fused
from ..multi_tensor._backend import backend
from .update import STEPPED_DTYPES, FusedUpdate, group_by_device, unit_scalars
from .watched_state import watch_params, watch_state

logger = logging.getLogger("apex_lite.optimizers")

Scalars = Callable[[torch.device], Tuple[torch.Tensor, torch.Tensor]]

# torch's messages for hyper-parameters out of range.
_INVALID = {"lr": "Invalid learning rate", "eps": "Invalid epsilon value",
            "momentum": "Invalid momentum value", "weight_decay": "Invalid weight_decay value"}

# Options of a loaded param group (torch's) that change the update in a way these kernels do not.
_REFUSED_LOADED_OPTIONS = ("amsgrad", "maximize")


class FusedOptimizer(torch.optim.Optimizer):
    """Base of the fused optimizers: ``step()`` makes one fused update per param group and
    device (``_update_class``), with hyper-parameters read from the group at every step."""

    # GradScaler hands its scale and found_inf over (``grad_scale``, ``found_inf`` attributes)
    # instead of unscaling: the ops unscale and skip themselves, half gradients included.
    _step_supports_amp_scaling = True
    # The update of one param group on one device. Where no native kernels serve a device and
    # torch's own fused kernels compute it (``torch_kernels``), fp32 parameters are stepped by
    # them (multi_tensor/_torch_fused.py).
    _update_class = FusedUpdate
    # Instance attributes that pickling and deepcopy keep (torch's __getstate__ keeps only
    # defaults, state and param_groups).
    _kept_attributes: Tuple[str, ...] = ("set_grad_none",)
    # apex's noop flag of its multi-tensor calls, which code written for apex passes to amp_C.
    _dummy_overflow_buf = DummyOverflowBuf()

    def __init__(self, params, defaults: dict, set_grad_none: bool):
        self.set_grad_none = set_grad_none
        self._updates: Optional[List[Tuple[dict, FusedUpdate]]] = None
        super().__init__(params, defaults)

    # ---- construction --------------------------------------------------------------------------

    @staticmethod
    def _check_number(name: str, value) -> None:
        """torch's checks of a hyper-parameter: a Python number, not negative."""
        if isinstance(value, torch.Tensor) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a Python number, got {type(value).__name__}; the "
                            f"fused optimizers read hyper-parameters on the host (use float())")
        if not value >= 0.0:
            raise ValueError(f"{_INVALID.get(name, 'Invalid ' + name + ' value')}: {value}")

    @classmethod
    def _check_adam_hyper(cls, lr, betas, eps, weight_decay) -> None:
        """torch.optim.Adam's checks of lr, betas, eps and weight_decay."""
        cls._check_number("lr", lr)
        cls._check_number("eps", eps)
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for index, beta in enumerate(betas):
            if isinstance(beta, torch.Tensor) or not isinstance(beta, numbers.Real):
                raise TypeError(f"betas[{index}] must be a Python number, got "
                                f"{type(beta).__name__}")
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
        cls._check_number("weight_decay", weight_decay)

    def add_param_group(self, param_group: dict) -> None:
        name = type(self).__name__
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):   # torch refuses sets with its own message
            params = list(params)
        param_group = dict(param_group, params=params)
        index = len(self.param_groups)
        seen = set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                continue     # torch's message
            where = f"parameter {i} of param group {index}"
            if p.is_complex():
                raise TypeError(f"{name}: {where} is complex ({p.dtype}); the fused optimizers "
                                f"step real parameters only. Optimize torch.view_as_real(p) "
                                f"instead, or use torch.optim for complex parameters.")
            if p.dtype not in STEPPED_DTYPES:
                raise TypeError(f"{name}: {where} is {p.dtype}; the fused optimizers step "
                                f"float32, float16 and bfloat16 parameters. Use torch.optim for "
                                f"{p.dtype} parameters.")
            if id(p) in seen:
                raise ValueError(f"{name}: {where} appears twice in its group; a fused step "
                                 f"would update it twice in one pass. List it once.")
            seen.add(id(p))
        super().add_param_group(param_group)
        watch_params(self.param_groups[-1])
        self._updates = None

    # ---- the cached updates --------------------------------------------------------------------

    def _fused_updates(self) -> List[Tuple[dict, FusedUpdate]]:
        """``(group, update)`` per param group and device, built once per parameter set (a
        group's ``params`` list, watched: a parameter replaced in it is seen)."""
        updates = self._updates
        if updates is None or self._params_signature() != self._updates_signature:
            updates = []
            for index, group in enumerate(self.param_groups):
                params = watch_params(group)
                by_device = group_by_device(params)
                if len(by_device) > 1:
                    logger.info("%s: param group %d holds parameters on %s: they are stepped "
                                "with one fused call per device", type(self).__name__, index,
                                ", ".join(str(d) for d in by_device))
                for device, indices in by_device.items():
                    label = f"{type(self).__name__} param group {index}"
                    if len(by_device) > 1:
                        label += f" on {device}"
                    ops = _torch_fused if self._torch_kernels() and \
                        backend(device)[0] != "native" else None
                    extra = {} if ops is None else {"ops": ops}
                    updates.append((group, self._update_class([params[i] for i in indices],
                                                              label=label, **extra)))
            self._updates = updates
            # Taken after watch_params, which may have made a group's list a new one.
            self._updates_signature = self._params_signature()
        return updates

    def _torch_kernels(self) -> bool:
        """Whether torch's fused kernels compute this optimizer's update: its update class
        says (``torch_kernels``); one that builds its updates with a method of its own
        (FusedMixedPrecisionLamb) has none."""
        update_class = self._update_class
        return isinstance(update_class, type) and update_class.torch_kernels

    def _params_signature(self) -> list:
        """What the cached updates hold for: each group's params list, its length and version."""
        return [(id(g["params"]), len(g["params"]), getattr(g["params"], "version", None))
                for g in self.param_groups]

    def _scalars(self) -> Scalars:
        """``device -> (inv_scale, found_inf)`` for this step: GradScaler's when it handed them
        over (``grad_scale`` / ``found_inf`` set on the optimizer), else 1 and 0."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if not isinstance(found_inf, torch.Tensor):   # GradScaler's sum over no device is 0
            found_inf = None
        if grad_scale is None and found_inf is None:
            return unit_scalars
        # GradScaler's own unscale multiplies by the fp32 reciprocal taken in fp64; so do we.
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()
        per_device: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

        def scalars(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
            pair = per_device.get(device)
            if pair is None:
                one, zero = unit_scalars(device)
                pair = per_device[device] = (
                    one if inv_scale is None else inv_scale.to(device).reshape(1),
                    zero if found_inf is None
                    else found_inf.to(device=device, dtype=torch.float32).reshape(1))
            return pair
        return scalars

    # ---- step ----------------------------------------------------------------------------------

    def step(self, closure=None):
        """Performs a single optimization step (one fused op per param group and device).

        Args:
            closure (callable, optional): reevaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._fused_step(self._scalars())
        return loss

    def _fused_step(self, scalars: Scalars) -> None:
        state = watch_state(self)
        for group, update in self._fused_updates():
            inv_scale, found_inf = scalars(update.device)
            update(state, inv_scale, found_inf, self._hyper(group))

    def _hyper(self, group: dict):
        raise NotImplementedError

    # ---- zero_grad, state ----------------------------------------------------------------------

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Clears the gradients: sets them to None when ``set_to_none`` (default: the
        constructor's ``set_grad_none``, as apex), else zeroes them in place."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def __getstate__(self):
        state = super().__getstate__()
        for name in self._kept_attributes:
            state[name] = getattr(self, name)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self._updates = None

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict of this optimizer or of torch's (SGD / Adam / AdamW): state stays
        fp32 on the parameters' devices (torch would cast it to each parameter's dtype)."""
        name = type(self).__name__
        for index, group in enumerate(state_dict.get("param_groups", ())):
            for option in _REFUSED_LOADED_OPTIONS:
                if group.get(option):
                    raise ValueError(f"{name}: the state dict's param group {index} has "
                                     f"{option}=True, which {name} does not compute; load it "
                                     f"into the torch optimizer that saved it")
        kept = self._fp32_state_of_half_params(state_dict)
        super().load_state_dict(state_dict)
        for param, entries in kept.items():
            self.state[param].update(entries)
        self._take_group_steps()
        self._updates = None

    def _fp32_state_of_half_params(self, state_dict: dict) -> Dict[torch.Tensor, dict]:
        """The saved fp32 state tensors of this optimizer's fp16/bf16 parameters, which torch's
        load would round to the parameter's dtype (an fp16 exp_avg_sq underflows), as fp32
        tensors on each parameter's device. A load_state_dict pre-hook's changes to those
        entries are not seen."""
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        if len(saved_ids) != len(params):
            return {}        # torch's load refuses it, with its message
        kept = {}
        for saved_id, param in zip(saved_ids, params):
            entry = state_dict["state"].get(saved_id)
            if param.dtype == torch.float32 or not entry:
                continue
            kept[param] = {key: value.to(device=param.device, dtype=torch.float32)
                           for key, value in entry.items()
                           if isinstance(value, torch.Tensor) and value.is_floating_point()
                           and key != "step" and value.shape == param.shape}
        return kept

    def _take_group_steps(self) -> None:
        """apex's FusedAdam and FusedLAMB kept one step count per group (``group["step"]``);
        ours is per parameter, as torch's: a loaded group count moves into its parameters'
        state."""
        for group in self.param_groups:
            count = group.pop("step", None)
            if count is None:
                continue
            for p in group["params"]:
                entry = self.state.get(p)
                if entry and "step" not in entry:
                    entry["step"] = torch.tensor(float(count), dtype=torch.float32,
                                                 device=p.device)

