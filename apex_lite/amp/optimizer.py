"""An optimizer under amp: unscaling its gradients, skipping its step, and O2's master weights.

``initialize`` patches three methods on the optimizer instance (its class and its identity stay,
so LR schedulers created before or after keep working): ``step``, ``zero_grad`` and
``add_param_group``. ``state_dict`` / ``load_state_dict`` keep torch's: under O2 the
``param_groups`` hold the fp32 masters themselves, so optimizer state is keyed by, saved from and
loaded into fp32 tensors. torch's state_dict hooks add one thing: the amp state (the run's loss
scalers) travels under the key ``AMP_STATE_KEY`` of the optimizer's own ``state_dict()``, so
that a framework that saves only the model and the optimizer resumes the loss scale and its
counters; a plain torch optimizer's ``load_state_dict`` ignores that key.

Gradient bookkeeping per optimizer (``grad_state``):
- CLEAN: no gradient since ``zero_grad`` (or gradients that are None / zero);
- SCALED: gradients hold a backward still multiplied by the loss scale (``delay_unscale=True``);
- UNSCALED: gradients hold true values (under O2 in the masters' fp32 gradients); another
  backward is accumulated with ``axpby`` into them;
- CHECKED (the fused step only): the model's gradients hold one backward (or a delay_unscale
  accumulation) still multiplied by the loss scale, checked for inf/NaN when its ``scale_loss``
  exited; the step's kernel unscales them. Another backward, or ``amp.master_params``, first
  unscales them into the masters' gradients (UNSCALED).

How the update is applied is the optimizer's step path (``step_path.py``), chosen at
``initialize``: the unfused step (unscale at the end of ``scale_loss``, the optimizer's own
``step()``, a copy back to the half model) or the fused step (a read-only check at the end of
``scale_loss``, one kernel pass at ``step()``). The rules here hold on both.

Accumulation follows torch's rule on the unscaled values: a gradient accumulates until it is
cleared, however it is cleared. Under O2 the model's half ``.grad`` stays in place after the
unscale (its values live on, unscaled, in the master's fp32 ``.grad``) as the sign that the user
has not cleared it: a backward into a model parameter whose ``.grad`` was set to None (by
``zero_grad``, ``model.zero_grad`` or by hand) starts its master gradient afresh, one whose
``.grad`` is still there adds to it. So O2 master gradients never carry a finished step into the
next one unless the model's gradients were left uncleared, as plain torch would accumulate them.

What ``step()`` refuses, before it changes anything: a step inside the ``scale_loss`` block (the
gradients are still scaled), gradients still scaled by ``delay_unscale``, a ``scale_loss`` block
that ran no backward, a second step on the same gradients, and gradients that no ``scale_loss``
for this optimizer unscaled (a backward outside ``scale_loss``, or a ``scale_loss`` that fed this
optimizer's parameters without being given the optimizer).
"""
from __future__ import annotations

import functools
import types
from typing import Dict, List, Optional, Tuple, Union

import torch

from ..multi_tensor import _python
from ..multi_tensor._backend import ops_for
from ..optimizers.update import local_shards
from . import fsdp
from .model_hooks import BackwardWatches
from .overflow import OverflowCheck
from .scaler import BackwardScale

CLEAN, SCALED, UNSCALED, CHECKED = "clean", "scaled", "unscaled", "checked"

# The key of the amp state in an amp optimizer's state_dict() (beside torch's "state" and
# "param_groups"; torch's load_state_dict reads only those two).
AMP_STATE_KEY = "apex_lite_amp"

Scale = Union[float, torch.Tensor]


# The fused calls of the step. They skip ``multi_tensor``'s argument checks (Python loops over
# every tensor, every step): amp builds these lists itself, on one device, in fp32/fp16/bf16, with
# outputs that are either the inputs or distinct tensors of the same shapes. A scale may be a
# 1-element device tensor (a loss scale kept on the device): torch's check-and-unscale op takes
# it without a host read, through the Python backend (the native kernels' reference, bit for bit).
# DTensors (FSDP2's shards) are passed as their local shards (``local_shards``).
def _ops(scale: Scale, found_inf: torch.Tensor):
    return _python if isinstance(scale, torch.Tensor) else ops_for(found_inf.device)


def _on_flag_device(scale: Scale, found_inf: torch.Tensor) -> Scale:
    """A device scale moved where the flag (each device group's) is, as the flags are: a group
    added on another GPU after ``initialize`` unscales there (a no-op on the same device)."""
    return scale.to(found_inf.device) if isinstance(scale, torch.Tensor) else float(scale)


def fused_scale(inputs: List[torch.Tensor], outputs: List[torch.Tensor], scale: Scale,
                found_inf: torch.Tensor) -> None:
    """``multi_tensor.scale`` for lists amp built."""
    ops = _ops(scale, found_inf)
    scale = _on_flag_device(scale, found_inf)
    same = outputs is inputs
    inputs = local_shards(inputs)
    outputs = inputs if same else local_shards(outputs)
    if same:
        ops.scale_(inputs, scale, found_inf)
    else:
        ops.scale_out(inputs, outputs, scale, found_inf)


def fused_accumulate(new: List[torch.Tensor], into: List[torch.Tensor], scale: Scale,
                     found_inf: torch.Tensor) -> None:
    """``into += scale * new`` (``multi_tensor.axpby`` in place) for lists amp built."""
    ops = _ops(scale, found_inf)
    ops.axpby_(local_shards(new), local_shards(into), _on_flag_device(scale, found_inf), 1.0,
               found_inf)


def flag_nonfinite(tensors: List[torch.Tensor], found_inf: torch.Tensor) -> torch.Tensor:
    """Set ``found_inf`` when one of ``tensors`` holds inf or NaN; reads only, no sync. Returns
    the per-tensor flags (a bool tensor on the device)."""
    flags = ops_for(found_inf.device).nonfinite_flags(local_shards(tensors))
    torch.maximum(found_inf, flags.any().to(found_inf.dtype).reshape(1), out=found_inf)
    return flags


def present_grads(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The gradients of ``tensors`` that exist, in order. Each ``.grad`` is read once: it is a
    property call (~80 ns), and these lists are built every step."""
    return [g for g in (t.grad for t in tensors) if g is not None]


class _DeviceGroup:
    """The parameters of one optimizer on one device: ``model_params[i]`` receives the backward,
    ``masters[i]`` is what the optimizer updates (the same tensor unless O2 cast it to half)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.model_params: List[torch.Tensor] = []
        self.masters: List[torch.Tensor] = []
        self.own_masters: List[torch.Tensor] = []   # masters that are their model parameter
        self.half_models: List[torch.Tensor] = []   # the O2 pairs, for the copy after step()
        self.half_masters: List[torch.Tensor] = []
        self._master_grad_buffers: Optional[List[torch.Tensor]] = None
        self._scratch_flag: Optional[torch.Tensor] = None

    def master_grad_buffers(self) -> List[torch.Tensor]:
        """Views of one fp32 buffer, one per O2 master: what a master's ``.grad`` is set to when
        ``zero_grad`` left it None, so the unscale does not allocate 2 x params tensors a step.
        (The memory is the same: the master gradients exist during every step anyway.)"""
        if self._master_grad_buffers is None:
            flat = torch.empty(sum(m.numel() for m in self.half_masters), dtype=torch.float32,
                               device=self.device)
            views, offset = [], 0
            for master in self.half_masters:
                views.append(flat[offset:offset + master.numel()].view_as(master))
                offset += master.numel()
            self._master_grad_buffers = views
        return self._master_grad_buffers

    def scratch_flag(self) -> torch.Tensor:
        """A flag for the master-to-model copy, whose inputs are finite by construction."""
        if self._scratch_flag is None:
            self._scratch_flag = torch.zeros(1, dtype=torch.float32, device=self.device)
        return self._scratch_flag


class AmpOptimizer:
    """The amp state of one optimizer, reachable as ``optimizer._apex_lite_amp``."""

    def __init__(self, optimizer: torch.optim.Optimizer, run, model_of: Dict[torch.Tensor,
                 torch.Tensor]):
        self.optimizer = optimizer
        self.run = run
        # master -> the model parameter whose .grad feeds it (itself when not cast).
        self.model_of = model_of
        self.grad_state = CLEAN
        # The scale of SCALED or CHECKED gradients, and the losses behind SCALED ones.
        self.pending: Optional[BackwardScale] = None
        self.pending_losses: List[torch.Tensor] = []
        self.checks: List[OverflowCheck] = []
        # step() since the last backward: a second step() would apply the same gradients again.
        self.stepped_since_backward = False
        # Inside an amp.scale_loss for this optimizer (a nested one would mix two backwards).
        self.in_scale_loss = False
        # The last scale_loss for this optimizer exited without a backward through its loss.
        self.missing_backward = False
        # A backward wrote gradients of this optimizer's parameters outside the scale_loss
        # blocks given it, since they were last cleared (model_hooks._ForeignBackward).
        self.foreign_backward = False
        self.watches = BackwardWatches(self)
        # The amp state a load_state_dict is bringing in: checked before torch loads the
        # optimizer's part, applied after torch has (so that nothing changes when either fails).
        self._incoming_amp_state: Optional[dict] = None
        self._groups: Optional[Dict[torch.device, _DeviceGroup]] = None
        # How step() applies the update: UnfusedStep or FusedStep (step_path.py), set by
        # initialize.
        self.path = None
        self._original_step = optimizer.step
        self._original_zero_grad = optimizer.zero_grad
        self._original_add_param_group = optimizer.add_param_group

    # ---- installing ----------------------------------------------------------------------
    def install(self) -> None:
        opt = self.optimizer
        step = _make_method("step")
        if hasattr(self._original_step, "_wrapped_by_lr_sched"):
            # An LR scheduler wrapped step() before initialize; it still runs inside ours.
            step._wrapped_by_lr_sched = True
        opt.step = types.MethodType(step, opt)
        opt.zero_grad = types.MethodType(_make_method("zero_grad"), opt)
        opt.add_param_group = types.MethodType(_make_method("add_param_group"), opt)
        opt._apex_lite_amp = self
        opt.register_state_dict_post_hook(self._add_amp_state)
        opt.register_load_state_dict_pre_hook(self._take_amp_state)
        opt.register_load_state_dict_post_hook(self._load_amp_state)
        self.watches.watch([p for group in opt.param_groups for p in group["params"]])

    # ---- the amp state in the optimizer's own state_dict() ----------------------------------
    def _add_amp_state(self, optimizer, state_dict: dict) -> dict:
        """state_dict post-hook: the run's loss scalers beside torch's state (plain numbers)."""
        state_dict[AMP_STATE_KEY] = self.run.scaler_state()
        return state_dict

    def _take_amp_state(self, optimizer, state_dict: dict) -> dict:
        """load_state_dict pre-hook, before torch changes anything: take the amp state out of
        torch's copy of the dict and check it as amp.load_state_dict does; one that does not fit
        this run is refused here, so the optimizer's state is not loaded either."""
        self._incoming_amp_state = None
        carried = state_dict.pop(AMP_STATE_KEY, None)
        if carried is None:
            return state_dict
        if not isinstance(carried, dict):
            raise ValueError(f"{self.label()}.load_state_dict: the state's {AMP_STATE_KEY!r} "
                             f"entry is a {type(carried).__name__}, not the dict an amp "
                             f"optimizer's state_dict() writes; the checkpoint is damaged")
        try:
            self.run.check_state(carried, with_masters=False)
        except ValueError as exc:
            raise ValueError(f"{self.label()}.load_state_dict: the amp state this optimizer "
                             f"state carries (under {AMP_STATE_KEY!r}) does not fit this run, "
                             f"so nothing was loaded: {exc}") from exc
        self._incoming_amp_state = carried
        return state_dict

    def _load_amp_state(self, optimizer) -> None:
        """load_state_dict post-hook: torch loaded the optimizer's part; now the loss scalers."""
        carried, self._incoming_amp_state = self._incoming_amp_state, None
        if carried is not None:
            self.run.apply_state(carried)

    # ---- parameter grouping (cached; invalidated by add_param_group) ----------------------
    def groups(self) -> Dict[torch.device, _DeviceGroup]:
        if self._groups is None:
            groups: Dict[torch.device, _DeviceGroup] = {}
            seen = set()
            for group in self.optimizer.param_groups:
                for master in group["params"]:
                    if id(master) in seen:
                        continue
                    seen.add(id(master))
                    model_param = self.model_of.get(master, master)
                    g = groups.get(master.device)
                    if g is None:
                        g = groups[master.device] = _DeviceGroup(master.device)
                    g.model_params.append(model_param)
                    g.masters.append(master)
                    if model_param is master:
                        g.own_masters.append(master)
                    else:
                        g.half_models.append(model_param)
                        g.half_masters.append(master)
            self._groups = groups
        return self._groups

    def masters(self) -> List[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def check_devices(self, caller: str) -> None:
        """Raise when the model was moved after ``initialize``: the first and last parameter of
        each device group must still be where they were (a cheap check; ``model.to(device)``
        moves them all, and a partial move is caught by ``find_moved`` when the kernels refuse)."""
        for device, group in self.groups().items():
            for tensors in (group.model_params, group.masters):
                if tensors[0].device != device or tensors[-1].device != device:
                    self.raise_moved(caller)

    def raise_moved(self, caller: str) -> None:
        """Raise the explanation when a parameter is no longer on the device it had at
        ``initialize``; return when none moved."""
        for device, group in self.groups().items():
            for model_param, master in zip(group.model_params, group.masters):
                for tensor, what in ((model_param, "model parameter"), (master, "master weight")):
                    if tensor.device != device:
                        raise RuntimeError(
                            f"{caller}: {what} {self.run.param_name(model_param)!r} is on "
                            f"{tensor.device} but was on {device} when amp.initialize ran: the "
                            f"model was moved after amp.initialize. Move the model before "
                            f"initializing (model.to(device); then model, optimizer = "
                            f"amp.initialize(model, optimizer, ...)), or build a fresh model and "
                            f"optimizer on the new device, load their state_dicts and call "
                            f"amp.initialize again.")

    # ---- scale_loss's two halves ----------------------------------------------------------
    def check_can_accumulate(self, scale: BackwardScale) -> None:
        """Raise, before any backward, when the next backward cannot join the pending one. CHECKED
        gradients that the next backward would add to are unscaled into the masters' gradients
        first (accumulation is in fp32, as on the unfused step)."""
        if self.grad_state == CHECKED:
            if any(p.grad is not None for group in self.groups().values()
                   for p in group.model_params):
                self.path.materialize(self)
            else:
                self._reset(set_to_none=True)   # all cleared by hand since: as after zero_grad
        if self.grad_state == SCALED and self.pending.token != scale.token:
            raise RuntimeError(
                f"delay_unscale=True left this optimizer's gradients multiplied by "
                f"{self.pending.describe()}, but this scale_loss uses {scale.describe()}"
                f"{'' if scale.loss_id != self.pending.loss_id else ' (it changed since)'}. "
                f"Accumulate under one loss_id, or pass delay_unscale=False so each backward is "
                f"unscaled on its own.")

    def before_backward(self) -> Dict[int, torch.Tensor]:
        """Move the gradients of earlier backwards aside so that this backward writes fresh
        ones: an fp32 gradient's true values (added back by the unscale), and an O2 model's half
        gradient (its values already live in the master gradient; it is put back when this
        backward leaves the parameter without a gradient). An O2 master whose model gradient was
        cleared since starts afresh. Keys: ``id`` of the model parameter."""
        stash: Dict[int, torch.Tensor] = {}
        if self.grad_state != UNSCALED:
            return stash
        for group in self.groups().values():
            for model_param, master in zip(group.model_params, group.masters):
                grad = model_param.grad
                if grad is not None:
                    stash[id(model_param)] = grad
                    model_param.grad = None
                elif model_param is not master:
                    master.grad = None
        if not stash:
            # Every gradient was cleared (``p.grad = None`` by hand): as after zero_grad.
            self._reset(set_to_none=True)
        return stash

    def restore_stash(self, stash: Dict[int, torch.Tensor]) -> None:
        """Give stashed gradients back when the backward raised (amp changes no state then; a
        backward that failed half way may still have written some gradients itself)."""
        for group in self.groups().values():
            for model_param in group.model_params:
                old = stash.get(id(model_param))
                if old is not None:
                    model_param.grad = old

    def after_backward(self, stash: Dict[int, torch.Tensor], loss: torch.Tensor,
                       scale: BackwardScale, delay_unscale: bool,
                       check: Optional[OverflowCheck]) -> None:
        """Hand the new gradients to the step path (unscaled into the masters' gradients, adding
        the stash, or checked where they stand), flagging non-finite values in ``check``; or,
        with ``delay_unscale``, leave them scaled."""
        if delay_unscale:
            self.restore_stash(stash)   # empty: a CLEAN or SCALED optimizer stashes nothing
            self.grad_state = SCALED
            self.pending = scale
            self.pending_losses.append(loss.detach())
            self.stepped_since_backward = False
            return
        try:
            self.path.end_backward(self, stash, scale, check)
        except (ValueError, RuntimeError):
            # The kernels refuse tensors off the flag's device: a model (partly) moved after
            # initialize. Name it; anything else is re-raised as it was.
            self.raise_moved("amp.scale_loss")
            raise
        self.pending_losses = []
        self.checks.append(check)
        self.stepped_since_backward = False

    def unscale(self, stash: Dict[int, torch.Tensor], scale: BackwardScale,
                check: OverflowCheck) -> None:
        """Unscale this backward's gradients into true values (under O2 into the masters' fp32
        gradients), adding what the stash and earlier backwards hold: UNSCALED."""
        inv_scale = scale.inv
        accumulate = self.grad_state == UNSCALED
        # When an earlier backward of this step may have left inf/NaN in the gradients this one
        # adds to, the accumulating kernel would flag them again: check the new gradients on
        # their own, so that this loss's scaler backs off only for an overflow of its own
        # backward; what the accumulation carries still makes this optimizer skip. (After a
        # step() the earlier checks are gone: gradients left uncleared past a skipped step are
        # charged to the next backward, as torch's GradScaler, which checks what it unscales.)
        history_clean = all(earlier.known_clean(self) for earlier in self.checks)
        for device, group in self.groups().items():
            found_inf = check.found_inf(self, device)
            if not accumulate and self._unscale_fresh(group, inv_scale, found_inf):
                continue
            fresh_in: List[torch.Tensor] = []
            fresh_out: List[torch.Tensor] = []
            acc_new: List[torch.Tensor] = []
            acc_into: List[torch.Tensor] = []
            restore: List[Tuple[torch.Tensor, torch.Tensor]] = []
            for model_param, master in zip(group.model_params, group.masters):
                grad = model_param.grad
                old = stash.get(id(model_param))
                if grad is None:
                    if old is not None:
                        model_param.grad = old   # this backward did not reach it
                elif model_param is master:
                    if old is None:
                        fresh_in.append(grad)
                        fresh_out.append(grad)
                    else:
                        acc_new.append(grad)
                        acc_into.append(old)
                        restore.append((master, old))
                elif accumulate and master.grad is not None:
                    acc_new.append(grad)
                    acc_into.append(master.grad)
                else:
                    if master.grad is None:
                        master.grad = torch.empty_like(master)
                    fresh_in.append(grad)
                    fresh_out.append(master.grad)
            if fresh_in:
                fused_scale(fresh_in, fresh_out, inv_scale, found_inf)
            if acc_new:
                if history_clean:
                    fused_accumulate(acc_new, acc_into, inv_scale, found_inf)
                else:
                    flag_nonfinite(acc_new, found_inf)
                    fused_accumulate(acc_new, acc_into, inv_scale,
                                     check.carried_inf(self, device))
            for master, grad in restore:
                master.grad = grad
        self.grad_state = UNSCALED
        self.pending = None

    @staticmethod
    def _unscale_fresh(group: _DeviceGroup, inv_scale: Scale, found_inf: torch.Tensor) -> bool:
        """The common step (no gradients to add to): O0/O1/O3 gradients unscaled where they
        stand, O2 half gradients into the masters' fp32 gradients; one fused call each. False
        when some O2 parameter got no gradient (the general path handles it)."""
        half_grads = [p.grad for p in group.half_models]
        if any(g is None for g in half_grads):
            return False
        grads = present_grads(group.own_masters)
        if not half_grads:
            if grads:
                fused_scale(grads, grads, inv_scale, found_inf)
            return True
        # One call: the fp32 gradients in place (same tensor in and out), the half ones into
        # the masters' gradients.
        outs = list(grads)
        for master, buffer in zip(group.half_masters, group.master_grad_buffers()):
            if master.grad is None:
                master.grad = buffer
            outs.append(master.grad)
        fused_scale(grads + half_grads, outs, inv_scale, found_inf)
        return True

    # ---- the patched methods --------------------------------------------------------------
    def label(self) -> str:
        """"optimizer <i> (<class>)", its place in the ``initialize`` call, for messages."""
        index = self.run.optimizers.index(self) if self in self.run.optimizers else "?"
        return f"optimizer {index} ({type(self.optimizer).__name__})"

    def step(self, closure=None):
        if self.in_scale_loss:
            raise RuntimeError(
                f"{self.label()}.step() was called inside its `with amp.scale_loss(...)` block: "
                f"the gradients are still multiplied by the loss scale there, and amp unscales "
                f"and checks them when the block exits. Call optimizer.step() after the block.")
        if closure is not None:
            raise RuntimeError(
                "optimizer.step(closure) is not supported under apex_lite.amp: a closure "
                "recomputes the loss and calls backward itself, outside amp.scale_loss, so its "
                "gradients would be neither scaled nor checked. Compute the loss, run its "
                "backward inside `with amp.scale_loss(loss, optimizer) as scaled: "
                "scaled.backward()`, then call optimizer.step() without a closure.")
        if self.grad_state == SCALED:
            raise RuntimeError(
                "optimizer.step() was called while this optimizer's gradients are still "
                "multiplied by the loss scale: the last amp.scale_loss for it had "
                "delay_unscale=True. End the accumulation with a scale_loss(..., "
                "delay_unscale=False) before step().")
        self.run.check_placement("optimizer.step()")
        self.check_devices("optimizer.step()")
        if self.missing_backward:
            raise RuntimeError(
                f"{self.label()}.step(): the last `with amp.scale_loss(...) as scaled_loss:` "
                f"block for this optimizer ran no backward through scaled_loss (was it "
                f"`scaled_loss.backward` without the parentheses?), so there are no gradients "
                f"for amp to unscale and check. Call scaled_loss.backward() inside the block.")
        if self.stepped_since_backward:
            raise RuntimeError(
                "optimizer.step() was called twice without a backward in between: the second "
                "call would apply the same gradients (and momentum) again. Run the next "
                "backward inside `with amp.scale_loss(loss, optimizer) as scaled: "
                "scaled.backward()` before calling step() again, or remove the extra step(). "
                "(A loss.backward() outside amp.scale_loss does not count: its gradients are "
                "neither scaled nor checked.)")
        if self.foreign_backward:
            raise RuntimeError(
                f"{self.label()}.step(): its parameters hold gradients that no amp.scale_loss for "
                f"this optimizer unscaled or checked: since they were last cleared, a backward "
                f"outside the scale_loss blocks given this optimizer wrote into them (a "
                f"loss.backward() outside amp.scale_loss, or a scale_loss that this optimizer "
                f"was not given, whose backward reached these parameters). {_UNSCALED_FIX}")
        if self.grad_state == CLEAN:
            self._refuse_gradients_amp_did_not_unscale()
        checks, self.checks = self.checks, []
        self.stepped_since_backward = True
        # Tell an LR scheduler this step counted (torch's own flag), also when it is skipped, so
        # that skipped first steps do not make it warn that lr_scheduler.step() came first.
        self.optimizer._opt_called = True
        if self.run.decides_on_device:
            # Every step is fused: the kernel reads the skip decision on the device.
            flags = [check.skip_flag(self) for check in checks]
            found_inf = functools.reduce(torch.maximum, flags) if flags else None
            return self.path.apply(self, found_inf)
        skip = False
        for check in checks:
            skip = check.skips(self) or skip
        if skip:
            self.path.forget()   # a clip coefficient of this step goes with it
            return None
        return self.path.apply(self, None)

    def _refuse_gradients_amp_did_not_unscale(self) -> None:
        """``step()`` with no ``scale_loss`` for this optimizer since its gradients were cleared:
        any non-zero gradient came from a backward amp did not unscale (one outside scale_loss,
        or a scale_loss this optimizer was not given) and would be applied multiplied by the
        loss scale, or not at all under O2. Off the hot path: one host read, here only."""
        grads = [p.grad for group in self.groups().values() for p in group.model_params
                 if p.grad is not None]
        if not grads:
            return
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        # Whole-tensor norms (FSDP2's shards summed over the mesh): every rank decides alike.
        norms = [fsdp.squared_norm(tensors).to("cpu") for tensors in by_device.values()]
        if float(torch.cat(norms).sum()) == 0.0:
            return   # zeros left by zero_grad(set_to_none=False): a no-op step, as in torch
        raise RuntimeError(
            f"{self.label()}.step(): its parameters hold gradients that no amp.scale_loss for "
            f"this optimizer unscaled or checked: they come from a loss.backward() outside "
            f"amp.scale_loss, or from a scale_loss that this optimizer was not given (its "
            f"backward reached these parameters). {_UNSCALED_FIX}")

    def copy_masters_to_model(self) -> None:
        """O2: round the updated fp32 masters into the half model, one fused call per device."""
        with torch.no_grad():
            for group in self.groups().values():
                if group.half_masters:
                    fused_scale(group.half_masters, group.half_models, 1.0, group.scratch_flag())

    def _reset(self, set_to_none: bool) -> None:
        """Forget the gradients' bookkeeping, as zero_grad does. A decision deferred by
        delay_overflow_check is made now, not dropped with the gradients: the scale still backs
        off (or counts a clean step) and the counters see it."""
        for check in self.checks:
            check.resolve()
        self.grad_state = CLEAN
        self.pending = None
        self.pending_losses = []
        self.checks = []
        self.missing_backward = False
        self.foreign_backward = False
        self.path.forget()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The step itself is not taken, as zero_grad before step() means in plain torch.
        self._reset(set_to_none)
        self._original_zero_grad(set_to_none=set_to_none)
        for group in self.groups().values():
            for model_param in group.half_models:
                if model_param.grad is not None:
                    if set_to_none:
                        model_param.grad = None
                    else:
                        model_param.grad.zero_()

    def model_zeroed(self, model_param_ids, set_to_none: bool) -> None:
        """A model's ``zero_grad()`` cleared the gradients of ``model_param_ids``: clear the O2
        master gradients they feed; when that covers every parameter of this optimizer it is
        ``optimizer.zero_grad()``."""
        covered = total = 0
        for group in self.groups().values():
            total += len(group.model_params)
            covered += sum(id(p) in model_param_ids for p in group.model_params)
        if not covered:
            return
        if covered == total:
            self.zero_grad(set_to_none)
            return
        for group in self.groups().values():
            for model_param, master in zip(group.half_models, group.half_masters):
                if id(model_param) in model_param_ids and master.grad is not None:
                    if set_to_none:
                        master.grad = None
                    else:
                        master.grad.zero_()
        # Where the gradients live: the masters' (O2, unscaled), or the model's while CHECKED.
        holders = [p for group in self.groups().values()
                   for p in (group.model_params if self.grad_state == CHECKED
                             else group.masters)]
        if all(p.grad is None for p in holders):
            self.zero_grad(True)   # several models' zero_grad() together cleared them all

    def add_param_group(self, param_group: dict) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self.run.masters_for(params, "optimizer.add_param_group")
        self.run.refuse_shared_params(self, group["params"], "optimizer.add_param_group")
        self._original_add_param_group(group)
        self._groups = None
        self.path.invalidate()
        self.watches.watch(group["params"])

    def materialize_master_grads(self) -> None:
        """Between a backward and its step(), give the masters true fp32 gradients
        (``amp.master_params``: apex's way to clip them); on the fused step this unscales CHECKED
        gradients into them (UNSCALED) and the step reads those. After the step nothing is made:
        the step's gradients were used (the fused step leaves the masters without gradients)."""
        if not self.stepped_since_backward:
            self.path.materialize(self)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the true gradients the next step() applies to ``max_norm``; their total norm."""
        return self.path.clip_grad_norm_(self, float(max_norm), float(norm_type))


_UNSCALED_FIX = (
    "Stepping would apply them unscaled, still multiplied by a loss scale, or not at all. Pass "
    "every optimizer whose parameters the loss reaches: `with amp.scale_loss(loss, "
    "[optimizer_a, optimizer_b]) as scaled: scaled.backward()`, or zero this optimizer's "
    "gradients (optimizer.zero_grad()) before the backward it should step on.")


def _make_method(name: str):
    """A fresh function per optimizer (so attributes set on one do not leak to another) that
    delegates to the optimizer's ``AmpOptimizer``; bound to the instance with MethodType, the
    form torch's LR schedulers expect of ``optimizer.step``."""
    if name == "step":
        def step(optimizer, closure=None):
            return optimizer._apex_lite_amp.step(closure)
        return step
    if name == "zero_grad":
        def zero_grad(optimizer, set_to_none: bool = True):
            return optimizer._apex_lite_amp.zero_grad(set_to_none)
        return zero_grad

    def add_param_group(optimizer, param_group):
        return optimizer._apex_lite_amp.add_param_group(param_group)
    return add_param_group
