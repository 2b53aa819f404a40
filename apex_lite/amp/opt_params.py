"""One amp optimizer's parameters, per device: which model parameter's ``.grad`` feeds which
parameter the optimizer steps, and what a backward's gradients become.

The optimizer's ``param_groups`` hold the tensors it steps: under O2 each cast parameter's fp32
master (pairs.py), else the model parameter itself (O0, O1, O3, modules kept fp32, FSDP2's
sharded parameters: their own masters). ``OptimizerParams`` groups them per device
(``_DeviceGroup``), derived from ``param_groups`` and the run's pairs and rebuilt when either
changes (``invalidate``), and unscales a backward's gradients into true values (adding to those
of earlier backwards, as torch adds a backward to a gradient that is there), the O2 masters'
through their ``MasterGrads`` (master_grads.py). When each of these happens (the gradients' state
and its refusals) is ``AmpOptimizer``'s business (optimizer.py).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from .grad_lists import Scale, flag_nonfinite, fused_accumulate, fused_scale, present_grads
from .master_grads import MasterGrads, resolve

# What to do about a model moved after ``initialize`` (the optimizer and the masters still hold
# the tensors of the old place).
MOVED_FIX = ("Move the model before initializing (model.to(device); then model, optimizer = "
             "amp.initialize(model, optimizer, ...)), or build a fresh model and optimizer on "
             "the new device, load their state_dicts and call amp.initialize again.")


class _DeviceGroup:
    """The parameters of one optimizer on one device: ``model_params[i]`` receives the backward,
    ``masters[i]`` is what the optimizer updates (the same tensor unless O2 cast it to half)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.model_params: List[torch.Tensor] = []
        self.masters: List[torch.Tensor] = []
        self.own_masters: List[torch.Tensor] = []   # masters that are their model parameter
        # Per entry of ``masters``: its index in ``half_masters``, or -1 for its own master.
        self.pair_index: List[int] = []
        self.pairs: List = []                       # the O2 pairs (pairs.py)
        self.half_models: List[torch.Tensor] = []   # their half parameters and masters
        self.half_masters: List[torch.Tensor] = []
        self.grads: Optional[MasterGrads] = None    # the O2 masters' gradients
        self._scratch_flag: Optional[torch.Tensor] = None

    def scratch_flag(self) -> torch.Tensor:
        """A flag for kernel calls whose inputs were checked already."""
        if self._scratch_flag is None:
            with torch.inference_mode(False):
                self._scratch_flag = torch.zeros(1, dtype=torch.float32, device=self.device)
        return self._scratch_flag


class OptimizerParams:
    """One amp optimizer's parameters, grouped per device (cached; ``invalidate`` after
    ``add_param_group``), and the unscale of a backward's gradients. ``make_all``: how a lazy
    gradient of the fused step asks the optimizer to make its gradients (master_grads.py)."""

    def __init__(self, optimizer: torch.optim.Optimizer, pairs, make_all: Callable[[], None]):
        self.optimizer = optimizer
        # The run's pairs (pairs.py): a master's model parameter, whose .grad feeds it.
        self.pairs = pairs
        self.make_all = make_all
        self._groups: Optional[Dict[torch.device, _DeviceGroup]] = None
        self._generation = -1

    def groups(self) -> Dict[torch.device, _DeviceGroup]:
        if self._groups is None or self._generation != self.pairs.generation:
            groups: Dict[torch.device, _DeviceGroup] = {}
            seen = set()
            for group in self.optimizer.param_groups:
                for master in group["params"]:
                    if id(master) in seen:
                        continue
                    seen.add(id(master))
                    pair = self.pairs.of_master(master)
                    model_param = master if pair is None else pair.model
                    g = groups.get(master.device)
                    if g is None:
                        g = groups[master.device] = _DeviceGroup(master.device)
                    g.model_params.append(model_param)
                    g.masters.append(master)
                    if model_param is master:
                        g.own_masters.append(master)
                        g.pair_index.append(-1)
                    else:
                        g.pair_index.append(len(g.pairs))
                        g.pairs.append(pair)
                        g.half_models.append(model_param)
                        g.half_masters.append(master)
            for g in groups.values():
                if g.pairs:
                    g.grads = MasterGrads(g.device, g.pairs, self.make_all)
            self._groups = groups
            self._generation = self.pairs.generation
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

    def unscale(self, stash: Dict[int, torch.Tensor], inv_scale: Scale,
                history_clean: bool, found_inf: Callable[[torch.device], torch.Tensor],
                carried_inf: Callable[[torch.device], torch.Tensor]) -> None:
        """Unscale a backward's gradients into true values, flagging inf/NaN in
        ``found_inf(device)``: an fp32 parameter's in place, adding what ``stash`` held; an O2
        master's into its fp32 gradient, a new one where it has none, else added to it, as torch
        adds a backward to a gradient that is there. Unless ``history_clean``, what is added to
        is checked apart: the new gradients flag ``found_inf``, the sum ``carried_inf``."""
        for device, group in self.groups().items():
            flag = found_inf(device)
            if not stash and self._unscale_fresh(group, inv_scale, flag):
                continue
            fresh_in: List[torch.Tensor] = []
            fresh_out: List[torch.Tensor] = []
            acc_new: List[torch.Tensor] = []
            acc_into: List[torch.Tensor] = []
            restore: List[Tuple[torch.Tensor, torch.Tensor]] = []
            new: List[int] = []      # O2 masters without a gradient: indices into half_masters
            for model_param, master, pair_index in zip(group.model_params, group.masters,
                                                       group.pair_index):
                grad = model_param.grad
                old = stash.get(id(model_param))
                if grad is None:
                    if old is not None:
                        model_param.grad = old   # this backward did not reach it
                elif pair_index < 0:             # its own master
                    if old is None:
                        fresh_in.append(grad)
                        fresh_out.append(grad)
                    else:
                        acc_new.append(grad)
                        acc_into.append(old)
                        restore.append((master, old))
                elif master.grad is not None:
                    acc_new.append(grad)
                    acc_into.append(resolve(master.grad))
                else:
                    new.append(pair_index)
            if new:
                grads = group.grads.fresh_grads(new)
                for i, grad in zip(new, grads):
                    group.half_masters[i].grad = grad
                fresh_in.extend(group.half_models[i].grad for i in new)
                fresh_out.extend(grads)
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
        stand, O2 half gradients into new fp32 gradients of the masters; one fused call. False
        when some O2 parameter got no gradient or its master has one (the general path)."""
        half_grads = [p.grad for p in group.half_models]
        if any(g is None for g in half_grads) or \
                any(m.grad is not None for m in group.half_masters):
            return False
        grads = present_grads(group.own_masters)
        if not half_grads:
            if grads:
                fused_scale(grads, grads, inv_scale, found_inf)
            return True
        # One call: the fp32 gradients in place (same tensor in and out), the half ones into
        # the masters' new gradients.
        new = group.grads.fresh_grads(list(range(len(group.half_masters))))
        for master, grad in zip(group.half_masters, new):
            master.grad = grad
        fused_scale(grads + half_grads, list(grads) + new, inv_scale, found_inf)
        return True

    # ---- after step() and at zero_grad --------------------------------------------------------
    def pairs_of(self) -> List:
        """This optimizer's O2 pairs (pairs.py)."""
        return [pair for group in self.groups().values() for pair in group.pairs]

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
        """The O2 master gradients fed by the model parameters ``model_param_ids`` (one model's
        ``zero_grad()`` where the optimizer spans several): set to None, or zeroed in place."""
        for group in self.groups().values():
            for model_param, master in zip(group.half_models, group.half_masters):
                if id(model_param) in model_param_ids and master.grad is not None:
                    if set_to_none:
                        master.grad = None
                    else:
                        with torch.no_grad():
                            resolve(master.grad).zero_()

    def all_grads_cleared(self, in_model: bool) -> bool:
        """Whether every gradient is gone: the model's (``in_model``) or the masters'."""
        return all(p.grad is None for group in self.groups().values()
                   for p in (group.model_params if in_model else group.masters))
