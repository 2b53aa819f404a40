"""apex.amp's API on today's PyTorch: ``initialize``, ``scale_loss``, checkpoints, casts.

    from apex_lite import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

The functions here delegate to one default ``AmpHandle`` (the only module-level state); create
your own ``AmpHandle()`` to keep two independent configurations.
"""
from __future__ import annotations

from .legacy_init import init
from .casting import (bfloat16_function, disable_casts, float_function, half_function,
                      promote_function, register_bfloat16_function, register_float_function,
                      register_half_function, register_promote_function)
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .diagnostics import DEFAULT_OVERFLOW_PATIENCE, NonfiniteLocator, OverflowStuckError
from ..apex_compat.amp_state import AmpStateView
from .handle import AmpHandle
from .report import AmpReport
from .opt_levels import OPT_LEVELS, OptLevel, Properties
from .scaler import DEFAULT_SCALE_WINDOW, DEFAULT_SYNC_INTERVAL, LossScaler

__all__ = [
    "initialize", "scale_loss", "state_dict", "load_state_dict", "master_params", "loss_scalers",
    "clip_grad_norm_",
    "half_function", "bfloat16_function", "float_function", "promote_function",
    "register_half_function", "register_bfloat16_function", "register_float_function",
    "register_promote_function", "disable_casts", "init", "AmpHandle",
    "OPT_LEVELS", "OptLevel", "Properties", "LossScaler", "default_handle", "locate_nonfinite",
    "report", "AmpReport", "NonfiniteLocator", "OverflowStuckError", "save_checkpoint",
    "load_checkpoint", "CheckpointError",
]

_default_handle = AmpHandle()


def default_handle() -> AmpHandle:
    """The handle behind the module-level functions (for diagnostics and tests)."""
    return _default_handle


# apex's global state object, which apex code reads (``from apex.amp import _amp_state``):
# a read-only view of the default handle, resolved at every read.
_amp_state = AmpStateView(default_handle)


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale=None, cast_model_outputs=None, num_losses=1, verbosity=1,
               min_loss_scale=None, max_loss_scale=2. ** 24, *, half_dtype=None,
               keep_fp32_modules=(), hysteresis=1, scale_window=DEFAULT_SCALE_WINDOW,
               process_group=None, overflow_patience=DEFAULT_OVERFLOW_PATIENCE,
               locate_nonfinite=False, fused_step=None, sync_interval=DEFAULT_SYNC_INTERVAL,
               patch_torch_functions_type=None, frozen_master_weights=False):
    """Set models and optimizers up for mixed precision at ``opt_level``, as apex: NVIDIA apex's
    "O0" to "O3", or ROCm apex's "O4" (O1 in bf16) and "O5" (O2 in bf16), both with a static
    loss scale of 1.0. An unknown level or contradictory overrides raise ``OptLevelError`` (a
    ValueError and apex's RuntimeError) before anything changes.

    Returns ``(model, optimizer)``, each a list only where a list was passed, or the model(s)
    alone when no optimizer was passed. The objects are the ones passed in, modified in place.

    Models sharded with PyTorch FSDP2 (``fully_shard``) are initialized after sharding and
    after the optimizer is built over the sharded parameters. At O2 and O5 each unit needs
    ``MixedPrecisionPolicy(param_dtype=half)``, and the sharded fp32 parameters are the master
    weights; see ``apex_lite.amp.fsdp`` for each level and what is refused.

    ``patch_torch_functions_type`` (ROCm apex's argument; keyword-only here, so that NVIDIA
    apex's positional order stays): the dtype autocast runs in, which may be set only at O1
    (torch.float16) and O4 (torch.bfloat16), as in ROCm apex; None: the level's (O1: the run's
    half dtype; O4: bf16). ``amp._amp_state.opt_properties`` and ``amp.report()`` show it.

    Keyword-only extensions (their defaults keep apex's behaviour):
      half_dtype: torch.float16 or torch.bfloat16; default fp16 for CUDA models, bf16 for CPU
        (O4 and O5 are bf16 levels: another half_dtype is refused there).
      keep_fp32_modules: module types or qualified names (fnmatch patterns allowed) kept fp32
        when the model is cast to half (O2/O3/O5), beside BatchNorm's ``keep_batchnorm_fp32``.
      hysteresis: overflows tolerated before the dynamic scale is halved (1: every overflow).
      scale_window: clean steps before the dynamic scale doubles (apex: 2000).
      process_group: the group the overflow flag is all-reduced over when torch.distributed is
        initialised (default: the default group; on a model sharded with FSDP2, the group of
        its device mesh).
      overflow_patience: after this many steps in a row skipped with the loss scale at its
        floor (min_loss_scale; a static scale; or, without min_loss_scale, any consecutive
        skips), raise ``OverflowStuckError``, which says whether the loss itself was inf/NaN and
        names the parameters whose gradients were, and turns the locator on. None: never.
      locate_nonfinite: turn on ``amp.locate_nonfinite`` for the models (one host sync per
        module per forward: for debugging).
      fused_step: None (default): at O2 and O5, an optimizer whose update apex_lite's kernels
        compute (torch.optim.SGD, Adam, AdamW and apex_lite.optimizers) steps in one kernel pass
        from the half gradients, with no fp32 master gradients (amp.report() says which path each
        optimizer takes, and why); others take the unfused step. True: require the fused step
        (an error names the optimizer that cannot take it). False: the unfused step everywhere.
      sync_interval: when every optimizer takes the fused step, the loss scale and the skip
        decisions stay on the device and the host counters (amp.loss_scalers()), the skip log
        and OverflowStuckError catch up when read, and at least every ``sync_interval`` steps.
      frozen_master_weights: at O2, keep an exact fp32 master also for the floating parameters
        that no optimizer passed here holds (frozen weights). Default False, apex's rule: they
        are cast to half with no master, cost their half bytes, and the model's state_dict()
        gives the upcast of their half values. A parameter that joins an optimizer later
        (``add_param_group``) gets its master then, from the best value amp has.

    Logging (logger "apex_lite.amp", only rank 0 when distributed), by ``verbosity``:
      0: silent.
      1 (default): the skips of the start-of-training calibration (a dynamic scale halving from
        2**16 until the first clean step) are folded into one INFO line, "loss scaler 0: first 7
        steps skipped while the loss scale calibrated to 512.0"; after that each skip is an INFO
        line with apex's text ("Gradient overflow.  Skipping step, loss scaler 0 reducing loss
        scale to 32768.0"), and WARNINGs come only for an abnormal skip rate (more than 5 of the
        last 100 steps), a scale 4096x or more below its start, a loss that is inf or NaN, or a
        skip under a static loss scale.
      2: apex's verbosity=1, every skip a WARNING with apex's line, calibration included.
    """
    return _default_handle.initialize(
        models, optimizers, enabled=enabled, opt_level=opt_level,
        cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
        loss_scale=loss_scale, cast_model_outputs=cast_model_outputs, num_losses=num_losses,
        verbosity=verbosity, min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
        half_dtype=half_dtype, keep_fp32_modules=keep_fp32_modules, hysteresis=hysteresis,
        scale_window=scale_window, process_group=process_group,
        overflow_patience=overflow_patience, locate_nonfinite=locate_nonfinite,
        fused_step=fused_step, sync_interval=sync_interval,
        patch_torch_functions_type=patch_torch_functions_type,
        frozen_master_weights=frozen_master_weights)


def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False):
    """Context manager yielding ``loss * loss_scale``; on exit the gradients of ``optimizers``
    are unscaled (into the fp32 master gradients under O2) and checked for inf/NaN. A step whose
    gradients are not finite is skipped by those optimizers' ``step()``. ``delay_unscale=True``
    leaves gradients scaled for accumulation (finish with a ``delay_unscale=False`` call);
    ``delay_overflow_check=True`` defers the skip decision to ``step()``."""
    return _default_handle.scale_loss(loss, optimizers, loss_id=loss_id, model=model,
                                      delay_unscale=delay_unscale,
                                      delay_overflow_check=delay_overflow_check)


def state_dict(destination=None) -> dict:
    """The loss scalers' state in apex's format, plus what a bitwise resume needs."""
    return _default_handle.state_dict(destination)


def load_state_dict(state_dict) -> None:
    """Load a state written by ``state_dict()`` (or by apex); refuses one that does not fit."""
    _default_handle.load_state_dict(state_dict)


def loss_scalers():
    """The loss scalers of the current run, one per ``loss_id``. Each has ``loss_scale``,
    ``steps``, ``skipped_steps`` and ``last_step_skipped`` (was the latest step skipped?), host
    values that cost no sync to read."""
    return _default_handle.loss_scalers()


def clip_grad_norm_(optimizer, max_norm, norm_type=2.0):
    """Clip the true gradients ``optimizer``'s next step() applies to ``max_norm``; returns their
    total norm, as ``torch.nn.utils.clip_grad_norm_``. Call it after the backward(s), before
    ``step()``. On the fused step nothing is materialised: one fused norm, the clip coefficient
    folded into the step, no host read."""
    return _default_handle.clip_grad_norm_(optimizer, max_norm, norm_type)


def master_params(optimizer):
    """The tensors ``optimizer`` updates: the fp32 master weights under O2, else the model's."""
    return _default_handle.master_params(optimizer)


def locate_nonfinite(model=None):
    """Log (WARNING) the first module whose forward output holds inf or NaN, in each forward of
    ``model`` (returns its ``NonfiniteLocator``: ``.first_module`` is the latest finding,
    ``.remove()`` turns it off), or of every model of the current run when ``model`` is None.
    One host sync per module per forward: a debugging tool."""
    return _default_handle.locate_nonfinite(model)


def report(models=None, optimizers=None) -> AmpReport:
    """What amp set up, per dtype the count and bytes of parameters, gradients and master
    weights, the modules kept fp32, the kernel backend per device, and Linear/Conv dimensions
    that are not multiples of 8. Defaults to the current run's models and optimizers; logs
    nothing (``print(amp.report())``)."""
    return _default_handle.report(models, optimizers)
