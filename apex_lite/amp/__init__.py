"""apex.amp's API on today's PyTorch: ``initialize``, ``scale_loss``, checkpoints, casts.

::

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
from .fp8 import FP8
from .handle import AmpHandle
from .report import AmpReport
from .opt_levels import OPT_LEVELS, OptLevel, OptLevelError, Properties
from .scaler import DEFAULT_SCALE_WINDOW, DEFAULT_SYNC_INTERVAL, LossScaler

__all__ = [
    "initialize", "scale_loss", "state_dict", "load_state_dict", "master_params", "loss_scalers",
    "clip_grad_norm_",
    "half_function", "bfloat16_function", "float_function", "promote_function",
    "register_half_function", "register_bfloat16_function", "register_float_function",
    "register_promote_function", "disable_casts", "init", "AmpHandle",
    "OPT_LEVELS", "OptLevel", "OptLevelError", "Properties", "LossScaler", "default_handle", "locate_nonfinite",
    "report", "AmpReport", "NonfiniteLocator", "OverflowStuckError", "save_checkpoint",
    "load_checkpoint", "CheckpointError", "FP8",
]

_default_handle = AmpHandle()


def default_handle() -> AmpHandle:
    """The handle behind the module-level functions (for diagnostics and tests).

    Returns:
        The default ``AmpHandle``.
    """
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
               patch_torch_functions_type=None, frozen_master_weights=False, fp8=None):
    """Set models and optimizers up for mixed precision at ``opt_level``, as apex: NVIDIA apex's
    "O0" to "O3", or ROCm apex's "O4" (O1 in bf16) and "O5" (O2 in bf16), both with a static
    loss scale of 1.0. Everything is checked before anything changes.

    Models sharded with PyTorch FSDP2 (``fully_shard``) are initialized after sharding and
    after the optimizer is built over the sharded parameters. At O2 and O5 each unit needs
    ``MixedPrecisionPolicy(param_dtype=half)``, and the sharded fp32 parameters are the master
    weights; see ``apex_lite.amp.fsdp`` for each level and what is refused.

    The arguments up to ``max_loss_scale`` are apex's, in apex's order; the keyword-only ones
    are extensions, whose defaults keep apex's behaviour.

    Args:
        models: an ``nn.Module`` or a list of them, with fp32 floating-point parameters, not yet
            wrapped in DDP (wrap after ``initialize``).
        optimizers: a ``torch.optim.Optimizer``, a list of them, or None (then only the models
            are returned). Every parameter an optimizer holds must belong to ``models``.
        enabled: False turns amp off: the objects are returned unchanged and ``scale_loss``
            yields the loss as it is.
        opt_level: "O0" (fp32), "O1" (autocast), "O2" (half model, fp32 masters), "O3" (half),
            "O4" (O1 in bf16), "O5" (O2 in bf16); the letter O, not the digit zero.
        cast_model_type: override the level's model dtype (``torch.float16``,
            ``torch.bfloat16``, ``torch.float32``), or False to leave the model as it is.
        patch_torch_functions: override whether the forward runs under ``torch.autocast``
            (apex's "patching"; only at O1 and O4).
        keep_batchnorm_fp32: override whether BatchNorm stays fp32 in a half model (default
            True at O2 and O5).
        master_weights: override whether the optimizer steps fp32 master weights (default True
            at O2 and O5).
        loss_scale: a number (a static scale) or "dynamic"; apex's argparse strings ("128.0",
            "dynamic") are accepted.
        cast_model_outputs: a dtype the model's floating-point outputs are cast to (default:
            fp32 at the levels that cast).
        num_losses: how many losses will be scaled, each with its own loss scaler (``loss_id``
            on ``scale_loss``).
        verbosity: 0, 1 or 2; what is logged on logger "apex_lite.amp" (only on rank 0 when
            distributed). 0: nothing. 1 (default): the skips of the start-of-training
            calibration (a dynamic scale halving from 2**16 until the first clean step) are
            folded into one INFO line, "loss scaler 0: first 7 steps skipped while the loss
            scale calibrated to 512.0"; after that each skip is an INFO line with apex's text
            ("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to
            32768.0"), and WARNINGs come only for an abnormal skip rate (more than 5 of the
            last 100 steps), a scale 4096x or more below its start, a loss that is inf or NaN,
            or a skip under a static loss scale. 2: apex's verbosity=1, every skip a WARNING
            with apex's line, calibration included.
        min_loss_scale: the floor of the dynamic scale (None: no floor).
        max_loss_scale: the ceiling of the dynamic scale (2**24).
        half_dtype: keyword-only. ``torch.float16`` or ``torch.bfloat16``; default fp16 for
            CUDA models, bf16 for CPU ones (O4 and O5 are bf16 levels: another half_dtype is
            refused there).
        keep_fp32_modules: keyword-only. Module types, or qualified names as
            ``named_modules()`` spells them (fnmatch patterns allowed), kept fp32 when the
            model is cast to half (O2, O3, O5), beside BatchNorm's ``keep_batchnorm_fp32``.
        hysteresis: keyword-only. Overflows tolerated before the dynamic scale is halved (1:
            every overflow).
        scale_window: keyword-only. Clean steps before the dynamic scale doubles (apex: 2000).
        process_group: keyword-only. The group the overflow flag is all-reduced over when
            torch.distributed is initialised (default: the default group; on a model sharded
            with FSDP2, the group of its device mesh).
        overflow_patience: keyword-only. After this many steps in a row skipped with the loss
            scale at its floor (min_loss_scale; a static scale; or, without min_loss_scale, any
            consecutive skips), raise ``OverflowStuckError``, which says whether the loss itself
            was inf/NaN and names the parameters whose gradients were, and turns the locator
            on. None: never.
        locate_nonfinite: keyword-only. Turn on ``amp.locate_nonfinite`` for the models (one
            host sync per module per forward: for debugging).
        fused_step: keyword-only. None (default): at O2 and O5, an optimizer whose update
            apex_lite's kernels compute (torch.optim.SGD, Adam, AdamW and apex_lite.optimizers)
            steps in one kernel pass from the half gradients, with no fp32 master gradients
            (``amp.report()`` says which path each optimizer takes, and why); others take the
            unfused step. True: require the fused step (an error names the optimizer that
            cannot take it). False: the unfused step everywhere.
        sync_interval: keyword-only. When every optimizer takes the fused step, the loss scale
            and the skip decisions stay on the device and the host counters
            (``amp.loss_scalers()``), the skip log and ``OverflowStuckError`` catch up when
            read, and at least every ``sync_interval`` steps.
        patch_torch_functions_type: keyword-only here (ROCm apex's argument; NVIDIA apex's
            positional order stays). The dtype autocast runs in, which may be set only at O1
            (torch.float16) and O4 (torch.bfloat16), as in ROCm apex; None: the level's (O1:
            the run's half dtype; O4: bf16). ``amp._amp_state.opt_properties`` and
            ``amp.report()`` show it.
        frozen_master_weights: keyword-only. At O2, keep an exact fp32 master also for the
            floating parameters that no optimizer passed here holds (frozen weights). Default
            False, apex's rule: they are cast to half with no master, cost their half bytes,
            and the model's ``state_dict()`` gives the upcast of their half values. A parameter
            that joins an optimizer later (``add_param_group``) gets its master then, from the
            best value amp has.
        fp8: keyword-only. At O2 and O5, run the matmuls of the eligible ``nn.Linear`` layers
            (in and out features multiples of 16 and at least ``min_features``) in fp8
            through ``torch._scaled_mm``: forward and both backward matmuls, E4M3 inputs and
            weights, E5M2 gradients, output in the half dtype. True: ``amp.FP8()``'s
            defaults; an ``amp.FP8(recipe=..., amax_history=..., min_features=...)`` config;
            None or False (default): no fp8. Refused at the other levels. Its state is in
            ``amp.state_dict()``, its clip and flush counts in ``amp.report().fp8``
            (docs/guides/fp8.md).

    Returns:
        ``(model, optimizer)``, each a list only where a list was passed, or the model(s) alone
        when no optimizer was passed. The objects are the ones passed in, modified in place.

    Raises:
        OptLevelError: an unknown level, or overrides that contradict each other or the level
            (a ValueError, and the RuntimeError apex raised); ``fp8`` at a level other than
            O2 and O5.
        ValueError: a model whose floating-point parameters are not fp32, an optimizer holding
            a tensor that is not a parameter of ``models``, one parameter in two optimizers,
            arguments out of range, an FSDP2 model whose units lack the mixed-precision policy
            the level needs, with ``fused_step=True`` an optimizer that cannot take the
            fused step, or with ``fp8`` a device without fp8 matmuls.
        TypeError: models or optimizers of the wrong type, or a ``keep_fp32_modules`` rule that
            is neither a module type nor a name.
        RuntimeError: a model already wrapped in a parallel wrapper (DDP, DataParallel), or a
            model or optimizer already passed to an earlier ``initialize``.
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
        frozen_master_weights=frozen_master_weights, fp8=fp8)


def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False):
    """Context manager yielding ``loss * loss_scale``, for the backward: ``with
    amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()``. On exit the
    gradients of ``optimizers`` are unscaled (at O2 the fp32 master gradients stand for them,
    see ``apex_lite.amp.master_grads``) and checked for inf/NaN. A step whose gradients are not
    finite is skipped by those optimizers' ``step()``, and no other's.

    Args:
        loss: the scalar floating-point loss tensor.
        optimizers: the optimizer, or list of optimizers, that ``initialize`` returned and
            whose parameters the loss reaches.
        loss_id: which loss scaler to use, in ``0 .. num_losses - 1``.
        model: accepted for apex compatibility and unused.
        delay_unscale: True leaves the gradients scaled, for gradient accumulation: pass it to
            every micro-batch but the last, whose ``scale_loss`` (False) unscales and checks
            them all.
        delay_overflow_check: True defers the skip decision to ``step()``; it never drops it.

    Yields:
        The scaled loss, ``loss.float() * loss_scale``.

    Raises:
        RuntimeError: ``initialize`` was not called, an optimizer was not passed to the latest
            ``initialize``, or blocks for one optimizer are nested.
        TypeError: ``loss`` is not a floating-point tensor.
        ValueError: ``loss`` is not a scalar, ``loss_id`` is out of range, or ``optimizers`` is
            empty.
    """
    return _default_handle.scale_loss(loss, optimizers, loss_id=loss_id, model=model,
                                      delay_unscale=delay_unscale,
                                      delay_overflow_check=delay_overflow_check)


def state_dict(destination=None) -> dict:
    """The amp state to checkpoint beside the model's and the optimizer's.

    Args:
        destination: a dict to fill and return (None: a new ``OrderedDict``).

    Returns:
        apex's ``{"loss_scaler<i>": {"loss_scale": ..., "unskipped": ...}}``, plus, under the
        versioned key ``"apex_lite"``, the scaler counters and O2's master weights that a
        bitwise resume needs (with ``fp8=``, also the fp8 scaling state, under ``"fp8"``, as
        plain tensors and numbers); empty before ``initialize`` or when amp is disabled.
    """
    return _default_handle.state_dict(destination)


def load_state_dict(state_dict) -> None:
    """Load a state written by ``state_dict()`` (or by apex), after ``initialize``. A state
    saved at another opt level loads what carries over (the loss scale between dynamic levels)
    and says at INFO what it left out.

    Args:
        state_dict: the dict ``amp.state_dict()`` returned (``checkpoint["amp"]``).

    Raises:
        RuntimeError: ``initialize`` was not called.
        TypeError: ``state_dict`` is not a dict.
        ValueError: a state that does not fit this run: another number of losses, values
            outside the run's settings, or something that is not an amp state. Nothing is
            changed.
    """
    _default_handle.load_state_dict(state_dict)


def loss_scalers():
    """The loss scalers of the current run, one per ``loss_id``.

    Returns:
        A list of ``LossScaler`` (empty before ``initialize`` or when amp is disabled). Each has
        ``loss_scale``, ``steps``, ``skipped_steps`` and ``last_step_skipped`` (was the latest
        step skipped?), host values. On the fused step, whose scales live on the device, this
        call brings them up to date (one sync, which also emits the skip log's pending lines).
    """
    return _default_handle.loss_scalers()


def clip_grad_norm_(optimizer, max_norm, norm_type=2.0):
    """Clip the true gradients ``optimizer``'s next ``step()`` applies, as
    ``torch.nn.utils.clip_grad_norm_`` does. Call it after the backward(s), before ``step()``.
    On the fused step (2-norm) nothing is materialised: one fused norm, the clip coefficient
    folded into the step, no host read; a non-finite norm skips the step.

    Args:
        optimizer: an optimizer the latest ``initialize`` returned.
        max_norm: the largest total norm the gradients may have.
        norm_type: the norm's order (2.0; ``float("inf")`` for the largest magnitude).

    Returns:
        The total norm of the gradients before clipping, a 0-dim fp32 tensor.

    Raises:
        RuntimeError: ``optimizer`` was not returned by the latest ``initialize``.
    """
    return _default_handle.clip_grad_norm_(optimizer, max_norm, norm_type)


def master_params(optimizer):
    """The tensors ``optimizer`` updates, as apex: the fp32 master weights at O2 and O5, else
    the model's parameters. On the fused step, reading them makes the masters' fp32 gradients
    for this step (``apex_lite.amp.master_grads``), so code may clip or edit them.

    Args:
        optimizer: an optimizer ``initialize`` returned (a plain one gives its parameters).

    Returns:
        A generator over the parameters of ``optimizer.param_groups``.
    """
    return _default_handle.master_params(optimizer)


def locate_nonfinite(model=None):
    """Log (WARNING) the first module whose forward output holds inf or NaN, in each forward.
    One host sync per module per forward: a debugging tool.

    Args:
        model: the module to watch; None: every model of the current run.

    Returns:
        ``model``'s ``NonfiniteLocator`` (``.first_module`` is the latest finding,
        ``.remove()`` turns it off), or a list of them, one per model of the run.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: ``model`` is None and no enabled ``initialize`` came first.
    """
    return _default_handle.locate_nonfinite(model)


def report(models=None, optimizers=None) -> AmpReport:
    """What amp set up: per dtype the count and bytes of parameters, gradients, master weights
    and optimizer state, the bytes held per model parameter, each optimizer's step path and
    why, the modules kept fp32, the kernel backend per device, Linear/Conv dimensions that
    are not multiples of 8, and with ``fp8=`` the layers in fp8 (those left in half, and why)
    and what their casts clipped or flushed (``.fp8``). Logs nothing
    (``print(amp.report())``).

    Args:
        models: the models to count (default: the current run's).
        optimizers: the optimizers to count (default: the current run's).

    Returns:
        An ``AmpReport``; ``str()`` it to read.

    Raises:
        RuntimeError: no enabled ``initialize`` came first.
    """
    return _default_handle.report(models, optimizers)
