"""One fused optimizer update over explicit tensor lists: the unit that FusedSGD, FusedAdam,
FusedLAMB and amp's O2 step are built from.

An update (``SGDUpdate``, ``AdamUpdate``, ``LambUpdate``, one per optimizer module) holds the
parameters of one param group on one device, in three aligned lists given at construction:

- ``params``: the tensors the optimizer updates and keys its ``state`` by. Standalone, the
  parameters themselves (fp32, fp16 or bf16); under amp's O2, the fp32 masters.
- ``grad_sources``: the tensors whose ``.grad`` is read at every call (default ``params``). Under
  O2 the half model parameters, whose gradients carry the loss scale.
- ``model_params``: tensors that receive the updated value rounded once to their dtype (under O2
  the half model parameters), or none.

``update(state, inv_scale, found_inf, hyper, *, grads=None)`` makes one step:

- ``state``: the optimizer's state dict (param -> dict) in torch's layout. Entries are created
  lazily for parameters that have a gradient, all in fp32 on the parameter's device whatever its
  dtype (``exp_avg``, ``exp_avg_sq``, ``step`` as a 0-dim fp32 tensor; ``momentum_buffer``);
  entries loaded from elsewhere (another dtype or device, a Python number as ``step``) are
  converted once, when the lists are built.
- ``inv_scale``, ``found_inf``: 1-element fp32 tensors on the update's device. ``grad * inv_scale``
  is the true gradient; when ``found_inf`` is not 0 nothing at all is written (parameters, state,
  step counts, model parameters). Standalone use passes ``unit_scalars(device)``.
- ``hyper``: the group's hyper-parameters (``SGDHyper``, ``AdamHyper``, ``LambHyper``), which the
  caller reads from ``param_groups`` at every step (``apex_lite.optimizers.fusable`` maps torch's
  SGD/Adam/AdamW groups to them).
- ``grads``: gradients aligned with ``params`` to use instead of ``grad_sources``' ``.grad``
  (amp passes the materialised fp32 master gradients this way).

Parameters may be DTensors (PyTorch FSDP2's shards): the state is then created as DTensors
like them (what torch's optimizers and torch.distributed.checkpoint expect), and the op takes
every tensor's local shard, looked up at each call (FSDP2 may re-register a shard's storage).

Parameters whose gradient is None are skipped, as torch does. The tensor lists handed to the op
are built once and reused while the set of parameters with a gradient, the ``state`` dict object,
its number of entries and, for a ``WatchedState`` (what the optimizers and amp pass, see
watched_state.py), its version stay the same; a new param group, a loaded state dict, a first
state entry or a state tensor replaced (``state[p]["exp_avg"] = t``) therefore rebuild them. For
a plain dict ``invalidate()`` forces a rebuild where nothing of that shows (a state tensor
replaced). Per step and per tensor the only Python work is reading ``.grad``; and none at all
where the native backend holds the lists in C++ (``hold_lists``; Adam and SGD): once a plan over
every parameter is used a second time, its lists are handed to C++ once, and each later step
passes only the scalars, the gradients read there. A step that finds a gradient missing or
unusual there goes the list path for that step.
"""
from __future__ import annotations

import itertools
import operator
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..multi_tensor._backend import ops_for
from .watched_state import WatchedEntry, WatchedState, state_version, watch_entries

__all__ = ["FusedUpdate", "unit_scalars", "local_shards"]

STEPPED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_grad_of = operator.attrgetter("grad")
_has_grad = operator.is_not
_NONE = itertools.repeat(None)

# The standalone (inv_scale, found_inf) per device: 1 and 0. The fused ops only read them.
_unit: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}


def unit_scalars(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(inv_scale, found_inf)`` of a step without loss scaling on ``device``: fp32 [1] tensors
    holding 1 and 0, cached (never write to them)."""
    pair = _unit.get(device)
    if pair is None:
        pair = _unit[device] = (torch.ones(1, dtype=torch.float32, device=device),
                                torch.zeros(1, dtype=torch.float32, device=device))
    return pair


def is_unit_found_inf(found_inf: torch.Tensor, device: torch.device) -> bool:
    """Whether ``found_inf`` is ``unit_scalars(device)``'s zero: known 0 without a read."""
    pair = _unit.get(device)
    return pair is not None and found_inf is pair[1]


def dtensor_class() -> Optional[type]:
    """torch's DTensor class, or None while nothing has imported it (then no tensor can be one;
    importing it here would add half a second to every ``import apex_lite``)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_shards(tensors: List) -> List:
    """``tensors`` with each DTensor replaced by its local shard (what the multi-tensor ops take;
    writes to it are writes to the DTensor); the same list object when none is a DTensor."""
    dtensor = dtensor_class()
    if dtensor is None or not any(isinstance(t, dtensor) for t in tensors):
        return tensors
    with torch.no_grad():   # to_local() is then the shard itself, not an autograd view of it
        return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]


def zeros32(param: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 state tensor shaped and laid out like ``param``."""
    return torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)


class _Plan:
    """The lists one op call takes, for the parameters that had a gradient when it was built."""
    __slots__ = ("picks", "params", "model_params", "lists", "held")

    def __init__(self, picks, params, model_params, lists):
        self.picks = picks                  # indices into the update's lists, None for all
        self.params = params
        self.model_params = model_params
        self.lists = lists                  # the subclass's state lists, in the op's order
        # The lists held in C++ (``hold_lists``): None until first wanted, False when the
        # backend or the lists offer none.
        self.held = None

    def local(self) -> "_Plan":
        """The same plan over the local shards of its DTensors, for one call (lists without
        DTensors, such as SGD's indices of new buffers, stay the plan's own objects)."""
        return _Plan(self.picks, local_shards(self.params), local_shards(self.model_params),
                     tuple(local_shards(l) if isinstance(l, list) else l for l in self.lists))


class FusedUpdate:
    """The fused step of one param group on one device (see the module docstring).

    Args:
        params: the tensors the step updates (fp32 masters under O2).
        grad_sources: where their gradients are read (default ``params``; under O2 the model's
            half parameters, whose ``.grad`` holds the scaled gradients).
        model_params: keyword or positional; half model parameters the step writes rounded
            (O2), or None.
        label: keyword-only; how messages name the update.
        ops: keyword-only; the op module that computes the step (default: the backend serving
            the device, looked up at each call).
    """

    kind = ""            # "sgd", "adam", "lamb": for messages
    # The method of the lists held in C++ that makes this update's step (``hold_lists``), or
    # "" where the update always passes its lists.
    held_step = ""
    # Whether the update needs norms of whole parameters (LAMB's trust ratio), which the op
    # cannot compute from FSDP2's shards: such an update refuses DTensor parameters.
    needs_whole_parameters = False
    whole_norm = ""      # what the whole norm is for, in that update's refusal
    # Whether torch's own fused kernels (``torch._fused_sgd_``, ``_fused_adam_``,
    # ``_fused_adamw_``, ``_fused_adagrad_``) compute this update: multi_tensor/_torch_fused.py
    # drives them where no native kernels serve a device (amp's O2 step, FusedOptimizer's fp32
    # parameters). ``torch_kernels_reason`` says for which hyper-parameters.
    torch_kernels = False

    def __init__(self, params: Sequence[torch.Tensor],
                 grad_sources: Optional[Sequence[torch.Tensor]] = None,
                 model_params: Optional[Sequence[torch.Tensor]] = None, *, label: str = "",
                 ops=None):
        self.params: List[torch.Tensor] = list(params)
        # The op module that computes the step (``fused_sgd_``, ``fused_adam_``, ...): by default
        # the backend serving the device, looked up at each call (``ops_for``); amp's O2 step
        # passes torch's fused kernels where no native ones serve it (multi_tensor/_torch_fused).
        self.ops = ops
        self.grad_sources: List[torch.Tensor] = (self.params if grad_sources is None
                                                 else list(grad_sources))
        self.model_params: List[torch.Tensor] = [] if model_params is None else list(model_params)
        self.label = label or f"fused {self.kind} update"
        self.device: Optional[torch.device] = self.params[0].device if self.params else None
        dtensor = dtensor_class()
        # FSDP2's shards: the op takes their local tensors (``local_shards``), at every call.
        self.sharded = dtensor is not None and any(isinstance(t, dtensor) for t in self.params)
        if self.sharded and self.needs_whole_parameters:
            raise ValueError(
                f"{self.label}: its parameters are DTensors (sharded by FSDP2's fully_shard), "
                f"and the {self.kind} update needs each parameter's whole norm ("
                f"{self.whole_norm}), which the op cannot compute from one rank's shard. Use "
                f"FusedAdam or torch.optim.AdamW on a sharded model, or train this model "
                f"without fully_shard.")
        self._check_lists()
        self._plan: Optional[_Plan] = None
        self._plan_state: Optional[dict] = None
        self._plan_key: Optional[tuple] = None

    @classmethod
    def torch_kernels_reason(cls, hyper) -> str:
        """Why torch's fused kernels do not compute this update with ``hyper`` (one param
        group's); "" when they do. Where they are used anyway, ``_torch_fused`` hands such a
        call to the Python reference."""
        return "" if cls.torch_kernels else f"torch has no fused kernel for the {cls.kind} update"

    def _check_lists(self) -> None:
        n = len(self.params)
        for name, tensors in (("grad_sources", self.grad_sources),
                              ("model_params", self.model_params)):
            if tensors and len(tensors) != n:
                raise ValueError(f"{self.label}: {name} has {len(tensors)} tensors but params "
                                 f"has {n}; they are aligned, one per parameter")
        for name, tensors in (("params", self.params), ("grad_sources", self.grad_sources),
                              ("model_params", self.model_params)):
            for i, t in enumerate(tensors):
                if t.dtype not in STEPPED_DTYPES:
                    raise TypeError(f"{self.label}: {name}[{i}] is {t.dtype}; the fused "
                                    f"optimizers step float32, float16 and bfloat16 tensors")
                if t.device != self.device:
                    raise ValueError(f"{self.label}: {name}[{i}] is on {t.device} but params[0] "
                                     f"is on {self.device}; build one update per device")
                if t.shape != self.params[i].shape:
                    raise ValueError(f"{self.label}: {name}[{i}] has shape {tuple(t.shape)} but "
                                     f"params[{i}] has {tuple(self.params[i].shape)}")

    def invalidate(self) -> None:
        """Rebuild the cached lists at the next call."""
        self._plan = self._plan_state = None

    def read_grads(self) -> List[Optional[torch.Tensor]]:
        """The gradients of ``grad_sources`` now, aligned with ``params`` (None where absent)."""
        return list(map(_grad_of, self.grad_sources))

    @torch.no_grad()
    def __call__(self, state: Dict[torch.Tensor, dict], inv_scale: torch.Tensor,
                 found_inf: torch.Tensor, hyper, *,
                 grads: Optional[List[Optional[torch.Tensor]]] = None) -> None:
        self._run(state, inv_scale, found_inf, hyper, grads, ())

    def _run(self, state, inv_scale, found_inf, hyper, grads, extra: tuple) -> None:
        if not self.params:
            return
        if grads is None and self._step_held(state, inv_scale, found_inf, hyper, extra):
            return
        if grads is None:
            grads = self.read_grads()
        if all(map(_has_grad, grads, _NONE)):
            mask = None
        else:
            mask = tuple(map(_has_grad, grads, _NONE))
            if not any(mask):
                return
        plan = self._plan
        # The state dict is compared by identity, and held, so that a new dict at a freed one's
        # address cannot pass for it.
        if plan is None or state is not self._plan_state or \
                self._key(mask, state, hyper) != self._plan_key:
            if state is not self._plan_state:
                self._new_state()
            plan = self._plan = self._build(state, grads, mask, hyper)
            watch_entries(state, plan.params)
            self._plan_state = state
            # Taken after the build, whose own new state entries must not invalidate it.
            self._plan_key = self._key(mask, state, hyper)
        if plan.picks is not None:
            grads = [grads[i] for i in plan.picks]
        if self.sharded:
            plan, grads = plan.local(), local_shards(grads)
        ops = self.ops or ops_for(self.device)
        try:
            self._launch(ops, plan, state, grads, inv_scale, found_inf, hyper, *extra)
        except (RuntimeError, TypeError, ValueError) as exc:
            self.check_grads(grads, plan.params, exc)
            raise

    def _key(self, mask, state, hyper) -> tuple:
        """What a plan holds for: the parameters with a gradient (``mask``), the state's entry
        count and version (watched_state.py), the flavour of the update."""
        return mask, len(state), state_version(state), self._flavour(hyper)

    def _step_held(self, state, inv_scale, found_inf, hyper, extra: tuple) -> bool:
        """The step through the lists held in C++, when the cached plan covers every parameter
        and still holds (same state dict, entry count and version, same flavour); False, having done
        nothing, sends the caller to the list path. The op's own errors (raised before it writes
        anything) propagate as on the list path; gradients the list path refuses with a message
        of its own (sparse ones) are left to it."""
        plan = self._plan
        if plan is None or plan.picks is not None or plan.held is False or self.sharded \
                or state is not self._plan_state \
                or self._key(None, state, hyper) != self._plan_key:
            return False
        args = self._held_args(plan, hyper, extra)
        if args is None:
            return False
        if plan.held is None:
            held = None
            if self.held_step:
                held = (self.ops or ops_for(self.device)).hold_lists(
                    plan.params, self.grad_sources, plan.model_params, self._held_state(plan))
            plan.held = False if held is None else held
            if held is None:
                return False
        return getattr(plan.held, self.held_step)(inv_scale, found_inf, *args)

    def _build(self, state, grads, mask, hyper) -> _Plan:
        picks = None if mask is None else [i for i, present in enumerate(mask) if present]
        params = self.params if picks is None else [self.params[i] for i in picks]
        models = self.model_params
        if models and picks is not None:
            models = [models[i] for i in picks]
        self.check_grads(grads if picks is None else [grads[i] for i in picks], params)
        return _Plan(picks, params, models, self._state_lists(params, state, hyper))

    def check_grads(self, grads: List[Optional[torch.Tensor]],
                    params: Optional[List[torch.Tensor]] = None,
                    cause: Optional[BaseException] = None) -> None:
        """Raise an error naming the parameter and the fix for a gradient the op cannot take
        (``grads`` aligned with ``params``, default the update's; None entries are skipped);
        ``cause``, an exception the op raised, is chained to it."""
        for g, p in zip(grads, self.params if params is None else params):
            if g is not None and g.layout != torch.strided:
                dense_optimizer = "SGD" if self.kind == "sgd" else "SparseAdam"
                raise RuntimeError(
                    f"{self.label}: a parameter of shape {tuple(p.shape)} has a {g.layout} "
                    f"gradient; the fused optimizers take dense gradients only. Give it a dense "
                    f"gradient (e.g. nn.Embedding(sparse=False)) or step it with "
                    f"torch.optim.{dense_optimizer} in an optimizer of its own.") from cause

    # ---- what each optimizer defines ----------------------------------------------------------

    def _new_state(self) -> None:
        """Called when the lists are first built for a state dict (or after ``invalidate()``):
        forget what was known of the previous one."""

    def _flavour(self, hyper) -> object:
        """What of the hyper-parameters decides which state lists exist (SGD: momentum or not)."""
        return None

    def _state_lists(self, params: List[torch.Tensor], state, hyper) -> tuple:
        raise NotImplementedError

    def _launch(self, ops, plan: _Plan, state, grads, inv_scale, found_inf, hyper,
                *extra) -> None:
        raise NotImplementedError

    def _held_state(self, plan: _Plan) -> list:
        """The state lists the held step's op takes (``held_step``), in its order."""
        return list(plan.lists)

    def _held_args(self, plan: _Plan, hyper, extra: tuple) -> Optional[tuple]:
        """The held step's arguments after ``inv_scale, found_inf``; None where this step needs
        the list path."""
        return (*hyper, *extra)


# ---- state entries: created in fp32, converted once when loaded from elsewhere ----------------

def state_entry(state: Dict[torch.Tensor, dict], param: torch.Tensor) -> dict:
    """``state[param]``, created empty when missing (without a defaultdict's help; watched in a
    ``WatchedState``)."""
    entry = state.get(param)
    if entry is None:
        entry = state[param] = WatchedEntry(state) if type(state) is WatchedState else {}
    return entry


def fp32_like(value, param: torch.Tensor, name: str, label: str) -> torch.Tensor:
    """``value`` (a state tensor shaped like ``param``) as fp32 on ``param``'s device."""
    if not isinstance(value, torch.Tensor) or value.shape != param.shape:
        shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{label}: state '{name}' of a parameter of shape {tuple(param.shape)} "
                         f"is {shown}; load a state_dict saved for these parameters")
    if value.dtype != torch.float32 or value.device != param.device:
        value = value.to(device=param.device, dtype=torch.float32)
    return value


def step_tensor(value, param: torch.Tensor) -> torch.Tensor:
    """A step count (tensor or number) as the 0-dim fp32 tensor on ``param``'s device that the
    ops take and torch's fused optimizers keep."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32 \
            and value.device == param.device and value.numel() == 1:
        return value
    return torch.tensor(float(value), dtype=torch.float32, device=param.device)


def moment_lists(update: FusedUpdate, params: List[torch.Tensor],
                 state: Dict[torch.Tensor, dict]) -> Tuple[list, list, list]:
    """``(exp_avgs, exp_avg_sqs, steps)`` of Adam and LAMB, initialising missing entries.

    New entries are made one kind at a time (every new ``step``, then every ``exp_avg``, then
    every ``exp_avg_sq``), so that the allocator tends to lay each kind's tensors out one after
    the other, as the step reads them, rather than alternating exp_avg and exp_avg_sq. Each
    tensor keeps its own storage. (O2 AdamW over 4000 tensors of 2500 elements on the 2-core CPU
    host: 6.55-6.67 ms against 6.89-7.14 ms alternated, four alternating pairs.)"""
    new = []
    for p in params:
        s = state_entry(state, p)
        present = [name for name in ("exp_avg", "exp_avg_sq", "step") if name in s]
        if not present:
            new.append((p, s))
        elif len(present) != 3:
            raise ValueError(f"{update.label}: the state of a parameter of shape "
                             f"{tuple(p.shape)} holds {sorted(s)} but needs exp_avg, exp_avg_sq "
                             f"and step; load a state_dict saved by the same kind of optimizer")
        else:
            s["exp_avg"] = fp32_like(s["exp_avg"], p, "exp_avg", update.label)
            s["exp_avg_sq"] = fp32_like(s["exp_avg_sq"], p, "exp_avg_sq", update.label)
            s["step"] = step_tensor(s["step"], p)
    for p, s in new:
        s["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    for name in ("exp_avg", "exp_avg_sq"):
        for p, s in new:
            s[name] = zeros32(p)
    exp_avgs, exp_avg_sqs, steps = [], [], []
    for p in params:
        s = state[p]
        exp_avgs.append(s["exp_avg"])
        exp_avg_sqs.append(s["exp_avg_sq"])
        steps.append(s["step"])
    return exp_avgs, exp_avg_sqs, steps


def group_by_device(params: Sequence[torch.Tensor]) -> Mapping[torch.device, List[int]]:
    """Indices of ``params`` per device, in order of first appearance."""
    out: Dict[torch.device, List[int]] = {}
    for i, p in enumerate(params):
        out.setdefault(p.device, []).append(i)
    return out
