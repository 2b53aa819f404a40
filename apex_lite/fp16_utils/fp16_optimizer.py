"""apex.fp16_utils.FP16_Optimizer: fp32 master weights for a half (fp16 or bf16) model, around
any torch optimizer, with apex's interface, loss scaling and state_dict keys.

    model = convert_network(model, torch.float16)          # or torch.bfloat16
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               dynamic_loss_scale=True)
    loss = loss_fn(model(x), y)
    optimizer.zero_grad()
    optimizer.backward(loss)       # was: loss.backward()
    optimizer.step()

The wrapped optimizer steps fp32 masters of the half parameters (and the fp32 parameters
themselves); ``step`` copies the masters back into the half model in one fused pass. ``backward``
scales the loss; ``update_master_grads`` (called by ``backward`` unless told not to) unscales
the half gradients into the masters' fp32 gradients, and the fp32 parameters' in place, in one
fused pass per device that also checks them for inf and NaN, then makes the skip decision (one
host sync).

Where apex_lite differs from apex (each a fix):
- a step whose gradients are not finite is never applied, with a static scale too (apex skipped
  only with a dynamic scale); ``step(closure)`` skips too, where apex retried the closure;
- several ``backward`` calls before a step add up correctly, also for fp32 parameters and
  across a change of the scale (apex unscaled fp32 gradients once per call, in place);
- a master whose half parameter got no gradient gets none (apex kept its stale one);
- ``step`` after ``backward(..., update_master_grads=False)`` without ``update_master_grads()``,
  or with no ``backward`` since the last step or ``zero_grad``, raises instead of applying stale
  master gradients;
- parameters may live on any device, fp16 or bf16; apex's messages are logged (``logging``);
- ``dynamic_loss_args['scale_factor']`` is honoured (apex ignored it);
- the two copies of a parameter follow amp's O2 rule (amp/two_copies.py): weights written into
  the model after wrapping (``model.load_state_dict``, a re-initialisation) reach the masters at
  the next ``update_master_grads()`` or ``step()``, where apex's step overwrote them with the
  stale masters; a write to a master reaches the model at the next ``step()``; both written is
  refused;
- every half parameter of the optimizer gets a master, frozen ones too, following its
  ``requires_grad``: a parameter frozen at wrapping and unfrozen later is stepped through its
  master with its true gradient, where apex stepped the half parameter with the scaled one (and
  an fp32 one unfrozen later has its gradient unscaled too).
"""
from __future__ import annotations

import logging
from typing import List

import torch

from ..amp.pairs import Pairs
from ..amp.scaler import fp32_scale_problem
from ..amp.two_copies import TwoCopies
from .fp16util import clip_grad_norm, master_grad_pairs
from .loss_scaler import OptimizerLossScaler, scale_by_device

__all__ = ["FP16_Optimizer"]

logger = logging.getLogger(__name__)

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_DYNAMIC_LOSS_ARGS = ("init_scale", "scale_factor", "scale_window", "min_loss_scale",
                      "max_loss_scale")
_STATE_KEYS = ("loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
               "optimizer_state_dict", "fp32_from_fp16")


def _check_wrappable(init_optimizer) -> None:
    """Refuse what FP16_Optimizer cannot wrap, before anything changes."""
    if isinstance(init_optimizer, FP16_Optimizer):
        raise TypeError("this optimizer is already an FP16_Optimizer; wrap the torch optimizer "
                        "once")
    if not isinstance(getattr(init_optimizer, "param_groups", None), list):
        raise TypeError(f"FP16_Optimizer wraps a torch optimizer (with param_groups); got "
                        f"{type(init_optimizer).__name__}")
    if hasattr(init_optimizer, "_amp_stash"):
        raise ValueError("this optimizer was returned by amp.initialize, which already keeps "
                         "fp32 master weights and scales the loss; use amp (opt_level O2) or "
                         "FP16_Optimizer, not both")
    for g, group in enumerate(init_optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if param.requires_grad and param.dtype not in _HALF_DTYPES + (torch.float32,):
                raise TypeError(f"Wrapped parameters must be float32, float16 or bfloat16 "
                                f"tensors. Received {param.dtype} (param_groups[{g}]['params']"
                                f"[{i}], shape {tuple(param.shape)})")


def _make_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args) -> OptimizerLossScaler:
    if not dynamic_loss_scale:
        return OptimizerLossScaler(static_loss_scale)
    args = dict(dynamic_loss_args or {})
    unknown = sorted(set(args) - set(_DYNAMIC_LOSS_ARGS))
    if unknown:
        raise TypeError(f"dynamic_loss_args has unknown keys {unknown}; it takes "
                        f"{', '.join(_DYNAMIC_LOSS_ARGS)}")
    return OptimizerLossScaler("dynamic", **args)


class FP16_Optimizer:   # noqa: N801 (apex's name)
    """fp32 master weights and loss scaling around ``init_optimizer`` (apex's FP16_Optimizer).

    Args:
        init_optimizer: a torch optimizer over the model's parameters: fp16 or bf16 ones get
            fp32 masters (which replace them in its ``param_groups``, their state moved along),
            fp32 ones are stepped as they are.
        static_loss_scale: the loss scale when not dynamic (default 1.0).
        dynamic_loss_scale: scale dynamically (start 2**16, halved on an overflow, doubled after
            2000 clean steps, at most 2**24).
        dynamic_loss_args: a dict overriding ``init_scale``, ``scale_factor``, ``scale_window``,
            ``min_loss_scale``, ``max_loss_scale`` of the dynamic scale.
        verbose: log each wrapped parameter at INFO (apex printed them).
    Raises:
        TypeError: the optimizer cannot be wrapped (parameters of other dtypes; already wrapped);
            unknown ``dynamic_loss_args``.
        ValueError: an optimizer that amp.initialize returned; a scale that cannot work.
    Nothing is changed when it raises.
    """

    def __init__(self, init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
                 dynamic_loss_args=None, verbose=True):
        _check_wrappable(init_optimizer)
        scaler = _make_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.Tensor]] = []
        # The two copies of each half parameter, under amp's O2 rule (amp/two_copies.py).
        self._pairs = Pairs([])
        self._copies = TwoCopies(self._pairs)
        for g, group in enumerate(init_optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {g}:")
            halves, masters, fp32s = [], [], []
            for i, param in enumerate(group["params"]):
                self.maybe_print(f"FP16_Optimizer received {param.dtype} parameter with "
                                 f"{param.size()}")
                if param.dtype == torch.float32:
                    fp32s.append(param)
                    continue
                master = param.detach().clone().float()
                master.requires_grad = param.requires_grad
                group["params"][i] = master
                self._pairs.adopt(param, master, f"param_groups[{g}]['params'][{i}]")
                if param in init_optimizer.state:
                    init_optimizer.state[master] = init_optimizer.state.pop(param)
                halves.append(param)
                masters.append(master)
            self.fp16_groups.append(halves)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(fp32s)
        self.all_fp16_params = [p for group in self.fp16_groups for p in group]
        self.all_fp32_from_fp16_params = [p for group in self.fp32_from_fp16_groups for p in group]
        self.all_fp32_from_fp32_params = [p for group in self.fp32_from_fp32_groups for p in group]
        # torch's load_state_dict casts per-parameter state to the (now fp32) parameters' dtype.
        init_optimizer.load_state_dict(init_optimizer.state_dict())
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.loss_scaler = scaler
        self._copies.record()
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm
        # The loss scale the half model's gradients hold, and the fp32 parameters' (1.0 once
        # unscaled); None after zero_grad. A backward first brings both to its own scale.
        self._half_grads_scale = None
        self._fp32_grads_scale = None
        self._update_pending = False   # a backward since the last update_master_grads
        self._masters_fresh = False    # master gradients updated since the last step/zero_grad

    def maybe_print(self, msg):
        """Log ``msg`` at INFO when ``verbose`` (apex printed it)."""
        if self.verbose:
            logger.info(msg)

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    def zero_grad(self, set_grads_to_None=False):
        """Zero the gradients of the masters, the fp32 parameters and the half model's parameters
        (in place, or set to None with ``set_grads_to_None``)."""
        for param in [p for g in self.optimizer.param_groups for p in g["params"]] + \
                self.all_fp16_params:
            if set_grads_to_None:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_()
                param.grad.zero_()
        self._half_grads_scale = self._fp32_grads_scale = None
        self._update_pending = self._masters_fresh = False

    def _master_params_to_model_params(self):
        """The masters' values into the half model, rounded, in one fused pass per device."""
        self._copies.round_into_model()

    def _grads(self, params) -> List[torch.Tensor]:
        return [p.grad for p in params if p.grad is not None]

    def _bring_grads_to(self, scale: float) -> None:
        """Before a backward: gradients left by an earlier backward of this step are brought to
        ``scale``, so that the new ones add to them at one scale."""
        for params, held in ((self.all_fp16_params, self._half_grads_scale),
                             (self.all_fp32_from_fp32_params, self._fp32_grads_scale)):
            if held is not None and held != scale:
                grads = self._grads(params)
                with torch.no_grad():
                    scale_by_device(grads, grads, scale / held, {})
        self._half_grads_scale = self._fp32_grads_scale = scale

    def clip_master_grads(self, max_norm, norm_type=2):
        """Clip the fp32 master gradients to ``max_norm`` (``torch.nn.utils.clip_grad_norm_``
        with ``norm_type`` over every parameter the optimizer steps). Returns their total norm
        before clipping, or -1 when the last gradients overflowed (nothing is clipped then)."""
        if self.overflow:
            return -1
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    def state_dict(self):
        """apex's keys: ``loss_scaler`` (the scaler object), ``dynamic_loss_scale``,
        ``overflow``, ``first_closure_call_this_step``, ``optimizer_state_dict`` (the wrapped
        optimizer's) and ``fp32_from_fp16`` (the masters, per group; a write to either copy
        since the last step taken in first)."""
        self._copies.sync("FP16_Optimizer.state_dict()", compare_all=True)
        return {"loss_scaler": self.loss_scaler, "dynamic_loss_scale": self.dynamic_loss_scale,
                "overflow": self.overflow,
                "first_closure_call_this_step": self.first_closure_call_this_step,
                "optimizer_state_dict": self.optimizer.state_dict(),
                "fp32_from_fp16": self.fp32_from_fp16_groups}

    def _check_saved_masters(self, saved) -> None:
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.fp32_from_fp16_groups):
            raise ValueError(f"state_dict['fp32_from_fp16'] must hold one list of masters per "
                             f"param group ({len(self.fp32_from_fp16_groups)}); got "
                             f"{len(saved) if isinstance(saved, (list, tuple)) else saved!r}")
        for g, (current, masters) in enumerate(zip(self.fp32_from_fp16_groups, saved)):
            shapes = [tuple(p.shape) for p in current]
            got = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                   for t in masters]
            if shapes != got:
                raise ValueError(f"state_dict['fp32_from_fp16'][{g}] holds masters of shapes "
                                 f"{got}; this FP16_Optimizer's group {g} has {shapes}: the "
                                 f"state is from another model or optimizer")

    def load_state_dict(self, state_dict):
        """Load what ``state_dict()`` returned (after ``model.load_state_dict``, as in apex): the
        wrapped optimizer's state, the loss scale, and the fp32 masters, which are also copied
        into the half model. Raises ValueError, changing nothing, when keys are missing or the
        masters do not fit this optimizer's parameters."""
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(f"not an FP16_Optimizer state_dict: it lacks {missing}")
        self._check_saved_masters(state_dict["fp32_from_fp16"])
        scaler = OptimizerLossScaler.from_saved(state_dict["loss_scaler"])
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.loss_scaler = scaler
        self.dynamic_loss_scale = bool(state_dict["dynamic_loss_scale"])
        self.overflow = bool(state_dict["overflow"])
        self.first_closure_call_this_step = bool(state_dict["first_closure_call_this_step"])
        self._copies.load([(self._pairs.of_master(master), value)
                           for current, saved in zip(self.fp32_from_fp16_groups,
                                                     state_dict["fp32_from_fp16"])
                           for master, value in zip(current, saved)])

    def step(self, closure=None):
        """Step the fp32 masters with the wrapped optimizer and copy them into the half model;
        or skip, when the gradients of the last ``update_master_grads`` were not finite (the
        dynamic scale was lowered then). Returns the wrapped optimizer's result (None when
        skipped; the closure's loss with a closure).

        With ``closure`` (which must call ``self.backward(loss)`` and return the loss), the
        closure is called first, and the step skipped when its gradients are not finite;
        later evaluations by the wrapped optimizer (LBFGS) are retried with a lowered dynamic
        scale while they overflow.

        Raises:
            RuntimeError: no master gradients since the last step or ``zero_grad`` (a
                ``loss.backward()`` instead of ``optimizer.backward(loss)``), or a
                ``backward(..., update_master_grads=False)`` not followed by
                ``update_master_grads()``.
        """
        if closure is not None:
            return self._step_with_closure(closure)
        self._check_master_grads("step()")
        self._copies.sync("FP16_Optimizer.step()")
        self._masters_fresh = False
        if self.overflow:
            self._log_skip()
            return None
        result = self.optimizer.step()
        self._master_params_to_model_params()
        return result

    def _check_master_grads(self, where: str) -> None:
        if self._update_pending:
            raise RuntimeError(f"{where}: backward(loss, update_master_grads=False) was called "
                               f"after the last update_master_grads(), so the master gradients "
                               f"are stale; call optimizer.update_master_grads() first")
        if not self._masters_fresh:
            raise RuntimeError(f"{where}: no gradients came through FP16_Optimizer since the "
                               f"last step or zero_grad; call optimizer.backward(loss) instead "
                               f"of loss.backward() (it scales the loss and fills the fp32 "
                               f"master gradients)")

    def _log_skip(self):
        logger.info("Gradient overflow.  Skipping step, loss scale is now %s",
                    self.loss_scaler.loss_scale())

    def _step_with_closure(self, closure):
        with torch.enable_grad():
            loss = closure()
        self._check_master_grads("step(closure)")
        self._masters_fresh = False
        if self.overflow:
            self._log_skip()
            return loss
        first = True

        def evaluate():
            before = self.loss_scaler.loss_scale()
            return closure(), before

        def wrapped_closure():
            nonlocal first
            if first:   # the gradients of the call above are in the masters
                first = False
                self.first_closure_call_this_step = False
                return loss
            # The wrapped optimizer moved the masters: the half model must see them.
            self._master_params_to_model_params()
            value, before = evaluate()
            while self.overflow:
                now = self.loss_scaler.loss_scale()
                if not now < before:
                    raise FloatingPointError(
                        f"FP16_Optimizer.step(closure): a re-evaluation inside the wrapped "
                        f"optimizer's step gave non-finite gradients at loss scale {before}, "
                        f"which cannot be lowered (a static scale, or the dynamic floor), and "
                        f"that step cannot be skipped any more. Use dynamic_loss_scale=True, or "
                        f"find the inf/NaN")
                logger.info("OVERFLOW within closure! Retrying at loss scale %s", now)
                value, before = evaluate()
            return value

        result = self.optimizer.step(wrapped_closure)
        self.first_closure_call_this_step = True
        self._masters_fresh = False   # re-evaluations inside the step made gradients of old masters
        self._master_params_to_model_params()
        return result

    def backward(self, loss, update_master_grads=True, retain_graph=False):
        """``(loss.float() * loss_scale).backward(retain_graph=retain_graph)``, then (unless
        ``update_master_grads=False``, to add more losses first) ``update_master_grads()``.
        Several calls before a step add their gradients, as ``loss.backward()`` would."""
        scale = self.loss_scaler.loss_scale()
        self._bring_grads_to(scale)
        scaled_loss = loss.float() * scale
        scaled_loss.backward(retain_graph=retain_graph)
        self._update_pending = True
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self):
        """Unscale the half model's gradients into the fp32 masters' gradients, and the fp32
        parameters' gradients in place, checking them for inf and NaN (one fused pass per
        device), and make the skip decision (``self.overflow``; one host sync). A dynamic scale
        moves here."""
        # Writes to the model since the last step reach the masters, and the masters follow
        # their parameters' requires_grad, before the gradients go to them.
        self._copies.sync("FP16_Optimizer.update_master_grads()")
        scaler = self.loss_scaler
        scaler.clear_overflow_state()
        current = scaler.loss_scale()
        model_grads, master_grads = master_grad_pairs(self.all_fp16_params,
                                                      self.all_fp32_from_fp16_params)
        with torch.no_grad():
            scaler.unscale(model_grads, master_grads, self._half_grads_scale or current)
            fp32_grads = self._grads(self.all_fp32_from_fp32_params)
            scaler.unscale(fp32_grads, fp32_grads, self._fp32_grads_scale or current)
        self._fp32_grads_scale = 1.0
        self.overflow = scaler.update_scale()
        self._update_pending = False
        self._masters_fresh = True

    def inspect_master_grad_data(self):
        """The fp32 master gradients (``.grad.data`` or None), a list per param group; None,
        with a warning logged, while the last gradients overflowed."""
        if self.overflow:
            logger.warning("calling FP16_Optimizer.inspect_master_grad_data while in an overflow "
                           "state: gradients are invalid (may be inf, nan, or stale); returning "
                           "None")
            return None
        return [[p.grad.data if p.grad is not None else None for p in group["params"]]
                for group in self.optimizer.param_groups]

    def _get_loss_scale(self):
        return self.loss_scaler.loss_scale()

    def _set_loss_scale(self, value):
        problem = fp32_scale_problem(float(value)) if float(value) > 0 else \
            "it must be positive"
        if problem:
            raise ValueError(f"loss_scale={value!r} cannot be used: {problem}")
        self.loss_scaler._loss_scale = float(value)

    loss_scale = property(_get_loss_scale, _set_loss_scale,
                          doc="The current loss scale (settable).")

    def _get_state(self):
        return self.optimizer.state

    def _set_state(self, value):
        self.optimizer.state = value

    state = property(_get_state, _set_state, doc="The wrapped optimizer's ``state``.")

    def _get_param_groups(self):
        return self.optimizer.param_groups

    def _set_param_groups(self, value):
        self.optimizer.param_groups = value

    param_groups = property(_get_param_groups, _set_param_groups,
                            doc="The wrapped optimizer's ``param_groups`` (masters in place of "
                                "half parameters), e.g. to change the learning rate.")

    def __repr__(self):
        kind = "dynamic" if self.loss_scaler.dynamic else "static"
        return (f"FP16_Optimizer({self.optimizer!r}, {kind} loss scale "
                f"{self.loss_scaler.loss_scale()})")
