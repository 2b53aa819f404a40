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

from .casting import (disable_casts, float_function, half_function, promote_function,
                      register_float_function, register_half_function,
                      register_promote_function)
from .handle import AmpHandle
from .opt_levels import OPT_LEVELS, OptLevel, Properties
from .scaler import DEFAULT_SCALE_WINDOW, LossScaler

__all__ = [
    "initialize", "scale_loss", "state_dict", "load_state_dict", "master_params",
    "half_function", "float_function", "promote_function", "register_half_function",
    "register_float_function", "register_promote_function", "disable_casts", "AmpHandle",
    "OPT_LEVELS", "OptLevel", "Properties", "LossScaler", "default_handle",
]

_default_handle = AmpHandle()


def default_handle() -> AmpHandle:
    """The handle behind the module-level functions (for diagnostics and tests)."""
    return _default_handle


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale=None, cast_model_outputs=None, num_losses=1, verbosity=1,
               min_loss_scale=None, max_loss_scale=2. ** 24, *, half_dtype=None,
               keep_fp32_modules=(), hysteresis=1, scale_window=DEFAULT_SCALE_WINDOW,
               process_group=None):
    """Set models and optimizers up for mixed precision at ``opt_level`` ("O0".."O3"), as apex.

    Returns ``(model, optimizer)``, each a list only where a list was passed, or the model(s)
    alone when no optimizer was passed. The objects are the ones passed in, modified in place.

    Keyword-only extensions (their defaults keep apex's behaviour):
      half_dtype: torch.float16 or torch.bfloat16; default fp16 for CUDA models, bf16 for CPU.
      keep_fp32_modules: module types or qualified names (fnmatch patterns allowed) kept fp32
        when the model is cast to half (O2/O3), beside BatchNorm's ``keep_batchnorm_fp32``.
      hysteresis: overflows tolerated before the dynamic scale is halved (1: every overflow).
      scale_window: clean steps before the dynamic scale doubles (apex: 2000).
      process_group: the group the overflow flag is all-reduced over when torch.distributed is
        initialised (default: the default group).
    """
    return _default_handle.initialize(
        models, optimizers, enabled=enabled, opt_level=opt_level,
        cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
        loss_scale=loss_scale, cast_model_outputs=cast_model_outputs, num_losses=num_losses,
        verbosity=verbosity, min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
        half_dtype=half_dtype, keep_fp32_modules=keep_fp32_modules, hysteresis=hysteresis,
        scale_window=scale_window, process_group=process_group)


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


def master_params(optimizer):
    """The tensors ``optimizer`` updates: the fp32 master weights under O2, else the model's."""
    return _default_handle.master_params(optimizer)
