"""``AmpHandle``: one amp configuration (initialize, scale_loss, state_dict) and its run.

The module-level functions of ``apex_lite.amp`` delegate to one default handle; that is the only
global. Each ``initialize`` checks its arguments (init_checks.py) and makes a fresh ``_Run``
(run.py; re-initialising starts clean); models and optimizers it patched carry a reference to
their own run.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import List, Optional

import torch

from . import casting, diagnostics, fsdp, init_checks, model_hooks
from . import report as report_module
from . import run as run_module
from . import saved_state, step_path
from .fp8 import install as fp8_install
from .init_checks import as_list as _as_list
# The hooks kept with a model, importable where models pickled before model_hooks.py find them.
from .model_hooks import (_DtypeGuard, _Fp32StateDict, _MastersFollowModelLoads,  # noqa: F401
                          _ModelZeroGrad)
from .opt_levels import HALF_DTYPES, OPT_LEVELS, resolve_properties
from .optimizer import AmpOptimizer
from .optimizer_hooks import amp_optimizer_of, stepping_optimizer
from .overflow import OverflowCheck, is_logging_rank
from .run import _DisabledRun, _Run
from .scaler import DEFAULT_SCALE_WINDOW, DEFAULT_SYNC_INTERVAL, LossScaler

logger = logging.getLogger("apex_lite.amp")


class AmpHandle:
    """One amp configuration and its run. ``apex_lite.amp``'s module-level functions use a
    default one (:func:`apex_lite.amp.default_handle`); create your own, with no arguments, to
    keep two independent configurations (one per thread or training run)."""

    def __init__(self):
        self._run = None

    # ---- initialize -----------------------------------------------------------------------
    def initialize(self, models, optimizers=None, enabled=True, opt_level="O1",
                   cast_model_type=None, patch_torch_functions=None, keep_batchnorm_fp32=None,
                   master_weights=None, loss_scale=None, cast_model_outputs=None, num_losses=1,
                   verbosity=1, min_loss_scale=None, max_loss_scale=2. ** 24, *,
                   half_dtype=None, keep_fp32_modules=(), hysteresis=1,
                   scale_window=DEFAULT_SCALE_WINDOW, process_group=None,
                   overflow_patience=diagnostics.DEFAULT_OVERFLOW_PATIENCE,
                   locate_nonfinite=False, fused_step=None,
                   sync_interval=DEFAULT_SYNC_INTERVAL, patch_torch_functions_type=None,
                   frozen_master_weights=False, fp8=None):
        """apex's ``amp.initialize`` on this handle: the arguments, what it returns and what it
        raises are those of :func:`apex_lite.amp.initialize`."""
        model_list, models_was_list = _as_list(models, torch.nn.Module, "models")
        if optimizers is None:
            opt_list, opts_was_list = [], False
        else:
            opt_list, opts_was_list = _as_list(optimizers, torch.optim.Optimizer, "optimizers")

        def result():
            if opts_was_list:
                return (model_list if models_was_list else model_list[0]), opt_list
            model_out = model_list if models_was_list else model_list[0]
            return model_out if not opt_list else (model_out, opt_list[0])

        if not enabled:
            self._run = _DisabledRun()
            return result()

        # Validate everything before changing anything.
        init_checks.check_models(model_list)
        device_type = next((p.device.type for m in model_list for p in m.parameters()
                            if p.is_floating_point()), "cpu")
        properties = resolve_properties(
            opt_level, device_type=device_type, half_dtype=half_dtype,
            cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
            patch_torch_functions_type=patch_torch_functions_type,
            keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
            loss_scale=loss_scale, cast_model_outputs=cast_model_outputs)
        init_checks.check_scale_args(num_losses, verbosity, min_loss_scale, max_loss_scale,
                                     hysteresis, scale_window, overflow_patience, sync_interval)
        init_checks.check_fused_step(fused_step)
        fp8_config = init_checks.check_fp8(fp8, properties, model_list)
        keep_fp32_modules = init_checks.keep_fp32_rules(keep_fp32_modules, properties, model_list)
        casts_to_half = properties.cast_model_type in HALF_DTYPES
        sharding = fsdp.inspect(model_list)
        if sharding is not None:
            kept = [casting.modules_kept_fp32(m, bool(properties.keep_batchnorm_fp32),
                                              keep_fp32_modules) if casts_to_half else []
                    for m in model_list]
            sharding.check(properties, kept)
            sharding.check_optimizers(opt_list, {id(p) for m in model_list
                                                 for p in m.parameters()})
        init_checks.check_optimizers(opt_list)
        unfused_whys = [step_path.choose(stepping_optimizer(opt)[0], i, properties, fused_step)
                        for i, opt in enumerate(opt_list)]
        if sharding is not None and process_group is None:
            process_group = sharding.process_group()   # every rank of the mesh decides together
        run = _Run(properties, model_list, num_losses=num_losses, verbosity=verbosity,
                   min_loss_scale=min_loss_scale, max_loss_scale=float(max_loss_scale),
                   hysteresis=hysteresis, scale_window=scale_window, process_group=process_group,
                   overflow_patience=overflow_patience, sync_interval=sync_interval)
        init_checks.check_optimizer_params(run, opt_list)

        # Now change things: cast the models, wrap their forwards, take over the optimizers.
        run.sharding = sharding
        if self._run is not None and self._run.enabled:
            for amp_opt in self._run.optimizers:   # the previous run's watches on the models
                amp_opt.watches.remove()
        # O2's masters: for the parameters the optimizers hold (apex's rule), or every one.
        held = None if frozen_master_weights else \
            {id(p) for opt in opt_list for group in opt.param_groups for p in group["params"]}
        for index, model in enumerate(model_list):
            run_module.prepare_model(run, index, model, keep_fp32_modules, held)
        for opt, why in zip(opt_list, unfused_whys):
            run_module.take_over_optimizer(run, opt, why)
        run.fp8 = None if fp8_config is None else fp8_install.install(run, fp8_config)
        devices = {p.device for amp_opt in run.optimizers for p in amp_opt.masters()}
        if run.optimizers and len(devices) == 1 and all(amp_opt.path.fused
                                                          for amp_opt in run.optimizers):
            run.decides_on_device = True
            device = next(iter(devices))   # every scaler beside the parameters (not popped)
            for scaler in run.scalers:
                scaler.use_device(device)
        run.record_placement()
        run.copies.record()
        self._run = run
        if locate_nonfinite:
            run.locate_nonfinite()
        if verbosity >= 1 and is_logging_rank():
            logger.info("Selected optimization level %s: %s", opt_level,
                        OPT_LEVELS[opt_level].brief)
            logger.info("Defaults for this optimization level, with overrides applied: %s",
                        properties.describe())
            for warning in (init_checks.slow_cpu_half(device_type, properties),
                            init_checks.static_scale_in_fp16(properties)):
                if warning:
                    logger.warning(warning)
        return result()

    # ---- scale_loss -------------------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(self, loss, optimizers, loss_id=0, model=None, delay_unscale=False,
                   delay_overflow_check=False):
        """apex's ``amp.scale_loss`` on this handle: the arguments, what it yields and what it
        raises are those of :func:`apex_lite.amp.scale_loss` (``model`` is accepted for apex
        compatibility and unused)."""
        run = self._run
        if run is None:
            raise RuntimeError("amp.scale_loss was called before amp.initialize. Call "
                               "model, optimizer = amp.initialize(model, optimizer, "
                               "opt_level=...) first, then use the objects it returns.")
        if not run.enabled:
            yield loss
            return
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            kind = loss.dtype if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"amp.scale_loss needs a floating-point loss tensor, got {kind}. "
                            f"Pass the loss your criterion returned (before .item()).")
        if loss.numel() != 1:
            raise ValueError(f"amp.scale_loss needs a scalar loss, got shape {tuple(loss.shape)}. "
                             f"Reduce it first, e.g. loss.mean() or loss.sum().")
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) \
                or not 0 <= loss_id < len(run.scalers):
            raise ValueError(f"loss_id={loss_id!r} is out of range: amp.initialize was called "
                             f"with num_losses={len(run.scalers)}, so loss_id must be in "
                             f"0..{len(run.scalers) - 1}")
        opt_list, _ = _as_list(optimizers, torch.optim.Optimizer, "optimizers")
        if not opt_list:
            raise ValueError("amp.scale_loss got no optimizers: it unscales and checks the "
                             "gradients of the optimizers it is given, so with none the next "
                             "step() would apply gradients still multiplied by the loss scale. "
                             "Pass the optimizer(s) whose parameters the loss reaches: "
                             "amp.scale_loss(loss, optimizer).")
        amp_opts: List[AmpOptimizer] = []
        for i, opt in enumerate(opt_list):
            amp_opt = amp_optimizer_of(opt)
            if amp_opt is None:
                raise RuntimeError(f"optimizer {i} given to amp.scale_loss was not passed to "
                                   f"amp.initialize; pass it there and use the returned "
                                   f"optimizer")
            if amp_opt.run is not run:
                raise RuntimeError(
                    f"optimizer {i} given to amp.scale_loss belongs to an earlier "
                    f"amp.initialize call; use the optimizers of the latest call. If another "
                    f"thread (or another training run in this process) called amp.initialize "
                    f"since, give each its own handle instead of the module-level functions: "
                    f"handle = amp.AmpHandle(); model, optimizer = handle.initialize(...); "
                    f"with handle.scale_loss(loss, optimizer) as scaled: ...")
            if amp_opt.in_scale_loss:
                raise RuntimeError(
                    f"amp.scale_loss was entered for optimizer {i} inside another "
                    f"amp.scale_loss for the same optimizer that has not exited yet. Nested "
                    f"scale_loss blocks would mix two backwards under one unscale: finish the "
                    f"first block (its backward) before the next, add the losses and use one "
                    f"scale_loss, or accumulate with delay_unscale=True.")
            if amp_opt not in amp_opts:
                amp_opts.append(amp_opt)
        run.check_placement("amp.scale_loss")
        scaler = run.scalers[loss_id]
        scale = scaler.backward_scale()
        for amp_opt in amp_opts:
            amp_opt.check_can_accumulate(scale)
            amp_opt.check_devices("amp.scale_loss")

        stashes = [amp_opt.before_backward() for amp_opt in amp_opts]
        for amp_opt in amp_opts:
            amp_opt.in_scale_loss = True
        multiplier = scale.multiplier
        if isinstance(multiplier, torch.Tensor):
            # The device scale is [1]: 0-dim, the scaled loss has the loss's shape (apex's). On
            # the loss's device: the scale beside the masters, the loss elsewhere (FSDP2's CPU
            # offload).
            multiplier = multiplier.reshape(()).to(loss.device)
        scaled_loss = loss.float() * multiplier
        backward = model_hooks._BackwardWatch(scaled_loss)
        try:
            yield scaled_loss
        except BaseException:
            for amp_opt, stash in zip(amp_opts, stashes):
                amp_opt.restore_stash(stash)
            raise
        finally:
            backward.block_exited = True
            for amp_opt in amp_opts:
                amp_opt.in_scale_loss = False
        # O2 under torch's DDP: the masters of a DDP a forward ran inside, broadcast once (a
        # collective every training rank reaches; after the backward, whose saved half weights
        # must not be written before it runs: ddp.py).
        run.ddp.broadcast_pending()
        if not backward.ran:
            # No backward through the scaled loss (`scaled_loss.backward` without the
            # parentheses, or a skipped backward): nothing to unscale; step() refuses.
            for amp_opt, stash in zip(amp_opts, stashes):
                amp_opt.restore_stash(stash)
                amp_opt.missing_backward = True
            return
        # Under data parallel (ddp.py): a backward under no_sync() is left scaled for the synced
        # one to add to, as delay_unscale leaves it; after one that all-reduced the gradients,
        # every rank decides alike from its own, without a collective.
        reduces = run.ddp.backward_reduces()
        if reduces is False:
            delay_unscale = True
        check = None
        if not delay_unscale:
            delayed = [l for amp_opt in amp_opts for l in amp_opt.delayed_losses]
            check = OverflowCheck(scaler, loss, optimizers=amp_opts, flag_pool=run.flag_pool,
                                  process_group=run.process_group, delayed_losses=delayed,
                                  reduced=reduces is True)
        for amp_opt, stash in zip(amp_opts, stashes):
            amp_opt.missing_backward = False
            amp_opt.after_backward(stash, loss, scale, delay_unscale, check)
        # Before code between the backward and step() reads param_groups: the masters follow
        # their parameters' requires_grad, and writes made in the forward (two_copies.py).
        run.copies.sync("amp.scale_loss")
        if check is not None and not delay_overflow_check:
            check.resolve()

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self, destination=None) -> dict:
        """apex's ``{"loss_scaler<i>": {"loss_scale", "unskipped"}}`` plus, under the versioned
        key "apex_lite", the counters and O2 master weights a bitwise resume needs; as
        :func:`apex_lite.amp.state_dict` (``destination``: a dict to fill)."""
        run = self._run
        state = OrderedDict() if destination is None else destination
        if run is None or not run.enabled:
            return state
        state.update(saved_state.amp_state_dict(run))
        return state

    def load_state_dict(self, state_dict) -> None:
        """Load what ``state_dict`` (ours or apex's) wrote; refuses, changing nothing, a state
        that does not fit this run. A state saved at another opt level loads what carries over
        (``saved_state.Accepted``). Arguments and errors: :func:`apex_lite.amp.load_state_dict`."""
        run = self._run
        if run is None:
            raise RuntimeError("amp.load_state_dict was called before amp.initialize. Call "
                               "amp.initialize first (at the saved run's opt level or another), "
                               "then load the model, optimizer and amp states.")
        if not isinstance(state_dict, dict):
            raise TypeError(f"amp.load_state_dict takes the dict amp.state_dict() returned, got "
                            f"{type(state_dict).__name__}")
        if not run.enabled:
            return
        saved_state.load_amp_state(run, state_dict)

    # ---- helpers ----------------------------------------------------------------------------
    def loss_scalers(self) -> List[LossScaler]:
        """The current run's loss scalers, one per ``loss_id`` (empty before ``initialize`` and
        when it was disabled). Their counters are host values; on the fused step, whose scales
        live on the device, they are brought up to date now and whenever one is read (a sync,
        which also emits the skip log's pending lines). As :func:`apex_lite.amp.loss_scalers`."""
        run = self._run
        if run is None or not run.enabled:
            return []
        for scaler in run.scalers:
            scaler.sync()
        return list(run.scalers)

    def locate_nonfinite(self, model: Optional[torch.nn.Module] = None):
        """Turn on the locator that logs the first module whose forward output holds inf or NaN:
        on ``model`` (any module; returns its ``NonfiniteLocator``), or on every model of the
        current run (returns the list). ``.remove()`` turns a locator off. Arguments and
        errors: :func:`apex_lite.amp.locate_nonfinite`."""
        if model is not None:
            if not isinstance(model, torch.nn.Module):
                raise TypeError(f"amp.locate_nonfinite takes an nn.Module, got "
                                f"{type(model).__name__}")
            return diagnostics.NonfiniteLocator(model)
        run = self._run
        if run is None or not run.enabled:
            raise RuntimeError("amp.locate_nonfinite() without a model needs an enabled "
                               "amp.initialize first; or pass the model: "
                               "amp.locate_nonfinite(model)")
        return run.locate_nonfinite()

    def report(self, models=None, optimizers=None) -> "report_module.AmpReport":
        """What amp set up, as an ``AmpReport`` (``str()`` it to read). Arguments and errors:
        :func:`apex_lite.amp.report`."""
        run = self._run
        if run is None or not run.enabled:
            raise RuntimeError("amp.report needs an enabled amp.initialize first")
        model_list = run.models if models is None else \
            _as_list(models, torch.nn.Module, "models")[0]
        opt_list = [o.given for o in run.optimizers] if optimizers is None else \
            _as_list(optimizers, torch.optim.Optimizer, "optimizers")[0]
        return report_module.build_report(run, model_list, opt_list)

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the true gradients ``optimizer``'s next step() applies to ``max_norm`` and return
        their total norm, as ``torch.nn.utils.clip_grad_norm_``; after the backward(s), before
        ``step()``. On the fused step (2-norm) nothing is written: one fused norm, the clip
        coefficient folded into the step, no host read; a non-finite norm skips the step.
        Arguments and errors: :func:`apex_lite.amp.clip_grad_norm_`."""
        amp_opt = amp_optimizer_of(optimizer)
        if amp_opt is None or amp_opt.run is not self._run:
            raise RuntimeError("amp.clip_grad_norm_ takes an optimizer that the latest "
                               "amp.initialize returned")
        return amp_opt.clip_grad_norm_(max_norm, norm_type)

    def master_params(self, optimizer: torch.optim.Optimizer):
        """The tensors ``optimizer`` updates (the fp32 masters under O2), as apex: a generator.
        On the fused step, gradients still scaled are unscaled into the masters' gradients
        when it is first read (to clip or read them, as apex code does). As
        :func:`apex_lite.amp.master_params`."""
        amp_opt = amp_optimizer_of(optimizer)
        if amp_opt is not None:
            amp_opt.run.copies.sync("amp.master_params")
            amp_opt.materialize_master_grads()
        for group in optimizer.param_groups:
            for p in group["params"]:
                yield p
