"""The state of one ``initialize`` (``_Run``), and how it sets up each model and optimizer.

``AmpHandle.initialize`` checks everything first (init_checks.py), then makes a ``_Run``: the
loss scalers and their logs, the models and where and in which dtype their parameters were
(checked at every ``scale_loss`` and ``step()``), O2's master weights (masters.py), the amp
optimizers; and it prepares each model (``prepare_model``) and optimizer
(``take_over_optimizer``). Models and optimizers it patched hold a reference to their run.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from ..apex_compat.amp_stash import attach_amp_stash
from . import casting, ddp, diagnostics, fsdp, init_checks, model_hooks, step_path
from .init_checks import describe as _describe
from .opt_params import MOVED_FIX
from .pairs import Pairs
from .two_copies import TwoCopies
from .opt_levels import HALF_DTYPES, Properties
from .optimizer import AmpOptimizer
from .optimizer_hooks import MARK, stepping_optimizer
from .overflow import DecisionLog, FlagPool
from .scaler import LossScaler


class _DisabledRun:
    """``initialize(enabled=False)``: scale_loss yields the loss untouched."""
    enabled = False


class _Run:
    """What one ``initialize`` set up."""
    enabled = True

    def __init__(self, properties: Properties, models: List[torch.nn.Module], *, num_losses: int,
                 verbosity: int, min_loss_scale, max_loss_scale: float, hysteresis: int,
                 scale_window: int, process_group, overflow_patience: Optional[int],
                 sync_interval: int):
        self.properties = properties
        self.models = models
        self.verbosity = verbosity
        self.process_group = process_group
        self.scalers = [LossScaler(i, properties.loss_scale, min_loss_scale=min_loss_scale,
                                   max_loss_scale=max_loss_scale, scale_window=scale_window,
                                   hysteresis=hysteresis, sync_interval=sync_interval)
                        for i in range(num_losses)]
        self.skip_logs = [diagnostics.SkipLog(scaler, verbosity=verbosity,
                                              overflow_patience=overflow_patience)
                          for scaler in self.scalers]
        for scaler, skip_log in zip(self.scalers, self.skip_logs):
            scaler.on_decision = DecisionLog(self, skip_log)
        # Every optimizer takes the fused step, on one device: the loss scales and the skip
        # decisions live on that device and nothing is read on the host per step.
        self.decides_on_device = False
        self.locators: List[diagnostics.NonfiniteLocator] = []
        self.flag_pool = FlagPool()
        # Per model, the qualified names of the modules kept fp32 inside a half model.
        self.kept_fp32: List[List[str]] = [[] for _ in models]
        self._param_names: Optional[Dict[int, str]] = None
        self.param_ids = {id(p) for m in models for p in m.parameters()}
        # O2: each cast parameter and its fp32 master (pairs.py), and the rule that keeps the
        # two copies equal (two_copies.py).
        self.pairs = Pairs(models)
        self.copies = TwoCopies(self.pairs)
        # The data-parallel wrappers the models run inside (ddp.py).
        self.ddp = ddp.DataParallel()
        self.optimizers: List[AmpOptimizer] = []
        # The FSDP2 units of the models (fsdp.Sharding), or None when none is sharded.
        self.sharding: Optional[fsdp.Sharding] = None

    def record_placement(self) -> None:
        """Remember each model's first parameter and its device (after the casts, which keep
        Parameter identity), for ``check_placement``."""
        self.first_params, self.first_slots = [], []
        for model in self.models:
            name, first = next(iter(model.named_parameters()), (None, None))
            self.first_params.append(first)
            # (module, key) of the first parameter: an O(1) look-up per step.
            if name is None:
                self.first_slots.append(None)
            else:
                owner, _, key = name.rpartition(".")
                self.first_slots.append((model.get_submodule(owner), key))
        self.first_devices = [None if p is None else p.device for p in self.first_params]
        # One parameter per (model, floating dtype): model.half() / .float() / .double() after
        # initialize changes the dtype of parameters in place, keeping their identity.
        self.dtype_probes = []
        for i, model in enumerate(self.models):
            seen = set()
            for name, p in model.named_parameters():
                if p.is_floating_point() and p.dtype not in seen:
                    seen.add(p.dtype)
                    self.dtype_probes.append((i, name, p, p.dtype))

    def check_placement(self, caller: str) -> None:
        """Raise when a model was moved or its parameters replaced after ``initialize``. O(1) per
        model: ``model.to(device)`` moves the parameters in place (same device kind family) or
        replaces them (e.g. to "meta"); either shows on the first parameter."""
        for i, (slot, first, device) in enumerate(zip(self.first_slots, self.first_params,
                                                      self.first_devices)):
            now = None if slot is None else slot[0]._parameters.get(slot[1])
            if now is first and (now is None or now.device == device):
                continue
            if fsdp.registered_unsharded(first, now):
                continue   # FSDP2 keeps the unit unsharded between its forward and backward
            label = self.model_label(i)
            if self.sharding is None and fsdp.newly_sharded(self.models[i]):
                raise fsdp.sharded_after_initialize(caller, label,
                                                    self.properties.half_dtype)
            what = (f"its parameters are now on {now.device}, but were on {device} when "
                    f"amp.initialize ran" if now is first else
                    f"its parameters are not the tensors amp.initialize set up (now on "
                    f"{None if now is None else now.device}; .to() to another kind of device "
                    f"or reassigning parameters replaces them)")
            raise RuntimeError(
                f"{caller}: {label} was moved after amp.initialize: {what}. The optimizer and "
                f"amp's master weights still hold the old tensors. {MOVED_FIX}")
        self.check_dtypes(caller)

    def model_label(self, index: int) -> str:
        """How messages name model ``index``: "the model" when it is the only one."""
        return f"model {index}" if len(self.models) > 1 else "the model"

    def check_dtypes(self, caller: str, model_index: Optional[int] = None) -> None:
        """Raise when a model's parameters changed dtype after ``initialize`` (all models, or
        the one at ``model_index``); a few attribute reads."""
        for i, name, param, dtype in self.dtype_probes:
            if param.dtype != dtype and (model_index is None or i == model_index):
                label = self.model_label(i)
                raise RuntimeError(
                    f"{caller}: the dtype of {label} changed after amp.initialize: parameter "
                    f"{name!r} is now {param.dtype} but was {dtype} when amp.initialize set it "
                    f"up (model.half(), .bfloat16(), .float() or .double() after initialize?). "
                    f"amp casts the model itself at the opt level's dtypes: build the model in "
                    f"fp32 and choose the opt level (O1 autocast, O2 half with fp32 masters, O3 "
                    f"pure half) or half_dtype= in amp.initialize instead of casting it.")

    def refuse_shared_params(self, amp_optimizer, params, caller: str) -> None:
        """Raise when one of ``params`` (masters) is already updated by another optimizer of
        this run: one scale_loss would unscale its gradient once per optimizer."""
        owned = {id(p): other for other in self.optimizers if other is not amp_optimizer
                 for p in other.masters()}
        for p in params:
            other = owned.get(id(p))
            if other is not None:
                raise ValueError(f"{caller}: parameter {self.param_name(p)!r} is already "
                                 f"updated by {other.label()}; {init_checks.ONE_OPTIMIZER}")

    def model_zeroed(self, model: torch.nn.Module, set_to_none: bool) -> None:
        """``model.zero_grad()`` was called: clear what amp keeps for those parameters."""
        ids = {id(p) for p in model.parameters()}
        for amp_opt in self.optimizers:
            amp_opt.model_zeroed(ids, set_to_none)

    def param_name(self, tensor: torch.Tensor) -> str:
        """A parameter's (or its master's) name as ``named_parameters`` spells it, prefixed
        with "model <i>: " when there are several models. Built on first use (error paths)."""
        if self._param_names is None:
            names: Dict[int, str] = {}
            for i, model in enumerate(self.models):
                prefix = f"model {i}: " if len(self.models) > 1 else ""
                for name, p in model.named_parameters():
                    names.setdefault(id(p), prefix + name)
            for pair in self.pairs:
                names[id(pair.master)] = names.get(id(pair.model), "?")
            self._param_names = names
        return self._param_names.get(id(tensor), f"<unnamed {_describe(tensor)}>")

    def locate_nonfinite(self) -> List["diagnostics.NonfiniteLocator"]:
        """Turn the locator on for every model of this run (once)."""
        if not self.locators:
            self.locators = diagnostics.locate_nonfinite(self.models)
        return self.locators

    def foreign_param(self, params) -> Optional[torch.Tensor]:
        """The first of ``params`` that is neither a model parameter nor a master, if any."""
        for p in params:
            if id(p) not in self.param_ids and not self.pairs.is_master(p):
                return p
        return None

    def masters_for(self, params: Sequence[torch.Tensor], caller: str) -> List[torch.Tensor]:
        """``params`` with each cast model parameter replaced by its fp32 master; one that has
        none yet (no optimizer held it at initialize) gets it now (``Pairs.add``)."""
        foreign = self.foreign_param(params)
        if foreign is not None:
            raise ValueError(f"{caller} got a parameter ({_describe(foreign)}) that is not a "
                             f"parameter of the model(s) passed to amp.initialize. Pass every "
                             f"model whose parameters the optimizer updates, e.g. "
                             f"amp.initialize([model_a, model_b], optimizer, ...).")
        generation = self.pairs.generation
        masters = self.pairs.masters_for(params)
        if self.pairs.generation != generation:
            self._param_names = None
        return masters


def prepare_model(run: _Run, index: int, model: torch.nn.Module, keep_fp32_modules,
                  held: Optional[set]) -> None:
    """Model ``index`` for ``run``: cast (O2's masters made first, for the parameters in
    ``held``, or all when None), forward wrapped, hooks hung, marked as initialised."""
    props = run.properties
    cast_type = props.cast_model_type
    if cast_type in HALF_DTYPES:
        keep_bn = bool(props.keep_batchnorm_fp32)
        kept = casting.modules_kept_fp32(model, keep_bn, keep_fp32_modules)
        run.kept_fp32[index] = [name for name, _ in kept]
        kept_params = {id(p) for _, m in kept for p in m.parameters()}
        if props.master_weights:
            # Masters are the original fp32 values, before the cast rounds them.
            make_masters(run, index, model, kept_params, held)
        if run.sharding is not None:
            run.sharding.cast_model(model, cast_type, kept,
                                    cast_shards=not props.master_weights)
        else:
            casting.cast_model(model, cast_type, kept)
    # Inputs are cast to the model's type (a no-op cast at O1/O4 with cast_model_type=fp32,
    # where autocast still runs, as apex kept patching). Outputs leave in fp32 unless asked
    # otherwise: under autocast the loss is usually computed outside the model's forward, beyond
    # autocast's reach, and apex's O1 ran loss functions in fp32 (by patching torch), so a half
    # loss there would be a silent loss of precision.
    autocast_dtype = props.patch_torch_functions_type
    if cast_type is not None or autocast_dtype is not None:
        casting.wrap_forward(model, input_dtype=cast_type, autocast_dtype=autocast_dtype,
                             output_dtype=props.cast_model_outputs or torch.float32)
    elif props.cast_model_outputs is not None:
        casting.wrap_forward(model, output_dtype=props.cast_model_outputs)
    model_hooks.hang_on_model(model, run, index,
                              cast_to_half=cast_type in HALF_DTYPES)
    setattr(model, MARK, props.opt_level)


def make_masters(run: _Run, index: int, model: torch.nn.Module, kept_params: set,
                 held: Optional[set]) -> None:
    """O2, before the cast rounds them: the floating-point parameters of model ``index`` that an
    optimizer holds (ids in ``held``; every one when ``held`` is None), but those of
    ``kept_params`` (kept fp32), become pairs with their fp32 values as masters (``Pairs.make``).
    The others are cast without one (apex's rule: a frozen weight that no optimizer steps costs
    its half bytes); the registry remembers them, so that one that joins an optimizer later
    (``add_param_group``) gets its master then."""
    for name, p in model.named_parameters():
        # FSDP2's sharded fp32 parameters are their own masters (fsdp.py).
        if p.is_floating_point() and id(p) not in kept_params and not fsdp.is_sharded(p):
            if held is not None and id(p) not in held and run.pairs.of_model(p) is None:
                run.pairs.leave_unmastered(index, name, p)
            else:
                run.pairs.make(index, name, p)


def take_over_optimizer(run: _Run, opt: torch.optim.Optimizer, unfused_why: str) -> None:
    """Hand ``opt`` its masters and patch it (``AmpOptimizer``) onto the step path chosen. A
    wrapper that shares an inner optimizer's param groups (LARC, Lookahead, SAM) steps through
    the inner one, which amp takes over (``stepping_optimizer``)."""
    stepper, wrappers = stepping_optimizer(opt)
    for group in stepper.param_groups:
        masters = run.masters_for(group["params"], "amp.initialize")
        if isinstance(group["params"], list):
            # In place: an optimizer may hold the list itself (LBFGS keeps param_groups[0]
            # ["params"] as self._params), and must step the masters through it too.
            group["params"][:] = masters
        else:
            group["params"] = masters
    # Optimizer state (the stepping one's, and a wrapper's own: slow weights) follows.
    for state in {id(o.state): o.state for o in [stepper] + wrappers
                  if isinstance(getattr(o, "state", None), dict)}.values():
        for pair in run.pairs:
            if pair.model in state:
                state[pair.master] = state.pop(pair.model)
    amp_opt = AmpOptimizer(stepper, run, given=opt)
    amp_opt.path = step_path.UnfusedStep(unfused_why) if unfused_why else \
        step_path.FusedStep(stepper, run.pairs)
    amp_opt.install(wrappers)
    # apex's mark of an initialised optimizer, which engines that call initialize lazily
    # test with hasattr(optimizer, "_amp_stash"), with the attributes apex code reads from it
    # (the optimizer that steps and each wrapper around it that initialize was given).
    for marked in [stepper] + wrappers:
        attach_amp_stash(marked, amp_opt)
    run.optimizers.append(amp_opt)
