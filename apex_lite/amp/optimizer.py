"""An optimizer under amp: its gradients' state, what its ``step()`` refuses, and when it skips.

``initialize`` patches three methods on the instance of the optimizer that steps (its class and
its identity stay, so LR schedulers created before or after keep working): ``step``,
``zero_grad`` and ``add_param_group``. An optimizer that wraps another and shares its
``param_groups`` (LARC, Lookahead, SAM) steps through the inner one (``stepping_optimizer``),
which amp takes over; the wrapper's ``zero_grad`` and ``add_param_group`` are amp's too, its
``step`` its own. amp's ``step`` runs the optimizer's own ``step`` as code set it (its class's,
or a wrapper set on the instance before ``initialize``), with amp's update in place of the
class's (``_StepInPlace``), so that wrappers and torch's step hooks run on every step path.
``state_dict`` / ``load_state_dict`` keep torch's: under O2 the ``param_groups`` hold the fp32
masters themselves, so optimizer state is keyed by, saved from and loaded into fp32 tensors.
torch's state_dict hooks add one thing: the amp state (the run's loss scalers) travels under the
key ``AMP_STATE_KEY`` of the optimizer's own ``state_dict()`` (saved_state.py).

The gradients' state per optimizer (``grad_state``, a ``GradState``, master_grads.py): CLEAN,
SCALED (``delay_unscale``, or a backward under DDP's ``no_sync()``), UNSCALED, CHECKED (the fused
step). The step paths return the state a backward leaves (step_path.py). How the update is
applied is the optimizer's step path, chosen at ``initialize``: the unfused step (unscale at the
end of ``scale_loss``, the optimizer's own update, a copy back to the half model) or the fused
step (a read-only check at the end of ``scale_loss``, one kernel pass at ``step()``). The rules
here hold on both.

Accumulation follows torch's rule on the unscaled values: a gradient accumulates until it is
cleared, however it is cleared. Under O2 clearing either copy's gradient clears it: a master's
(``zero_grad``, ``p.grad = None``), or its half parameter's (``model.zero_grad()``, by hand),
after which the next backward starts the master gradient afresh; one still there is added to
(master_grads.py).

What ``step()`` refuses, before it changes anything: a step inside the ``scale_loss`` block (the
gradients are still scaled), gradients still scaled by ``delay_unscale``, a ``scale_loss`` block
that ran no backward, a second step on the same gradients, an O2 model's half gradient edited
after its ``scale_loss`` (grad_edits.py; also refused by the next ``scale_loss`` of an
accumulation), and gradients that no ``scale_loss`` for this optimizer unscaled (a backward
outside ``scale_loss``, or a ``scale_loss`` that fed this optimizer's parameters without being
given the optimizer).
"""
from __future__ import annotations

import functools
import types
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import closures, fsdp_norms
from .grad_edits import HalfGradEdits
from .master_grads import GradState, is_lazy
from .model_hooks import BackwardWatches
from .opt_params import OptimizerParams, _DeviceGroup
from .optimizer_hooks import MARK, _make_method, _StepInPlace, _wrapper_step  # noqa: F401
from .overflow import OverflowCheck
# AMP_STATE_KEY is also importable here, where it was defined before saved_state.py.
from .saved_state import AMP_STATE_KEY, OptimizerAmpState  # noqa: F401
from .scaler import BackwardScale

CLEAN, SCALED, UNSCALED, CHECKED = (GradState.CLEAN, GradState.SCALED, GradState.UNSCALED,
                                    GradState.CHECKED)


class AmpOptimizer:
    """The amp state of one optimizer, reachable as ``optimizer._apex_lite_amp``.

    ``optimizer``: the optimizer whose ``step`` updates the parameters (``stepping_optimizer``);
    ``given``: the one passed to ``initialize`` (it, or a wrapper around it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, run, given=None):
        self.optimizer = optimizer
        self.given = optimizer if given is None else given
        self.run = run
        self.grad_state = CLEAN
        # The scale SCALED or CHECKED gradients still hold, and the losses behind SCALED ones.
        self.held_scale: Optional[BackwardScale] = None
        self.delayed_losses: List[torch.Tensor] = []
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
        # O2: the half model gradients as the last scale_loss left them (grad_edits.py).
        self.grad_edits = HalfGradEdits()
        # The amp state carried in the optimizer's own state_dict() (saved_state.py).
        self.saved_state = OptimizerAmpState(self)
        # The parameters per device, O2's master weights and gradients.
        self.weights = OptimizerParams(optimizer, run.pairs, self.materialize_master_grads)
        # How step() applies the update: UnfusedStep or FusedStep (step_path.py), set by
        # initialize.
        self.path = None
        # amp's update in place of the class's, inside the optimizer's own step (_own_step).
        self.replacement: Optional[_StepInPlace] = None
        self._original_step = optimizer.step
        self._original_zero_grad = optimizer.zero_grad
        self._original_add_param_group = optimizer.add_param_group

    # ---- installing ----------------------------------------------------------------------
    def install(self, wrappers: Sequence = ()) -> None:
        """Patch the stepping optimizer's ``step``, ``zero_grad`` and ``add_param_group``; on
        each of ``wrappers`` (optimizers around it that share its param groups), ``zero_grad``
        and ``add_param_group``, and their own ``step`` runs, calling the stepping one's, which
        is amp's (a step taken through the inner optimizer, SAM's second step, is amp's step),
        after which the writes the wrapper made to the masters reach the model."""
        for wrapper in wrappers:
            wrapper.step = types.MethodType(_wrapper_step(wrapper.step), wrapper)
            wrapper.zero_grad = types.MethodType(_make_method("zero_grad"), wrapper)
            wrapper.add_param_group = types.MethodType(_make_method("add_param_group"),
                                                       wrapper)
            setattr(wrapper, MARK, self)
        opt = self.optimizer
        step = _make_method("step")
        if hasattr(self._original_step, "_wrapped_by_lr_sched"):
            # An LR scheduler wrapped step() before initialize; it still runs inside ours.
            step._wrapped_by_lr_sched = True
        opt.step = types.MethodType(step, opt)
        opt.zero_grad = types.MethodType(_make_method("zero_grad"), opt)
        opt.add_param_group = types.MethodType(_make_method("add_param_group"), opt)
        opt._apex_lite_amp = self
        if _StepInPlace.applies(opt):
            self.replacement = _StepInPlace(opt)
        self.saved_state.install([opt] + [w for w in wrappers
                                          if hasattr(w, "_optimizer_state_dict_post_hooks")])
        self.watches.watch([p for group in opt.param_groups for p in group["params"]])
        # Lazy gradients an earlier initialize's fused step left belong to its run.
        for master in self.masters():
            if is_lazy(master.grad):
                master.grad = None

    # ---- the parameters (masters.py) ----------------------------------------------------------
    def groups(self) -> Dict[torch.device, _DeviceGroup]:
        return self.weights.groups()

    def masters(self) -> List[torch.Tensor]:
        return self.weights.masters()

    def check_devices(self, caller: str) -> None:
        """Raise when the model was moved after ``initialize`` (``OptimizerParams.check_devices``)."""
        self.weights.check_devices(caller, self.run.param_name)

    def raise_moved(self, caller: str) -> None:
        """Raise the explanation when a parameter is no longer on its device; else return."""
        self.weights.raise_moved(caller, self.run.param_name)

    # ---- scale_loss's two halves ----------------------------------------------------------
    def check_can_accumulate(self, scale: BackwardScale) -> None:
        """Raise, before any backward, when the next backward cannot join the held one. CHECKED
        gradients that the next backward would add to are unscaled into the masters' gradients
        first (accumulation is in fp32, as on the unfused step)."""
        if self.grad_state in (CHECKED, UNSCALED):   # edited half gradients would be added
            self.grad_edits.refuse(self, "amp.scale_loss")
            self.grad_edits.forget()
        if self.grad_state == CHECKED:
            if any(p.grad is not None for group in self.groups().values()
                   for p in group.model_params):
                self.materialize_master_grads()
            else:
                self._reset(set_to_none=True)   # all cleared by hand since: as after zero_grad
        if self.grad_state == SCALED and self.held_scale.token != scale.token:
            raise RuntimeError(
                f"delay_unscale=True left this optimizer's gradients multiplied by "
                f"{self.held_scale.describe()}, but this scale_loss uses {scale.describe()}"
                f"{'' if scale.loss_id != self.held_scale.loss_id else ' (it changed since)'}. "
                f"Accumulate under one loss_id, or pass delay_unscale=False so each backward is "
                f"unscaled on its own.")

    def before_backward(self) -> Dict[int, torch.Tensor]:
        """Move the gradients of earlier backwards aside (``OptimizerParams.stash_grads``) so that
        this backward writes fresh ones; nothing to move unless UNSCALED."""
        if self.grad_state != UNSCALED:
            return {}
        stash = self.weights.stash_grads()
        if not stash:
            # Every gradient was cleared (``p.grad = None`` by hand): as after zero_grad.
            self._reset(set_to_none=True)
        return stash

    def restore_stash(self, stash: Dict[int, torch.Tensor]) -> None:
        """Give stashed gradients back when the backward raised (amp changes no state then; a
        backward that failed half way may still have written some gradients itself)."""
        self.weights.restore(stash)

    def after_backward(self, stash: Dict[int, torch.Tensor], loss: torch.Tensor,
                       scale: BackwardScale, delay_unscale: bool,
                       check: Optional[OverflowCheck]) -> None:
        """Hand the new gradients to the step path (unscaled into the masters' gradients, adding
        the stash, or checked where they stand), flagging non-finite values in ``check``; or,
        with ``delay_unscale``, leave them scaled."""
        if delay_unscale:
            self.restore_stash(stash)   # empty: a CLEAN or SCALED optimizer stashes nothing
            self.grad_state = SCALED
            self.held_scale = scale
            self.delayed_losses.append(loss.detach())
            self.stepped_since_backward = False
            return
        try:
            self.grad_state = self.path.end_backward(self, stash, scale, check)
        except (ValueError, RuntimeError):
            # The kernels refuse tensors off the flag's device: a model (partly) moved after
            # initialize. Name it; anything else is re-raised as it was.
            self.raise_moved("amp.scale_loss")
            raise
        self.held_scale = scale if self.grad_state == CHECKED else None
        self.delayed_losses = []
        self.checks.append(check)
        self.stepped_since_backward = False
        self.grad_edits.record(self)

    def unscale(self, stash: Dict[int, torch.Tensor], scale: BackwardScale,
                check: OverflowCheck) -> GradState:
        """Unscale this backward's gradients into true values (under O2 into the masters' fp32
        gradients), adding what the stash and earlier backwards hold: UNSCALED."""
        # When an earlier backward of this step may have left inf/NaN in the gradients this one
        # adds to, the accumulating kernel would flag them again: check the new gradients on
        # their own, so that this loss's scaler backs off only for an overflow of its own
        # backward; what the accumulation carries still makes this optimizer skip. (After a
        # step() the earlier checks are gone: gradients left uncleared past a skipped step are
        # charged to the next backward, as torch's GradScaler, which checks what it unscales.)
        history_clean = all(earlier.known_clean(self) for earlier in self.checks)
        self.weights.unscale(stash, scale.inv, history_clean,
                             lambda device: check.found_inf(self, device),
                             lambda device: check.carried_inf(self, device))
        return UNSCALED

    # ---- the patched methods --------------------------------------------------------------
    def label(self) -> str:
        """"optimizer <i> (<class>)", its place in the ``initialize`` call, for messages."""
        index = self.run.optimizers.index(self) if self in self.run.optimizers else "?"
        return f"optimizer {index} ({type(self.given).__name__})"

    def step(self, closure=None):
        if self.in_scale_loss:
            raise RuntimeError(
                f"{self.label()}.step() was called inside its `with amp.scale_loss(...)` block: "
                f"the gradients are still multiplied by the loss scale there, and amp unscales "
                f"and checks them when the block exits. Call optimizer.step() after the block.")
        if closure is None:
            return self._step(None, None)
        return self._step(closure, closures.first_call(self, closure))

    def _step(self, closure, closure_loss):
        """``step()`` after its refusals (each raised before anything changes): the skip
        decision, then the update by the step path. torch's optimizer step hooks fire once per
        call, skipped or not (on the unfused step, the optimizer's own step fires them when it
        runs). A step that raises leaves amp's bookkeeping as it was: it may be called again."""
        caller = f"{self.label()}.step()"
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
                f"{caller}: the last `with amp.scale_loss(...) as scaled_loss:` "
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
                f"{caller}: its parameters hold gradients that no amp.scale_loss for "
                f"this optimizer unscaled or checked: since they were last cleared, a backward "
                f"outside the scale_loss blocks given this optimizer wrote into them (a "
                f"loss.backward() outside amp.scale_loss, or a scale_loss that this optimizer "
                f"was not given, whose backward reached these parameters). {_UNSCALED_FIX}")
        if self.grad_state == CLEAN:
            self._refuse_gradients_amp_did_not_unscale()
        self.grad_edits.refuse(self, caller)
        self._drop_cleared()
        copies = self.run.copies
        copies.sync(caller, compare_all=len(copies.pairs) > 0 and copies.first("step"))
        checks = self.checks
        # The optimizer's own step gets a closure that returns the loss amp computed first.
        replayed = closures.replayed(self, closure, closure_loss)
        args = () if closure is None else (replayed,)
        try:
            if self.run.decides_on_device:
                # Every step is fused: the kernel reads the skip decision on the device.
                flags = [check.skip_flag(self) for check in checks]
                found_inf = functools.reduce(torch.maximum, flags) if flags else None
                result = self._own_step(args, lambda: self.path.apply(self, found_inf))
            elif any([check.skips(self) for check in checks]):   # every check resolves
                self.path.forget()   # a clip coefficient of this step goes with it
                result = self._own_step(args, lambda: None)
            elif self.path.fused:
                result = self._own_step(args, lambda: self.path.apply(self, None))
            else:
                result = self.path.apply(self, None, replayed)
        except BaseException:
            self.checks = checks
            raise
        self.checks = []
        self.grad_edits.forget()
        self.stepped_since_backward = True
        # Tell an LR scheduler this step counted (torch's own flag), also when it is skipped, so
        # that skipped first steps do not make it warn that lr_scheduler.step() came first.
        self.optimizer._opt_called = True
        self.given._opt_called = True
        self.run.copies.record()   # both copies as amp's own writes left them
        return closure_loss if closure is not None and self.path.fused else result

    def _own_step(self, args: tuple, update: Callable[[], None]):
        """The optimizer's ``step`` as code set it before ``initialize`` (its class's, or a
        wrapper set on the instance: a profiler's, a logger's, an LR scheduler's), with
        ``update`` (the fused kernels, or nothing for a skipped step) in place of the class's
        own update: amp's step pre-hook, the last to run, runs ``update`` and hides the param
        groups from the class's update that follows; amp's post-hook, the first, gives them
        back (``_StepInPlace``). torch's step hooks fire once, as in any step; a closure
        (``replayed``) returns the loss amp already computed."""
        replacement = self.replacement
        if replacement is None:   # not a torch optimizer whose step runs torch's hooks
            update()
            return None
        with replacement.armed(update):
            return self._original_step(*args)

    def _drop_cleared(self) -> None:
        """O2: a half gradient cleared since its ``scale_loss`` (``model[0].zero_grad()``,
        ``p.grad = None``) is applied as fp32 training applies it: the parameter is not updated.
        Its master's true gradient is dropped (the fused step's lazy one needs nothing: the
        kernel skips a parameter whose half gradient is gone, and a later read makes None)."""
        if self.grad_state != UNSCALED:
            return
        for device, indices in self.grad_edits.cleared():
            masters = self.groups()[device].half_masters
            for i in indices:
                masters[i].grad = None

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
        norms = [fsdp_norms.squared_norm(tensors).to("cpu") for tensors in by_device.values()]
        if float(torch.cat(norms).sum()) == 0.0:
            return   # zeros left by zero_grad(set_to_none=False): a no-op step, as in torch
        raise RuntimeError(
            f"{self.label()}.step(): its parameters hold gradients that no amp.scale_loss for "
            f"this optimizer unscaled or checked: they come from a loss.backward() outside "
            f"amp.scale_loss, or from a scale_loss that this optimizer was not given (its "
            f"backward reached these parameters). {_UNSCALED_FIX}")

    def copy_masters_to_model(self) -> None:
        """O2: round the updated fp32 masters into the half model."""
        self.run.copies.round_into_model(self.weights.pairs_of())

    def _reset(self, set_to_none: bool) -> None:
        """Forget the gradients' bookkeeping, as zero_grad does. A decision deferred by
        delay_overflow_check is made now, not dropped with the gradients: the scale still backs
        off (or counts a clean step) and the counters see it."""
        for check in self.checks:
            check.resolve()
        self.grad_state = CLEAN
        self.held_scale = None
        self.delayed_losses = []
        self.checks = []
        self.missing_backward = False
        self.foreign_backward = False
        self.grad_edits.forget()
        self.path.forget()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The step itself is not taken, as zero_grad before step() means in plain torch. The
        # masters' gradients first: a lazy one that user code holds is made from the half
        # gradient and the clip coefficient still there (master_grads.py).
        self.path.zero_grad(self, set_to_none, self._original_zero_grad)
        self._reset(set_to_none)
        self.weights.clear_model_grads(set_to_none)

    def model_zeroed(self, model_param_ids, set_to_none: bool) -> None:
        """A model's ``zero_grad()`` cleared the gradients of ``model_param_ids``: clear the O2
        master gradients they feed; when that covers every parameter of this optimizer it is
        ``optimizer.zero_grad()``."""
        covered, total = self.weights.coverage(model_param_ids)
        if not covered:
            return
        if covered == total:
            self.zero_grad(set_to_none)
            return
        self.weights.clear_master_grads(model_param_ids, set_to_none)
        # Where the gradients live: the masters' (O2, unscaled), or the model's while CHECKED.
        if self.weights.all_grads_cleared(in_model=self.grad_state == CHECKED):
            self.zero_grad(True)   # several models' zero_grad() together cleared them all
        elif not set_to_none:
            self.grad_edits.record(self)   # the zeros written are amp's, not an edit

    def add_param_group(self, param_group: dict) -> None:
        # The lazy gradients of the groups being rebuilt are made first (master_grads.py).
        self.materialize_master_grads()
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self.run.masters_for(params, "optimizer.add_param_group")
        self.run.refuse_shared_params(self, group["params"], "optimizer.add_param_group")
        self._original_add_param_group(group)
        self.weights.invalidate()
        self.path.invalidate()
        self.watches.watch(group["params"])

    def materialize_master_grads(self) -> None:
        """Give the masters true fp32 gradients (``amp.master_params``: apex's way to clip them;
        the first use of a fused step's lazy gradient, master_grads.py): on the fused step this
        makes CHECKED gradients into them (UNSCALED) and the step reads those; after the step,
        they are the gradients it applied, as the unfused step leaves them."""
        self.grad_state = self.path.materialize(self)
        if self.grad_state != CHECKED:
            self.held_scale = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the true gradients the next step() applies to ``max_norm``; their total norm."""
        return self.path.clip_grad_norm_(self, float(max_norm), float(norm_type))


_UNSCALED_FIX = (
    "Stepping would apply them unscaled, still multiplied by a loss scale, or not at all. Pass "
    "every optimizer whose parameters the loss reaches: `with amp.scale_loss(loss, "
    "[optimizer_a, optimizer_b]) as scaled: scaled.backward()`, or zero this optimizer's "
    "gradients (optimizer.zero_grad()) before the backward it should step on.")
