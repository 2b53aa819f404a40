"""How an optimizer's step is applied under amp: the seam between the unfused and the fused step.

Each amp optimizer has one step path, chosen by ``initialize`` (``choose``):

- ``UnfusedStep``: the end of every ``scale_loss`` unscales the new gradients (under O2 into the
  masters' fp32 gradients), ``step()`` runs the optimizer's own ``step()`` and, under O2, rounds
  the masters into the half model. Any optimizer, any opt level.
- ``FusedStep`` (O2, an optimizer whose update ``apex_lite.optimizers`` computes, with kernels
  that serve its device: the native ones, or torch's own fused kernels for SGD, Adam/AdamW and
  Adagrad where no native ones do (``kernels_for``), or with ``fused_step=True`` the Python
  reference): the end of
  the first ``scale_loss`` of a step only checks the half gradients for inf/NaN (read-only, into
  the overflow flag) and leaves them scaled (CHECKED), and unscales in place those of parameters
  that are their own masters (kept fp32, FSDP2's shards: they hold their true gradient after the
  block, as on the unfused step); ``step()`` is one kernel pass per bucket that
  reads the half gradient, unscales it, updates the fp32 master and the optimizer's state, and
  writes the rounded half parameter, and changes nothing where the step's ``found_inf`` flag is
  set. No fp32 master gradient is held, and with the loss scale on the device (every optimizer of
  the run fused) nothing is read on the host. A second backward before the step,
  ``amp.master_params``, or the first use of a master's lazy ``.grad`` (master_grads.py) makes
  the CHECKED gradients into fp32 master gradients (UNSCALED) and the step reads those, with
  whatever was done to them.

Both paths share ``AmpOptimizer``'s bookkeeping: what accumulates, what ``step()`` refuses, which
optimizer skips. A path decides three things only, each returning the gradients' state it leaves
(``GradState``): what the end of a ``scale_loss`` does with the new gradients
(``end_backward``), how ``step()`` applies them (``apply``), and how the masters get true
gradients on request (``materialize``, ``clip_grad_norm_``). Either runs inside the optimizer's
own ``step`` (``AmpOptimizer._own_step``), so that wrappers and hooks set on it run.

Why only O2: at O1 the fused step would leave the model's ``.grad`` scaled after ``scale_loss``,
where apex and the unfused step leave true gradients that user code clips and reads; at O3 torch
keeps a half parameter's optimizer state in half, the kernels in fp32 (a different optimizer).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..multi_tensor import _torch_fused
from ..multi_tensor._backend import backend
from ..optimizers import fusable
from ..optimizers.fused_lamb import LambUpdate, global_grad_norm
from ..optimizers.update import FusedUpdate, unit_scalars
from ..optimizers.watched_state import watch_state
from . import fsdp_norms
from .grad_lists import flag_nonfinite, fused_scale, present_grads
from .master_grads import GradState, resolve
from .scaler import BackwardScale

CLEAN, SCALED, UNSCALED, CHECKED = (GradState.CLEAN, GradState.SCALED, GradState.UNSCALED,
                                    GradState.CHECKED)


def choose(optimizer: torch.optim.Optimizer, index: int, properties,
           fused_step: Optional[bool]) -> str:
    """Why optimizer ``index`` takes the unfused step, or "" when it takes the fused one;
    raises when ``fused_step=True`` and it cannot."""
    if fused_step is False:
        return "fused_step=False"
    if not properties.keeps_master_weights:
        why = (f"the fused step runs at O2 and O5 (fp32 master weights), not at "
               f"{properties.opt_level}{'' if properties.master_weights else ' without them'}")
    else:
        why = fusable.unfused_reason(optimizer)
    if not why and fused_step is None:
        why = _without_native_kernels(optimizer)
    if why and fused_step:
        raise ValueError(f"fused_step=True, but optimizer {index} ({type(optimizer).__name__}) "
                         f"cannot take the fused step: {why}. Pass fused_step=None to use it "
                         f"where it applies, or fused_step=False for the unfused step.")
    return why


def _without_native_kernels(optimizer: torch.optim.Optimizer) -> str:
    """Why the default (fused_step=None) stays unfused for lack of native kernels, or "".
    Where no native kernels serve a device, torch's own fused kernels carry the step for SGD,
    Adam/AdamW and Adagrad (``kernels_for``). For the other optimizers only the Python backend's
    fused ops are left, the kernels' reference: exact, but many passes (no host read, but
    temporaries for every new value), slower than the optimizer's own step; fused_step=True
    still takes them, for the memory."""
    for device in _devices(optimizer):
        name, reason = backend(device)
        if name != "native":
            torch_why = fusable.torch_kernels_reason(optimizer)
            if not torch_why:
                return ""
            return (f"the native kernels do not serve {device.type} ({reason}), {torch_why}, "
                    f"and the Python reference of the fused step is slower than the optimizer's "
                    f"own; fused_step=True takes it anyway (no fp32 master gradients)")
    return ""


def _devices(optimizer: torch.optim.Optimizer) -> List[torch.device]:
    devices = {p.device for group in optimizer.param_groups for p in group["params"]}
    return sorted(devices, key=str)


def kernels_for(optimizer: torch.optim.Optimizer, device: torch.device):
    """The kernels of the fused step on ``device``: ``(name, ops)``, ``ops`` None for the
    backend serving the device (``ops_for``). The native kernels where they serve it; else
    torch's own fused kernels where they compute the optimizer's update (fp32 gradients
    converted in chunks, multi_tensor/_torch_fused.py); else the Python reference."""
    if backend(device)[0] == "native":
        return "native kernels", None
    if not fusable.torch_kernels_reason(optimizer):
        return (f"torch's fused kernels, half gradients converted to fp32 "
                f"{_torch_fused.chunk_elements(device) >> 18} MiB at a time", _torch_fused)
    return "the Python reference of the kernels", None


class UnfusedStep:
    """Unscale at the end of ``scale_loss``; the optimizer's own ``step()``; O2's copy back."""

    fused = False

    def __init__(self, why: str):
        self.why = why

    def describe(self) -> str:
        return f"unfused step ({self.why})"

    def end_backward(self, amp_opt, stash, scale: BackwardScale, check) -> GradState:
        return amp_opt.unscale(stash, scale, check)

    def apply(self, amp_opt, found_inf: Optional[torch.Tensor], closure=None):
        """The optimizer's own step (which fires torch's step hooks), with ``closure`` when
        ``step(closure)`` was called; found_inf is None: a host decision let it step."""
        result = amp_opt._original_step() if closure is None else amp_opt._original_step(closure)
        amp_opt.copy_masters_to_model()
        return result

    def materialize(self, amp_opt) -> GradState:
        return amp_opt.grad_state   # the masters' gradients are true values already

    def clip_grad_norm_(self, amp_opt, max_norm: float, norm_type: float) -> torch.Tensor:
        return _clip_master_grads(amp_opt, max_norm, norm_type)

    def forget(self) -> None:
        pass

    def invalidate(self) -> None:
        pass

    def zero_grad(self, amp_opt, set_to_none: bool, original) -> None:
        original(set_to_none=set_to_none)


def _clip_master_grads(amp_opt, max_norm: float, norm_type: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over the masters' (true) gradients (over whole tensors when
    FSDP2 shards them)."""
    params = [p for p in amp_opt.masters() if p.grad is not None]
    return fsdp_norms.clip_grad_norm_(params, max_norm, norm_type)


class _Bucket:
    """The parameters of one param group on one device that the kernel takes in one call: all O2
    pairs (half model parameters written), or all parameters that are their own masters; and the
    optimizer's fused update over them (apex_lite.optimizers), built once."""

    def __init__(self, group: dict, device: torch.device, with_half: bool):
        self.group = group
        self.device = device
        self.with_half = with_half
        self.masters: List[torch.Tensor] = []     # what the optimizer updates (fp32)
        self.sources: List[torch.Tensor] = []     # the model parameters whose .grad feeds them
        self.update: Optional[FusedUpdate] = None

    def build(self, update_class, label: str, ops) -> None:
        self.update = update_class(self.masters, grad_sources=self.sources,
                                   model_params=self.sources if self.with_half else None,
                                   label=label, ops=ops)


class FusedStep:
    """A read-only check at the end of ``scale_loss``; one kernel pass per bucket at ``step()``."""

    fused = True

    def __init__(self, optimizer: torch.optim.Optimizer, pairs):
        self.optimizer = optimizer
        self.pairs = pairs
        self.update_class = fusable.update_class(optimizer)
        # amp.clip_grad_norm_ before this step: (coefficient, non-finite norm) device tensors.
        self.clip: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._buckets: Optional[List[_Bucket]] = None
        self._built_for: Tuple[int, int, int] = (0, 0, -1)
        self._scalars: Dict[Tuple[torch.device, str], torch.Tensor] = {}

    def describe(self) -> str:
        """"fused step", and where other kernels than the native ones run it, which."""
        routes = {kernels_for(self.optimizer, device)[0]: device.type
                  for device in _devices(self.optimizer)}
        others = [f"{name} on {device}" for name, device in routes.items()
                  if name != "native kernels"]
        return "fused step" + (f" ({'; '.join(others)})" if others else "")

    # ---- the end of scale_loss ----------------------------------------------------------------
    def end_backward(self, amp_opt, stash, scale: BackwardScale, check) -> GradState:
        """The half gradients are checked where they stand (the step's kernel unscales them);
        those of parameters that are their own masters (kept fp32, FSDP2's shards) are unscaled
        in place, checked on the way: the model's and the optimizer's, they hold their true
        gradient after the block, as on the unfused step. Each O2 master's ``.grad`` becomes its
        lazy gradient (master_grads.py), made when something uses it: CHECKED. A master that
        holds a gradient already has the new one added (all are made then: UNSCALED)."""
        if amp_opt.grad_state not in (CLEAN, SCALED):
            return amp_opt.unscale(stash, scale, check)   # adding to made fp32 gradients
        groups = amp_opt.groups()
        lazy = True
        for device, group in groups.items():
            found_inf = check.found_inf(amp_opt, device)
            # Each list's per-tensor flags are kept, so that the diagnostics name the parameter
            # on this path as on the unfused one.
            for params in (group.half_models, group.own_masters):
                with_grads = [p for p in params if p.grad is not None]
                if with_grads:
                    grads = [p.grad for p in with_grads]
                    check.keep_flags(amp_opt, with_grads, flag_nonfinite(grads, found_inf))
                    if params is group.own_masters:
                        fused_scale(grads, grads, scale.inv, found_inf)
            if group.grads is not None:
                lazy = group.grads.give(scale.inv, check.carried_inf(amp_opt, device)) and lazy
        if not lazy:   # the step reads every master's gradient then
            for group in groups.values():
                if group.grads is not None:
                    group.grads.make(group.grads.factor)
            return UNSCALED
        return CHECKED

    # ---- step() -----------------------------------------------------------------------------
    def apply(self, amp_opt, found_inf: Optional[torch.Tensor]) -> None:
        """The update, one kernel call per bucket. ``found_inf``: the device decision (1: skip),
        or None when the host decided to step. Reads CHECKED gradients (scaled) from the model
        parameters; otherwise what each master holds (UNSCALED: made, true gradients; CLEAN:
        gradients set by hand, or the zeros zero_grad(set_to_none=False) left, which torch's
        optimizers step on too). A master's ``.grad`` that user code replaced since
        ``scale_loss`` (None, another tensor) makes the others real first, and the step applies
        what each master holds, as the unfused step would."""
        groups = amp_opt.groups()
        if amp_opt.grad_state == CHECKED and any(
                group.grads is not None and group.grads.written() for group in groups.values()):
            amp_opt.materialize_master_grads()
        from_masters = amp_opt.grad_state != CHECKED
        inv = amp_opt.held_scale.inv if amp_opt.grad_state == CHECKED else 1.0
        # Kept after the step: the gradients a read after it makes are the ones applied.
        clip = self.clip
        state = watch_state(self.optimizer)   # before the buckets, which key on its identity
        buckets = self.buckets()
        # Per device: the inverse scale of the half gradients (CHECKED: still scaled), that of
        # the parameters that are their own masters (true since the block's end), the flag.
        scalars = {}
        for device in {bucket.device for bucket in buckets}:
            half_inv = self._scalar(device, "inv_scale", inv)
            own_inv = unit_scalars(device)[0]
            flag = self._scalar(device, "found_inf", 0.0) if found_inf is None \
                else found_inf.to(device)
            if clip is not None:   # amp.clip_grad_norm_: folded in on the device
                half_inv = half_inv * clip[0].to(device)
                own_inv = clip[0].to(device)
                flag = torch.maximum(flag, clip[1].to(device))
            scalars[device] = (half_inv, own_inv, flag)
        grads = {id(b): [resolve(p.grad) for p in b.masters] if from_masters
                 else None for b in buckets}
        grad_norms = None
        if self.update_class is LambUpdate:   # one norm of all true gradients, every group
            grad_norms = _lamb_norms(buckets, grads, scalars)
        for bucket in buckets:
            half_inv, own_inv, flag = scalars[bucket.device]
            hyper = fusable.hyper_parameters(self.optimizer, bucket.group)
            extra = () if grad_norms is None else \
                (grad_norms.get(bucket.device, torch.zeros(1, device=bucket.device)),)
            bucket.update(state, half_inv if bucket.with_half else own_inv, flag, hyper, *extra,
                          grads=grads[id(bucket)])
        # The made values of a step whose gradients nothing made go back.
        for group in groups.values():
            if group.grads is not None:
                group.grads.after_step()

    def _scalar(self, device: torch.device, name: str, value) -> torch.Tensor:
        """``value`` as a 1-element fp32 tensor on ``device``: a device tensor as it is, a host
        float in a tensor reused between steps (filled without a sync)."""
        if isinstance(value, torch.Tensor):
            return value.to(device)
        key = (device, name)
        tensor = self._scalars.get(key)
        if tensor is None:
            tensor = self._scalars[key] = torch.empty(1, dtype=torch.float32, device=device)
        return tensor.fill_(value)

    def buckets(self) -> List[_Bucket]:
        """Built once per parameter set: rebuilt when ``param_groups`` or ``state`` is replaced
        (``load_state_dict``) or amp says so (``invalidate``: ``add_param_group``)."""
        signature = (id(self.optimizer.param_groups), id(self.optimizer.state),
                     self.pairs.generation)
        if self._buckets is None or self._built_for != signature:
            buckets: Dict[Tuple[int, torch.device, bool], _Bucket] = {}
            seen = set()
            for index, group in enumerate(self.optimizer.param_groups):
                for master in group["params"]:
                    if id(master) in seen:
                        continue
                    seen.add(id(master))
                    source = self.pairs.model_of(master)
                    key = (index, master.device, source is not master)
                    bucket = buckets.get(key)
                    if bucket is None:
                        bucket = buckets[key] = _Bucket(group, master.device, source is not master)
                    bucket.masters.append(master)
                    bucket.sources.append(source)
            for bucket in buckets.values():
                bucket.build(self.update_class, f"{type(self.optimizer).__name__} under amp",
                             kernels_for(self.optimizer, bucket.device)[1])
            self._buckets = list(buckets.values())
            self._built_for = signature
        return self._buckets

    # ---- true gradients on request -----------------------------------------------------------
    def materialize(self, amp_opt) -> GradState:
        """CHECKED -> UNSCALED: make the lazy gradients (already checked) into the masters' fp32
        gradients (master_grads.py), and unscale an fp32 parameter's in place; a clip
        coefficient of ``clip_grad_norm_`` is applied with it. Before or after the step (the
        gradients a step applied, as the unfused step leaves them). A master whose ``.grad``
        user code replaced keeps what it was given; one whose half gradient was cleared gets
        None. Never makes an inference tensor, also when first used under
        ``torch.inference_mode``."""
        if amp_opt.grad_state != CHECKED:
            return amp_opt.grad_state
        clip, self.clip = self.clip, None
        with torch.no_grad():
            for device, group in amp_opt.groups().items():
                own = present_grads(group.own_masters)
                if own and clip is not None:   # true since the block's end: only the clip
                    fused_scale(own, own, clip[0].to(device), group.scratch_flag())
                if group.grads is not None:
                    group.grads.make(self._factor(group.grads.factor, clip, device))
        return UNSCALED

    @staticmethod
    def _factor(inv, clip, device: torch.device):
        """The lazy gradients' inverse scale, times the clip coefficient of
        ``clip_grad_norm_`` when there is one (a device tensor then)."""
        if clip is None:
            return inv
        return torch.as_tensor(inv, dtype=torch.float32, device=device).reshape(1) \
            * clip[0].to(device)

    def clip_grad_norm_(self, amp_opt, max_norm: float, norm_type: float) -> torch.Tensor:
        """On CHECKED gradients and the 2-norm: one fused norm over the scaled gradients, the
        clip coefficient folded into the step's inverse scale (nothing written, no host read); a
        non-finite norm skips the step. Otherwise the gradients are materialised and clipped as
        torch does."""
        if amp_opt.grad_state != CHECKED or norm_type != 2.0:
            amp_opt.materialize_master_grads()
            return _clip_master_grads(amp_opt, max_norm, norm_type)
        # The half gradients still scaled (times inv), those of the parameters that are their
        # own masters true already.
        half_squares, own_squares = [], []
        anchor: Optional[torch.device] = None
        for device, group in amp_opt.groups().items():
            for grads, squares in ((present_grads(group.half_models), half_squares),
                                   (present_grads(group.own_masters), own_squares)):
                if grads:
                    anchor = device if anchor is None else anchor
                    squares.append(fsdp_norms.squared_norm(grads).to(anchor))
        if anchor is None:
            return torch.zeros((), dtype=torch.float32)
        inv = amp_opt.held_scale.inv
        norm = None
        if half_squares:
            norm = torch.cat(half_squares).sum().sqrt() * (
                inv.to(anchor).reshape(()) if isinstance(inv, torch.Tensor) else inv)
        if own_squares:
            own = torch.cat(own_squares).sum()
            norm = own.sqrt() if norm is None else (norm.square() + own).sqrt()
        if self.clip is not None:   # a second clip before the step sees the first one's result
            norm = norm * self.clip[0].to(anchor).reshape(())
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).reshape(1)
        nonfinite = torch.isfinite(norm).logical_not().to(torch.float32).reshape(1)
        if self.clip is not None:
            coef = coef * self.clip[0].to(anchor)
            nonfinite = torch.maximum(nonfinite, self.clip[1].to(anchor))
        self.clip = (coef, nonfinite)
        return norm

    def forget(self) -> None:
        self.clip = None

    def invalidate(self) -> None:
        self._buckets = None

    def zero_grad(self, amp_opt, set_to_none: bool, original) -> None:
        """``optimizer.zero_grad``: torch's own over the masters, but a lazy gradient is never
        made only to be zeroed (master_grads.py): with ``set_to_none`` the lazy gradients come
        off the masters first (those user code holds are made and let go), without it they stay
        and read as zeros, as torch's zeroed gradients do, without fp32 zeros held."""
        rooms = [group.grads for group in amp_opt.groups().values() if group.grads is not None]
        if set_to_none:
            for room in rooms:
                room.take_back()
                room.release(self._factor(room.factor, self.clip, room.device))
            original(set_to_none=True)
            return
        for room in rooms:
            room.take_back()
        original(set_to_none=False)
        for room in rooms:
            room.put_back_zeroed()


def _lamb_norms(buckets: List[_Bucket], grads: Dict[int, Optional[list]],
                scalars: Dict[torch.device, tuple]) -> Dict[torch.device, torch.Tensor]:
    """LAMB's one norm of all true gradients, on each device that has any: the half gradients
    times their inverse scale, the own masters' times theirs, combined without a host read."""
    parts = []
    for with_half, index in ((True, 0), (False, 1)):
        part = global_grad_norm(
            ((b.device, grads[id(b)] or b.update.read_grads()) for b in buckets
             if b.with_half == with_half),
            lambda device, index=index: (scalars[device][index], scalars[device][2]))
        if part:
            parts.append(part)
    if len(parts) <= 1:
        return parts[0] if parts else {}
    devices = list(dict.fromkeys(d for part in parts for d in part))
    first = devices[0]
    combined = torch.cat([next(iter(part.values())).to(first) for part in parts]).square()
    combined = combined.sum().sqrt().reshape(1)
    return {device: combined.to(device) for device in devices}
