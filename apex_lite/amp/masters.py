"""O2's master weights and their gradients: made at ``initialize``, unscaled into, accumulated,
copied back to the half model.

Under O2 the fp32 storage of each cast parameter becomes its master (``make_masters``), and the
optimizer's ``param_groups`` hold the masters. ``MasterWeights`` is one amp optimizer's view of
them, per device (``_DeviceGroup``): which model parameter's ``.grad`` feeds which master, the
unscale of a backward's gradients into true fp32 gradients (adding to earlier backwards'), the
copy of the updated masters into the half model, and clearing their gradients. When each of
these happens (the gradients' state machine and its refusals) is ``AmpOptimizer``'s business
(optimizer.py); O0, O1 and O3 parameters are their own masters and go through the same code.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from ..multi_tensor import _python
from ..multi_tensor._backend import ops_for
from ..optimizers.update import local_shards
from . import fsdp, master_grads

Scale = Union[float, torch.Tensor]

# What to do about a model moved after ``initialize`` (the optimizer and the masters still hold
# the tensors of the old place).
MOVED_FIX = ("Move the model before initializing (model.to(device); then model, optimizer = "
             "amp.initialize(model, optimizer, ...)), or build a fresh model and optimizer on "
             "the new device, load their state_dicts and call amp.initialize again.")


def make_masters(run, index: int, model: torch.nn.Module, kept_params: set,
                 held: Optional[set]) -> None:
    """O2, before the cast rounds them: the fp32 values of model ``index``'s floating-point
    parameters that an optimizer holds (ids in ``held``; every one when ``held`` is None), but
    those of ``kept_params`` (kept fp32), become their masters, in ``run``'s ``master_of`` /
    ``model_of`` / ``master_pairs``. The others are cast without one (apex's rule: a frozen
    weight that no optimizer steps costs its half bytes); ``run.unmastered`` remembers them, so
    that one that joins an optimizer later (``add_param_group``) gets its master then."""
    for name, p in model.named_parameters():
        # FSDP2's sharded fp32 parameters are their own masters (fsdp.py).
        if p.is_floating_point() and id(p) not in kept_params and not fsdp.is_sharded(p):
            # A parameter shared with a model prepared before keeps its master.
            master = run.master_of.get(p)
            if master is None and held is not None and id(p) not in held:
                run.unmastered.setdefault(id(p), (index, name, p))
                continue
            if master is None:
                # The fp32 storage itself becomes the master (``.data``: no autograd history,
                # its own version counter); the cast gives the parameter new half storage. No
                # copy: O2's setup never holds fp32 twice.
                master = p.data
                master.requires_grad_(p.requires_grad)
                run.master_of[p] = master
                run.model_of[master] = p
            run.master_pairs[index].append((name, p, master))


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
        # The fused step's gradients of half_masters (master_grads.py), made on first use.
        self.pending: Optional[List[torch.Tensor]] = None     # PendingGrad per O2 master
        self.zeros: Optional[List[torch.Tensor]] = None       # zero PendingGrad per O2 master
        self.pending_watch = None    # ops.pending_grads(half_models, half_masters, pending)
        self.made: List[torch.Tensor] = []   # the PendingGrads made into real gradients

    def master_grad_buffers(self) -> List[torch.Tensor]:
        """Views of one fp32 buffer, one per O2 master: what a master's ``.grad`` is set to when
        ``zero_grad`` left it None, so the unscale does not allocate 2 x params tensors a step.
        (The memory is the same: the master gradients exist during every step anyway.) Never
        an inference tensor, wherever the first use happens."""
        if self._master_grad_buffers is None:
            with torch.inference_mode(False):
                flat = torch.empty(sum(m.numel() for m in self.half_masters),
                                   dtype=torch.float32, device=self.device)
            views, offset = [], 0
            for master in self.half_masters:
                views.append(flat[offset:offset + master.numel()].view_as(master))
                offset += master.numel()
            self._master_grad_buffers = views
        return self._master_grad_buffers

    def release_master_grad_buffers(self) -> None:
        """Drop the buffer (the fused step, after a step whose gradients nothing used: its
        memory goes back once no master's ``.grad`` is a view of it)."""
        self._master_grad_buffers = None

    def scratch_flag(self) -> torch.Tensor:
        """A flag for the master-to-model copy, whose inputs are finite by construction."""
        if self._scratch_flag is None:
            with torch.inference_mode(False):
                self._scratch_flag = torch.zeros(1, dtype=torch.float32, device=self.device)
        return self._scratch_flag


class MasterWeights:
    """One amp optimizer's parameters, grouped per device (cached; ``invalidate`` after
    ``add_param_group``), and what amp does to their gradients and values."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 model_of: Dict[torch.Tensor, torch.Tensor]):
        self.optimizer = optimizer
        # master -> the model parameter whose .grad feeds it (itself when not cast).
        self.model_of = model_of
        self._groups: Optional[Dict[torch.device, _DeviceGroup]] = None

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

    def invalidate(self) -> None:
        self._groups = None

    def masters(self) -> List[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def check_devices(self, caller: str, name_of: Callable[[torch.Tensor], str]) -> None:
        """Raise when the model was moved after ``initialize``: the first and last parameter of
        each device group must still be where they were (a cheap check; ``model.to(device)``
        moves them all, and a partial move is caught by ``raise_moved`` when the kernels
        refuse)."""
        for device, group in self.groups().items():
            for tensors in (group.model_params, group.masters):
                if tensors[0].device != device or tensors[-1].device != device:
                    self.raise_moved(caller, name_of)

    def raise_moved(self, caller: str, name_of: Callable[[torch.Tensor], str]) -> None:
        """Raise the explanation when a parameter is no longer on the device it had at
        ``initialize``; return when none moved."""
        for device, group in self.groups().items():
            for model_param, master in zip(group.model_params, group.masters):
                for tensor, what in ((model_param, "model parameter"), (master, "master weight")):
                    if tensor.device != device:
                        raise RuntimeError(
                            f"{caller}: {what} {name_of(model_param)!r} is on {tensor.device} "
                            f"but was on {device} when amp.initialize ran: the model was moved "
                            f"after amp.initialize. {MOVED_FIX}")

    # ---- the gradients of a backward --------------------------------------------------------
    def stash_grads(self) -> Dict[int, torch.Tensor]:
        """Move the unscaled gradients of earlier backwards aside so that the next backward
        writes fresh ones: an fp32 gradient's true values (added back by the unscale), and an O2
        model's half gradient (its values already live in the master gradient; it is put back
        when the backward leaves the parameter without a gradient). An O2 master whose model
        gradient was cleared since starts afresh. Keys: ``id`` of the model parameter."""
        stash: Dict[int, torch.Tensor] = {}
        for group in self.groups().values():
            for model_param, master in zip(group.model_params, group.masters):
                grad = model_param.grad
                if grad is not None:
                    stash[id(model_param)] = grad
                    model_param.grad = None
                elif model_param is not master:
                    master.grad = None
        return stash

    def restore(self, stash: Dict[int, torch.Tensor]) -> None:
        """Give stashed gradients back to their model parameters."""
        for group in self.groups().values():
            for model_param in group.model_params:
                old = stash.get(id(model_param))
                if old is not None:
                    model_param.grad = old

    def unscale(self, stash: Dict[int, torch.Tensor], inv_scale: Scale, accumulate: bool,
                history_clean: bool, found_inf: Callable[[torch.device], torch.Tensor],
                carried_inf: Callable[[torch.device], torch.Tensor]) -> None:
        """Unscale a backward's gradients into true values (under O2 into the masters' fp32
        gradients), adding what ``stash`` and, when ``accumulate``, earlier backwards hold,
        flagging inf/NaN in ``found_inf(device)``. Unless ``history_clean``, what is added to is
        checked apart: the new gradients flag ``found_inf``, the sum ``carried_inf``."""
        for device, group in self.groups().items():
            flag = found_inf(device)
            if not accumulate and self._unscale_fresh(group, inv_scale, flag):
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
                fused_scale(fresh_in, fresh_out, inv_scale, flag)
            if acc_new:
                if history_clean:
                    fused_accumulate(acc_new, acc_into, inv_scale, flag)
                else:
                    flag_nonfinite(acc_new, flag)
                    fused_accumulate(acc_new, acc_into, inv_scale, carried_inf(device))
            for master, grad in restore:
                master.grad = grad

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

    # ---- after step() and at zero_grad --------------------------------------------------------
    def copy_to_model(self) -> None:
        """O2: round the updated fp32 masters into the half model, one fused call per device."""
        with torch.no_grad():
            for group in self.groups().values():
                if group.half_masters:
                    fused_scale(group.half_masters, group.half_models, 1.0, group.scratch_flag())

    def clear_model_grads(self, set_to_none: bool) -> None:
        """The half model's gradients, which the optimizer's own ``zero_grad`` does not see."""
        for group in self.groups().values():
            for model_param in group.half_models:
                if model_param.grad is not None:
                    if set_to_none:
                        model_param.grad = None
                    else:
                        model_param.grad.zero_()

    def coverage(self, model_param_ids) -> Tuple[int, int]:
        """(how many of this optimizer's model parameters are in ``model_param_ids``, all)."""
        covered = total = 0
        for group in self.groups().values():
            total += len(group.model_params)
            covered += sum(id(p) in model_param_ids for p in group.model_params)
        return covered, total

    def clear_master_grads(self, model_param_ids, set_to_none: bool) -> None:
        """The O2 master gradients fed by the model parameters ``model_param_ids``. A fused
        step's pending gradient is replaced, never made only to be zeroed (master_grads.py)."""
        for group in self.groups().values():
            for i, (model_param, master) in enumerate(zip(group.half_models,
                                                          group.half_masters)):
                if id(model_param) in model_param_ids and master.grad is not None:
                    if set_to_none:
                        master.grad = None
                    elif type(master.grad) is master_grads.PendingGrad:
                        master_grads.zero(group, [i])
                    else:
                        master.grad.zero_()

    def all_grads_cleared(self, in_model: bool) -> bool:
        """Whether every gradient is gone: the model's (``in_model``) or the masters'."""
        return all(p.grad is None for group in self.groups().values()
                   for p in (group.model_params if in_model else group.masters))
