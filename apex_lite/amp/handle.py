"""``AmpHandle``: one amp configuration (initialize, scale_loss, state_dict) and its run state.

The module-level functions of ``apex_lite.amp`` delegate to one default handle; that is the only
global. Each ``initialize`` makes a fresh ``_Run`` (re-initialising starts clean); models and
optimizers it patched carry a reference to their own run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import torch

from . import casting, diagnostics, fsdp
from . import report as report_module
from .opt_levels import OPT_LEVELS, Properties, resolve_properties
from . import model_hooks, step_path
# The hooks kept with a model, importable where models pickled before model_hooks.py find them.
from .model_hooks import (_DtypeGuard, _Fp32StateDict, _MastersFollowModelLoads,  # noqa: F401
                          _ModelZeroGrad)
from .optimizer import AmpOptimizer
from .overflow import DecisionLog, FlagPool, OverflowCheck, is_logging_rank
from .scaler import DEFAULT_SCALE_WINDOW, DEFAULT_SYNC_INTERVAL, LossScaler

logger = logging.getLogger("apex_lite.amp")

STATE_KEY = "apex_lite"
STATE_VERSION = 1
_MARK = "_apex_lite_amp"


def _as_list(value, kind: type, what: str):
    """(list, was_list) as apex accepts: one object or a list (or tuple) of them."""
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if not isinstance(item, kind):
                raise TypeError(f"{what}[{i}] is a {type(item).__name__}, not a "
                                f"{kind.__module__}.{kind.__qualname__}")
        return list(value), True
    raise TypeError(f"{what} must be a single {kind.__qualname__} or a list of them, got "
                    f"{type(value).__name__}")


def _describe(p: torch.Tensor) -> str:
    return f"shape {tuple(p.shape)}, dtype {p.dtype}, device {p.device}"


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
        # O2: per model, (qualified name, half model param, fp32 master) in named_parameters order.
        self.master_pairs: List[List[tuple]] = [[] for _ in models]
        self.master_of: Dict[torch.Tensor, torch.Tensor] = {}
        self.model_of: Dict[torch.Tensor, torch.Tensor] = {}
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
            label = f"model {i}" if len(self.models) > 1 else "the model"
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
                f"amp's master weights still hold the old tensors. Move the model before "
                f"initializing (model.to(device); then model, optimizer = amp.initialize(model, "
                f"optimizer, ...)), or build a fresh model and optimizer on the new device, load "
                f"their state_dicts and call amp.initialize again.")
        self.check_dtypes(caller)

    def check_dtypes(self, caller: str, model_index: Optional[int] = None) -> None:
        """Raise when a model's parameters changed dtype after ``initialize`` (all models, or
        the one at ``model_index``); a few attribute reads."""
        for i, name, param, dtype in self.dtype_probes:
            if param.dtype != dtype and (model_index is None or i == model_index):
                label = f"model {i}" if len(self.models) > 1 else "the model"
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
                raise ValueError(
                    f"{caller}: parameter {self.param_name(p)!r} is already updated by "
                    f"{other.label()}; under amp each parameter belongs to one optimizer (a "
                    f"scale_loss given both would unscale its gradient twice, and each step() "
                    f"would apply it again). Give each parameter to one optimizer, or use one "
                    f"optimizer with a param group per learning rate.")

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
            for master, model_param in self.model_of.items():
                names[id(master)] = names.get(id(model_param), "?")
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
            if id(p) not in self.param_ids and p not in self.model_of:
                return p
        return None

    def masters_for(self, params: Sequence[torch.Tensor], caller: str) -> List[torch.Tensor]:
        """``params`` with each cast model parameter replaced by its fp32 master."""
        foreign = self.foreign_param(params)
        if foreign is not None:
            raise ValueError(f"{caller} got a parameter ({_describe(foreign)}) that is not a "
                             f"parameter of the model(s) passed to amp.initialize. Pass every "
                             f"model whose parameters the optimizer updates, e.g. "
                             f"amp.initialize([model_a, model_b], optimizer, ...).")
        return [self.master_of.get(p, p) for p in params]

    # ---- the amp state (amp.state_dict() and each amp optimizer's state_dict() carry it) -----
    def scaler_state(self) -> dict:
        """The loss scalers' state: apex's ``{"loss_scaler<i>": {"loss_scale", "unskipped"}}``
        and, under the versioned key "apex_lite", their counters (reads a device scale: a
        sync). ``amp.state_dict()`` adds the O2 master weights; an optimizer's ``state_dict()``
        carries this alone (the model's ``state_dict()`` holds the masters)."""
        state = OrderedDict()
        for scaler in self.scalers:
            state[f"loss_scaler{scaler.loss_id}"] = scaler.apex_state()
        state[STATE_KEY] = {"version": STATE_VERSION, "opt_level": self.properties.opt_level,
                            "loss_scalers": [scaler.extra_state() for scaler in self.scalers]}
        return state

    def check_state(self, state_dict: dict, *, with_masters: bool) -> None:
        """Raise ValueError, changing nothing, when ``state_dict`` (what ``amp.state_dict()`` or
        apex wrote; with ``with_masters=False``, what ``scaler_state()`` wrote) does not fit
        this run."""
        _refuse_what_is_not_an_amp_state(state_dict)
        n = len(self.scalers)
        expected = {f"loss_scaler{i}" for i in range(n)}
        scaler_keys = {k for k in state_dict if k != STATE_KEY}
        if scaler_keys != expected:
            found = sorted(k for k in scaler_keys if str(k).startswith("loss_scaler"))
            other = sorted(str(k) for k in scaler_keys if not str(k).startswith("loss_scaler"))
            if other:
                raise ValueError(f"this is not an amp state: unexpected keys {other}; "
                                 f"amp.load_state_dict takes what amp.state_dict() returned")
            complete = set(found) == {f"loss_scaler{i}" for i in range(len(found))}
            if found and complete:
                raise ValueError(f"the amp state holds {len(found)} loss scaler(s) ({found}) but "
                                 f"this run has num_losses={n}; initialize with "
                                 f"num_losses={len(found)} to resume it")
            missing = sorted(expected - set(found))
            raise ValueError(f"the amp state lacks {', '.join(map(repr, missing))} (it holds "
                             f"{found or 'no loss scaler'}): amp.state_dict() writes "
                             f"'loss_scaler0' to 'loss_scaler<num_losses - 1>', so this state was "
                             f"damaged or edited. Load the amp state the checkpoint saved.")
        extra = state_dict.get(STATE_KEY)
        if extra is not None:
            self._check_extra(extra, with_masters)
        for scaler in self.scalers:
            key = f"loss_scaler{scaler.loss_id}"
            scaler.check_state(key, state_dict[key],
                               None if extra is None else extra["loss_scalers"][scaler.loss_id])

    def apply_state(self, state_dict: dict) -> None:
        """Load a state that ``check_state`` accepted."""
        extra = state_dict.get(STATE_KEY)
        for scaler in self.scalers:
            key = f"loss_scaler{scaler.loss_id}"
            scaler.load_state(state_dict[key],
                              None if extra is None else extra["loss_scalers"][scaler.loss_id])
        if extra is not None and "master_weights" in extra:
            with torch.no_grad():
                for pairs, saved in zip(self.master_pairs, extra["master_weights"]):
                    for (_, model_param, master), value in zip(pairs, saved):
                        master.copy_(value)
                        model_param.copy_(master)

    def _check_extra(self, extra, with_masters: bool) -> None:
        if not isinstance(extra, dict):
            raise ValueError(f"the amp state's {STATE_KEY!r} entry is a "
                             f"{type(extra).__name__}, not the dict amp.state_dict() writes; the "
                             f"checkpoint is damaged or not an amp state")
        if not isinstance(extra, dict) or extra.get("version") != STATE_VERSION:
            version = extra.get("version") if isinstance(extra, dict) else None
            raise ValueError(f"the amp state's {STATE_KEY!r} entry has version {version!r}; this "
                             f"apex_lite reads version {STATE_VERSION}")
        keys = {"version", "opt_level", "loss_scalers"} | ({"master_weights"} if with_masters
                                                           else set())
        if set(extra) != keys:
            raise ValueError(f"the amp state's {STATE_KEY!r} entry has keys {sorted(extra)}, "
                             f"not those {'amp' if with_masters else 'an amp optimizer'}"
                             f".state_dict() writes")
        if extra["opt_level"] != self.properties.opt_level:
            raise ValueError(f"the amp state was saved at opt_level {extra['opt_level']!r} but "
                             f"this run uses {self.properties.opt_level!r}; initialize with "
                             f"opt_level={extra['opt_level']!r} to resume it")
        scalers = extra["loss_scalers"]
        if not isinstance(scalers, list) or len(scalers) != len(self.scalers):
            raise ValueError(f"the amp state's counters cover "
                             f"{len(scalers) if isinstance(scalers, list) else '?'} loss "
                             f"scaler(s) but this run has {len(self.scalers)}")
        if not with_masters:
            return
        masters = extra["master_weights"]
        if not isinstance(masters, list) or len(masters) != len(self.master_pairs):
            raise ValueError(f"the amp state holds master weights for "
                             f"{len(masters) if isinstance(masters, list) else '?'} model(s) but "
                             f"this run has {len(self.master_pairs)}")
        for m, (pairs, saved) in enumerate(zip(self.master_pairs, masters)):
            if not isinstance(saved, list) or len(saved) != len(pairs):
                held = len(saved) if isinstance(saved, list) else "?"
                raise ValueError(f"the amp state holds {held} master weights for model {m}, "
                                 f"which has {len(pairs)}")
            for (name, _, master), value in zip(pairs, saved):
                if not isinstance(value, torch.Tensor) or value.shape != master.shape \
                        or value.dtype != torch.float32 or value.is_meta \
                        or value.layout != torch.strided:
                    got = (f"shape {tuple(value.shape)}, dtype {value.dtype}"
                           f"{', a meta tensor (no data)' if value.is_meta else ''}"
                           f"{'' if value.layout == torch.strided else f', {value.layout}'}"
                           if isinstance(value, torch.Tensor) else type(value).__name__)
                    raise ValueError(f"the saved master weight for {name!r} of model {m} is "
                                     f"{got}; this run's is shape {tuple(master.shape)}, "
                                     f"torch.float32")


def _refuse_what_is_not_an_amp_state(state_dict: dict) -> None:
    """Name the usual mix-ups (a whole checkpoint, a model's or optimizer's state_dict, an empty
    dict) before the key-by-key checks."""
    keys = [str(k) for k in state_dict]
    if not keys:
        raise ValueError("the amp state is an empty dict: amp.state_dict() returns {} before "
                         "amp.initialize or when amp was disabled, so the run that saved it had "
                         "no loss scalers. Save amp.state_dict() after amp.initialize.")
    if STATE_KEY in state_dict or any(k.startswith("loss_scaler") for k in keys):
        return
    if "amp" in state_dict:
        hint = "it looks like the whole checkpoint: pass checkpoint['amp']"
    elif {"state", "param_groups"} <= set(keys):
        hint = "it looks like an optimizer's state_dict"
    elif all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        hint = "it looks like a model's state_dict"
    else:
        hint = "it holds none of the keys amp.state_dict() writes"
    shown = keys[:5] + (["..."] if len(keys) > 5 else [])
    raise ValueError(f"this is not an amp state ({hint}; keys {shown}). amp.load_state_dict "
                     f"takes what amp.state_dict() returned (keys 'loss_scaler0', ...), e.g. "
                     f"amp.load_state_dict(checkpoint['amp']).")


def _check_model(model: torch.nn.Module, index: int) -> None:
    for wrapper in (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel):
        if isinstance(model, wrapper):
            raise RuntimeError(
                f"model {index} is already wrapped in {wrapper.__module__}.{wrapper.__name__}. "
                f"Parallel wrappers must be applied AFTER amp.initialize: "
                f"model, optimizer = amp.initialize(model, optimizer, ...); "
                f"model = {wrapper.__name__}(model, ...).")
    if getattr(model, _MARK, None) is not None:
        raise RuntimeError(
            f"model {index} ({type(model).__name__}) was already passed to amp.initialize; it is "
            f"cast and its forward wrapped. To re-initialise, build a fresh model (load its fp32 "
            f"state_dict into it) and pass that.")
    devices = OrderedDict()
    for name, p in model.named_parameters():
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        where = ", ".join(f"{name!r} on {device}" for device, name in devices.items())
        raise ValueError(
            f"model {index} has parameters on {len(devices)} devices ({where}); amp.initialize "
            f"needs each model on one device. Move it first with model.to(device); for one "
            f"process per GPU wrap the initialized model in DistributedDataParallel.")
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(
                f"amp.initialize needs models whose floating-point parameters are float32, but "
                f"{name!r} of model {index} is {p.dtype}. Build or load the model in fp32 and let "
                f"the opt level cast it: O1 keeps fp32 weights and runs the forward under "
                f"autocast; O2 casts the model to half and keeps fp32 master weights made from "
                f"the fp32 values (the way to train a half model safely); O3 is pure half. "
                f"Calling .half() or .bfloat16() yourself loses the fp32 values O2's masters are "
                f"made from.")


def _refuse_sparse_gradients(model: torch.nn.Module, index: int) -> None:
    """Embeddings built with ``sparse=True`` make sparse gradients, which amp's unscale and
    inf/NaN check (dense multi-tensor kernels) cannot take: name the parameter now rather than
    let the first ``scale_loss`` fail inside torch's dispatcher."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse \
                and module.weight.requires_grad:
            param = f"{name}.weight" if name else "weight"
            raise ValueError(
                f"{param!r} of model {index} belongs to {type(module).__name__}(..., "
                f"sparse=True), which makes sparse gradients; amp unscales and checks dense "
                f"gradients only. Build it with sparse=False (the default: its gradient is then "
                f"a dense {tuple(module.weight.shape)} tensor), or freeze it with "
                f"model.{param}.requires_grad_(False) if it is not trained.")


def _check_scale_args(num_losses, verbosity, min_loss_scale, max_loss_scale, hysteresis,
                      scale_window, overflow_patience, sync_interval) -> None:
    def positive_int(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    positive_int("num_losses", num_losses)
    positive_int("hysteresis", hysteresis)
    positive_int("scale_window", scale_window)
    positive_int("sync_interval", sync_interval)
    if overflow_patience is not None:
        positive_int("overflow_patience", overflow_patience)
    if isinstance(verbosity, bool) or not isinstance(verbosity, int) or verbosity < 0:
        raise ValueError(f"verbosity must be an int >= 0 (0 silences amp's log), got "
                         f"{verbosity!r}")
    for name, value in (("max_loss_scale", max_loss_scale), ("min_loss_scale", min_loss_scale)):
        if value is None and name == "min_loss_scale":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if min_loss_scale is not None and min_loss_scale > max_loss_scale:
        raise ValueError(f"min_loss_scale={min_loss_scale} is above max_loss_scale="
                         f"{max_loss_scale}; the dynamic scale must fit between them")


def _slow_cpu_half(device_type: str, properties: Properties) -> Optional[str]:
    """Why half matmuls will be slow on this CPU, or None. torch runs bf16/fp16 matmuls and
    convolutions through slow fallbacks on CPUs without the matching matrix instructions."""
    half = properties.half_dtype
    uses_half = properties.patch_torch_functions or properties.cast_model_type == half
    if device_type != "cpu" or not uses_half:
        return None
    def has(probe: str) -> bool:   # a torch too old to ask is given the benefit of the doubt
        return getattr(torch.cpu, probe, lambda: True)()

    if half == torch.bfloat16:
        fast = has("_is_avx512_bf16_supported") or has("_is_amx_tile_supported")
        needed = "AVX512-BF16 or AMX"
    else:
        fast = has("_is_amx_fp16_supported")
        needed = "AMX-FP16"
    if fast:
        return None
    return (f"this CPU lacks {needed} instructions, so torch runs {half} matmuls and "
            f"convolutions through slow fallbacks here, often many times slower than fp32: "
            f"{properties.opt_level} will still save memory but will likely train slower than "
            f"O0 on this machine.")


class AmpHandle:
    """One amp configuration. ``apex_lite.amp``'s module-level functions use a default one."""

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
                   sync_interval=DEFAULT_SYNC_INTERVAL):
        """apex's ``amp.initialize``; see ``apex_lite.amp.initialize`` for the extensions."""
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
        if not model_list:
            raise ValueError("amp.initialize needs at least one model")
        if len({id(m) for m in model_list}) != len(model_list):
            raise ValueError("the same model appears twice in models; pass each model once")
        for i, model in enumerate(model_list):
            _check_model(model, i)
            _refuse_sparse_gradients(model, i)
        device_type = next((p.device.type for m in model_list for p in m.parameters()
                            if p.is_floating_point()), "cpu")
        properties = resolve_properties(
            opt_level, device_type=device_type, half_dtype=half_dtype,
            cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
            keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
            loss_scale=loss_scale, cast_model_outputs=cast_model_outputs)
        _check_scale_args(num_losses, verbosity, min_loss_scale, max_loss_scale, hysteresis,
                          scale_window, overflow_patience, sync_interval)
        if fused_step not in (None, True, False):
            raise ValueError(f"fused_step must be None (the fused step where it applies), True "
                             f"(required: an error names an optimizer that cannot take it) or "
                             f"False (the unfused step everywhere); got {fused_step!r}")
        if isinstance(keep_fp32_modules, (str, type)):
            keep_fp32_modules = (keep_fp32_modules,)
        keep_fp32_modules = tuple(keep_fp32_modules)
        casts_to_half = properties.cast_model_type in (torch.float16, torch.bfloat16)
        if keep_fp32_modules and not casts_to_half:
            raise ValueError(f"keep_fp32_modules keeps modules fp32 inside a model cast to half "
                             f"(O2, O3), but {opt_level} does not cast the model to half")
        casting.check_keep_rules(model_list, keep_fp32_modules)
        sharding = fsdp.inspect(model_list)
        if sharding is not None:
            kept = [casting.modules_kept_fp32(m, bool(properties.keep_batchnorm_fp32),
                                              keep_fp32_modules) if casts_to_half else []
                    for m in model_list]
            sharding.check(properties, kept)
            sharding.check_optimizers(opt_list, {id(p) for m in model_list
                                                 for p in m.parameters()})
        if len({id(o) for o in opt_list}) != len(opt_list):
            raise ValueError("the same optimizer appears twice in optimizers; pass each once")
        for i, opt in enumerate(opt_list):
            if hasattr(opt, _MARK):
                raise RuntimeError(
                    f"optimizer {i} ({type(opt).__name__}) was already passed to amp.initialize. "
                    f"An optimizer can be initialised once: to re-initialise, create a new "
                    f"optimizer over the new model's parameters and pass both.")
        unfused_whys = [step_path.choose(opt, i, properties, fused_step)
                        for i, opt in enumerate(opt_list)]
        if sharding is not None and process_group is None:
            process_group = sharding.process_group()   # every rank of the mesh decides together
        run = _Run(properties, model_list, num_losses=num_losses, verbosity=verbosity,
                   min_loss_scale=min_loss_scale, max_loss_scale=float(max_loss_scale),
                   hysteresis=hysteresis, scale_window=scale_window, process_group=process_group,
                   overflow_patience=overflow_patience, sync_interval=sync_interval)
        for i, opt in enumerate(opt_list):
            foreign = run.foreign_param([p for g in opt.param_groups for p in g["params"]])
            if foreign is not None:
                raise ValueError(
                    f"optimizer {i} holds a parameter ({_describe(foreign)}) that is not a "
                    f"parameter of the model(s) passed to amp.initialize. Pass every model "
                    f"whose parameters it updates, e.g. amp.initialize([model_a, model_b], "
                    f"optimizer, ...), or build the optimizer from model.parameters().")
        owner: Dict[int, int] = {}
        for i, opt in enumerate(opt_list):
            for p in {id(p): p for g in opt.param_groups for p in g["params"]}.values():
                first = owner.setdefault(id(p), i)
                if first != i:
                    raise ValueError(
                        f"parameter {run.param_name(p)!r} is in optimizer {first} and in "
                        f"optimizer {i}; under amp each parameter belongs to one optimizer (a "
                        f"scale_loss given both would unscale its gradient twice, and each "
                        f"step() would apply it again). Give each parameter to one optimizer, "
                        f"or use one optimizer with a param group per learning rate.")

        # Now change things: cast the models, wrap their forwards, take over the optimizers.
        run.sharding = sharding
        if self._run is not None and self._run.enabled:
            for amp_opt in self._run.optimizers:   # the previous run's watches on the models
                amp_opt.watches.remove()
        for index, model in enumerate(model_list):
            self._prepare_model(run, index, model, keep_fp32_modules)
        for opt, why in zip(opt_list, unfused_whys):
            self._take_over_optimizer(run, opt, why)
        devices = {p.device for amp_opt in run.optimizers for p in amp_opt.masters()}
        if run.optimizers and len(devices) == 1 and all(amp_opt.path.fused
                                                          for amp_opt in run.optimizers):
            run.decides_on_device = True
            device = next(iter(devices))   # every scaler beside the parameters (not popped)
            for scaler in run.scalers:
                scaler.use_device(device)
        run.record_placement()
        self._run = run
        if locate_nonfinite:
            run.locate_nonfinite()
        if verbosity >= 1 and is_logging_rank():
            logger.info("Selected optimization level %s: %s", opt_level,
                        OPT_LEVELS[opt_level].brief)
            logger.info("Defaults for this optimization level, with overrides applied: %s",
                        properties.describe())
            slow = _slow_cpu_half(device_type, properties)
            if slow:
                logger.warning(slow)
        return result()

    def _prepare_model(self, run: _Run, index: int, model: torch.nn.Module,
                       keep_fp32_modules) -> None:
        props = run.properties
        cast_type = props.cast_model_type
        if cast_type in (torch.float16, torch.bfloat16):
            keep_bn = bool(props.keep_batchnorm_fp32)
            kept = casting.modules_kept_fp32(model, keep_bn, keep_fp32_modules)
            run.kept_fp32[index] = [name for name, _ in kept]
            kept_params = {id(p) for _, m in kept for p in m.parameters()}
            if props.master_weights:
                # Masters are the original fp32 values, before the cast rounds them.
                for name, p in model.named_parameters():
                    # FSDP2's sharded fp32 parameters are their own masters (fsdp.py).
                    if p.is_floating_point() and id(p) not in kept_params \
                            and not fsdp.is_sharded(p):
                        # A parameter shared with a model prepared before keeps its master.
                        master = run.master_of.get(p)
                        if master is None:
                            # The fp32 storage itself becomes the master (``.data``: no autograd
                            # history, its own version counter); the cast below gives the
                            # parameter new half storage. No copy: O2's setup never holds
                            # fp32 twice.
                            master = p.data
                            master.requires_grad_(p.requires_grad)
                            run.master_of[p] = master
                            run.model_of[master] = p
                        run.master_pairs[index].append((name, p, master))
            if run.sharding is not None:
                run.sharding.cast_model(model, cast_type, kept,
                                        cast_shards=not props.master_weights)
            else:
                casting.cast_model(model, cast_type, kept)
        if cast_type is not None:
            casting.wrap_forward(model, input_dtype=cast_type,
                                 output_dtype=props.cast_model_outputs or torch.float32)
        elif props.patch_torch_functions:
            # Outputs leave in fp32 unless asked otherwise: the loss is usually computed outside
            # the model's forward, beyond autocast's reach, and apex's O1 ran loss functions in
            # fp32 (by patching torch), so a half loss there would be a silent loss of precision.
            casting.wrap_forward(model, autocast_dtype=props.half_dtype,
                                 output_dtype=props.cast_model_outputs or torch.float32)
        elif props.cast_model_outputs is not None:
            casting.wrap_forward(model, output_dtype=props.cast_model_outputs)
        model_hooks.hang_on_model(model, run, index,
                                  cast_to_half=cast_type in (torch.float16, torch.bfloat16))
        setattr(model, _MARK, props.opt_level)

    def _take_over_optimizer(self, run: _Run, opt: torch.optim.Optimizer,
                             unfused_why: str) -> None:
        for group in opt.param_groups:
            group["params"] = run.masters_for(group["params"], "amp.initialize")
        for model_param, master in run.master_of.items():
            if model_param in opt.state:
                opt.state[master] = opt.state.pop(model_param)
        amp_opt = AmpOptimizer(opt, run, run.model_of)
        amp_opt.path = step_path.UnfusedStep(unfused_why) if unfused_why else \
            step_path.FusedStep(opt, run.model_of)
        amp_opt.install()
        # apex's mark of an initialised optimizer, which engines that call initialize lazily
        # test with hasattr(optimizer, "_amp_stash"); what it holds is apex_lite's own state.
        opt._amp_stash = amp_opt
        run.optimizers.append(amp_opt)

    # ---- scale_loss -------------------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(self, loss, optimizers, loss_id=0, model=None, delay_unscale=False,
                   delay_overflow_check=False):
        """apex's ``amp.scale_loss``; ``model`` is accepted for apex compatibility and unused."""
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
            amp_opt = getattr(opt, _MARK, None)
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
        if isinstance(multiplier, torch.Tensor) and multiplier.device != loss.device:
            # A device scale beside the masters, the loss elsewhere (FSDP2's CPU offload).
            multiplier = multiplier.to(loss.device)
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
        if not backward.ran:
            # No backward through the scaled loss (`scaled_loss.backward` without the
            # parentheses, or a skipped backward): nothing to unscale; step() refuses.
            for amp_opt, stash in zip(amp_opts, stashes):
                amp_opt.restore_stash(stash)
                amp_opt.missing_backward = True
            return
        check = None
        if not delay_unscale:
            delayed = [l for amp_opt in amp_opts for l in amp_opt.pending_losses]
            check = OverflowCheck(scaler, loss, optimizers=amp_opts, flag_pool=run.flag_pool,
                                  process_group=run.process_group, delayed_losses=delayed)
        for amp_opt, stash in zip(amp_opts, stashes):
            amp_opt.missing_backward = False
            amp_opt.after_backward(stash, loss, scale, delay_unscale, check)
        if check is not None and not delay_overflow_check:
            check.resolve()

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self, destination=None) -> dict:
        """apex's ``{"loss_scaler<i>": {"loss_scale", "unskipped"}}`` plus, under the versioned
        key "apex_lite", the counters and O2 master weights a bitwise resume needs."""
        run = self._run
        state = OrderedDict() if destination is None else destination
        if run is None or not run.enabled:
            return state
        state.update(run.scaler_state())
        state[STATE_KEY]["master_weights"] = [[master.detach().clone() for _, _, master in pairs]
                                              for pairs in run.master_pairs]
        return state

    def load_state_dict(self, state_dict) -> None:
        """Load what ``state_dict`` (ours or apex's) wrote; refuses, changing nothing, a state
        that does not fit this run."""
        run = self._run
        if run is None:
            raise RuntimeError("amp.load_state_dict was called before amp.initialize. Call "
                               "amp.initialize (with the opt level of the saved run) first, then "
                               "load the model, optimizer and amp states.")
        if not isinstance(state_dict, dict):
            raise TypeError(f"amp.load_state_dict takes the dict amp.state_dict() returned, got "
                            f"{type(state_dict).__name__}")
        if not run.enabled:
            return
        run.check_state(state_dict, with_masters=True)
        run.apply_state(state_dict)

    # ---- helpers ----------------------------------------------------------------------------
    def loss_scalers(self) -> List[LossScaler]:
        """The current run's loss scalers, one per ``loss_id`` (empty before ``initialize`` and
        when it was disabled). Their counters are host values; on the fused step, whose scales
        live on the device, they are brought up to date now and whenever one is read (a sync,
        which also emits the skip log's pending lines)."""
        run = self._run
        if run is None or not run.enabled:
            return []
        for scaler in run.scalers:
            scaler.sync()
        return list(run.scalers)

    def locate_nonfinite(self, model: Optional[torch.nn.Module] = None):
        """Turn on the locator that logs the first module whose forward output holds inf or NaN:
        on ``model`` (any module; returns its ``NonfiniteLocator``), or on every model of the
        current run (returns the list). ``.remove()`` turns a locator off."""
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
        """What amp set up, as an ``AmpReport`` (``str()`` it to read)."""
        run = self._run
        if run is None or not run.enabled:
            raise RuntimeError("amp.report needs an enabled amp.initialize first")
        model_list = run.models if models is None else \
            _as_list(models, torch.nn.Module, "models")[0]
        opt_list = [o.optimizer for o in run.optimizers] if optimizers is None else \
            _as_list(optimizers, torch.optim.Optimizer, "optimizers")[0]
        return report_module.build_report(run, model_list, opt_list)

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the true gradients ``optimizer``'s next step() applies to ``max_norm`` and return
        their total norm, as ``torch.nn.utils.clip_grad_norm_``; after the backward(s), before
        ``step()``. On the fused step (2-norm) nothing is written: one fused norm, the clip
        coefficient folded into the step, no host read; a non-finite norm skips the step."""
        amp_opt = getattr(optimizer, _MARK, None)
        if amp_opt is None or amp_opt.run is not self._run:
            raise RuntimeError("amp.clip_grad_norm_ takes an optimizer that the latest "
                               "amp.initialize returned")
        return amp_opt.clip_grad_norm_(max_norm, norm_type)

    def master_params(self, optimizer: torch.optim.Optimizer):
        """The tensors ``optimizer`` updates (the fp32 masters under O2), as apex: a generator.
        On the fused step, gradients still scaled are unscaled into the masters' gradients
        when it is first read (to clip or read them, as apex code does)."""
        amp_opt = getattr(optimizer, _MARK, None)
        if amp_opt is not None:
            amp_opt.materialize_master_grads()
        for group in optimizer.param_groups:
            for p in group["params"]:
                yield p


# ---- amp._amp_state: apex's global state object, as a read-only view ---------------------------

_STATE_API = ("amp.initialize(...) (opt level, loss_scale, verbosity), amp.load_state_dict(...) "
              "(a saved loss scale) and amp.loss_scalers() (to read the scalers)")


class _ReadOnlyView:
    """Attributes with apex's names over apex_lite's state; writing one raises, naming the API
    that does it (apex code that set apex's state would otherwise change nothing, silently)."""

    __slots__ = ()
    _what = "amp._amp_state"

    def __setattr__(self, name, value):
        raise AttributeError(f"{self._what} is a read-only view in apex_lite: {name!r} cannot be "
                             f"set. Use {_STATE_API} instead.")

    def __delattr__(self, name):
        self.__setattr__(name, None)

    def __getattr__(self, name):
        mapped = sorted(n for n, v in vars(type(self)).items()
                        if isinstance(v, property) or (callable(v) and not n.startswith("__")))
        if name in mapped:   # a mapped property raised AttributeError: let its message through
            return vars(type(self))[name].__get__(self)
        raise AttributeError(f"{self._what} (apex_lite's read-only view of apex's state) has no "
                             f"attribute {name!r}; it maps {mapped}")


class ApexLossScalerView(_ReadOnlyView):
    """One entry of ``_amp_state.loss_scalers``: apex's ``LossScaler`` reading names over a
    ``LossScaler`` (reads of a device scale sync, as ``amp.loss_scalers()`` does)."""

    __slots__ = ("_scaler",)
    _what = "amp._amp_state.loss_scalers[i]"

    def __init__(self, scaler: LossScaler):
        object.__setattr__(self, "_scaler", scaler)

    def loss_scale(self) -> float:
        """The current loss scale (apex's method)."""
        return self._scaler.loss_scale

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _loss_scale(self) -> float:
        return self._scaler.loss_scale

    @property
    def _unskipped(self) -> int:
        return self._scaler.apex_state()["unskipped"]

    @property
    def _has_overflow(self) -> bool:
        """Whether the latest step's gradients overflowed (read after ``step()``, as apex code
        does: apex's flag of the latest unscale, apex_lite's of the latest skip decision)."""
        return self._scaler.last_step_skipped

    @property
    def _min_loss_scale(self):
        return self._scaler.min_loss_scale

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_loss_scale


class ApexPropertiesView(_ReadOnlyView):
    """``_amp_state.opt_properties``: the run's resolved properties under apex's names, with
    apex's ``options`` dict and ``enabled``."""

    __slots__ = ("_options",)
    _what = "amp._amp_state.opt_properties"

    def __init__(self, properties: Optional[Properties]):
        options = {"enabled": properties is not None}
        if properties is not None:
            options.update((f.name, getattr(properties, f.name))
                           for f in dataclasses.fields(properties))
        object.__setattr__(self, "_options", options)

    @property
    def options(self) -> dict:
        return dict(self._options)

    def __getattr__(self, name):
        options = object.__getattribute__(self, "_options")
        if name in options:
            return options[name]
        raise AttributeError(f"{self._what} has no attribute {name!r}; it has "
                             f"{sorted(options)}")


class AmpStateView(_ReadOnlyView):
    """``amp._amp_state``: what apex kept in its global ``_amp_state``, read from a handle (the
    default one; resolved at every read, so that it follows re-initialisation):
    ``loss_scalers`` (apex's ``loss_scale()`` on each), ``opt_properties``, ``handle`` and
    ``verbosity``. Read-only: writing raises, naming the public API."""

    __slots__ = ("_handle_of",)

    def __init__(self, handle_of):
        object.__setattr__(self, "_handle_of", handle_of)

    @property
    def handle(self) -> "AmpHandle":
        return self._handle_of()

    @property
    def loss_scalers(self) -> tuple:
        run = self.handle._run
        if run is None or not run.enabled:
            return ()
        return tuple(ApexLossScalerView(scaler) for scaler in run.scalers)

    @property
    def opt_properties(self) -> ApexPropertiesView:
        run = self.handle._run
        if run is None:
            raise AttributeError("amp._amp_state.opt_properties is set by amp.initialize, which "
                                 "has not been called yet (apex had none before it either)")
        return ApexPropertiesView(run.properties if run.enabled else None)

    @property
    def verbosity(self) -> int:
        run = self.handle._run
        return getattr(run, "verbosity", 1)   # apex's default before initialize

    def __repr__(self) -> str:
        run = self.handle._run
        if run is None:
            return "<amp._amp_state (apex_lite): before amp.initialize>"
        if not run.enabled:
            return "<amp._amp_state (apex_lite): amp disabled>"
        return (f"<amp._amp_state (apex_lite): {run.properties.opt_level}, "
                f"{len(run.scalers)} loss scaler(s)>")
