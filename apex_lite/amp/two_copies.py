"""O2's one rule for the two copies of a parameter: no write to either is ever silently undone.

At O2 and O5 each parameter an optimizer steps lives twice (pairs.py): the half tensor the model
computes with and the fp32 master the optimizer updates. amp makes them equal (it rounds the
master into the half parameter after every step), and code other than amp may write either
between amp's writes:

- the masters: sharpness-aware minimisation perturbs and restores them, Lookahead syncs them with
  its slow weights, local SGD averages them across ranks, an optimizer or a hand update steps
  them directly, ``p.data = t`` replaces them;
- the model: DDP's constructor broadcast, a re-initialisation, a ``copy_`` of pretrained or
  averaged weights, a module writing its own weight in its forward (``nn.Embedding(max_norm)``
  renormalises the rows it looks up), ``p.data = t``.

The rule: a write to a master reaches the model (the half parameter becomes its rounding) before
the model's next forward and before any ``state_dict()``; a write to the model reaches the master;
a parameter whose two copies were both written since amp last made them equal is refused with an
error that names it, never settled by picking one.

How a write to the model reaches the master. A write made outside a forward (a user's copy, an
average, a broadcast) is taken whole: the master becomes the upcast of the written half value,
also where it equals the old master's rounding, as fp32 training would take the written tensor
whole. So ranks whose half models a write made equal have bitwise-equal masters too. A write made
in the model's forward (``Embedding(max_norm)``'s renormalisation of some rows) is taken where it
changed the half value; elsewhere the master keeps its fp32 bits, or every forward would round
the whole table's masters to half and undo O2 for it. Which one a write was: the writes found
after a forward of one of the run's models started (the model's forward pre-hook; a model called
in pieces, ``model.encoder(x)``, does not run it) and before the next check are the forward's.

How amp sees a write: the version counters (bumped by every in-place op on a tensor: autograd's
own record of writes) and data pointers (``p.data = t`` gives a tensor other memory without
bumping its counter) of both copies, compared with those recorded after amp's own last write:
host integers, no device sync, one C++ loop per device on the native backend. Every write amp
makes to either copy goes through this module (or the step's kernels, after which the step
records) and ends in ``record``. The check runs at fixed points (``sync``): the model's forward
pre-hook, the end of every ``scale_loss``, every ``step()`` before the update,
``amp.master_params`` and every ``state_dict()`` of the model or of amp. A write that bypasses
the counters (an in-place op through ``p.data``, or ``dist.broadcast`` into a tensor) is seen by
comparing the values: at the first forward and the first step (a hand sync-init with
``dist.broadcast``), and at every ``state_dict()``, so a checkpoint holds it; write under
``torch.no_grad()`` (``p.copy_(w)``) for training to go on from it.

A master follows its parameter's ``requires_grad`` both ways (a layer unfrozen or frozen), so that
whoever reads the optimizer's ``param_groups`` (mmengine's clipping keeps ``p.requires_grad and
p.grad is not None``) sees what fp32 training shows.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..multi_tensor._backend import ops_for
from .grad_lists import fused_scale
from .pairs import ParamPair, Pairs

# What to do when both copies of a parameter were written (the refusal's fix).
BOTH_WRITTEN_FIX = (
    "Write one copy between steps: the model's parameter (model.parameters(), at its half "
    "precision) or the fp32 master (amp.master_params(optimizer), what the optimizer steps), "
    "and amp carries the write to the other. To set both now, load the values you want with "
    "model.load_state_dict(...), which sets both copies.")


class TwoCopies:
    """The watch over one run's pairs (``run.copies``) and every write amp makes to them."""

    def __init__(self, pairs: Pairs):
        self.pairs = pairs
        pairs.copies = self
        self._built = -1
        # Per device: (watch over [half parameters..., masters...], [pairs]).
        self._watches: List[Tuple[object, List[ParamPair]]] = []
        # A forward of one of the run's models started since the last check.
        self.forward_since_check = False
        # The values were compared at the first forward and at the first step (writes no
        # counter shows: a hand sync-init with dist.broadcast, before or after a first forward).
        self.compared = set()
        # Kernels that write both copies in one pass (the fused step) say so; amp records then.
        self._scratch: Dict[torch.device, torch.Tensor] = {}

    def _current(self) -> List[Tuple[object, List[ParamPair]]]:
        if self._built != self.pairs.generation:   # pairs made since (add_param_group)
            self._watches = []
            for device, pairs in self.pairs.on_device(self.pairs).items():
                watch = ops_for(device).watch_tensors([p.model for p in pairs]
                                                      + [p.master for p in pairs])
                watch.record()
                self._watches.append((watch, pairs))
            self._built = self.pairs.generation
        return self._watches

    # ---- the check ----------------------------------------------------------------------------
    def record(self) -> None:
        """Both copies as they are now are amp's own (after amp wrote them)."""
        for watch, _ in self._current():
            watch.record()

    def forward_started(self, before_broadcast: bool = False) -> None:
        """The forward pre-hook of a model of the run: writes since the last check reach the
        other copy (the values are compared once, at the first forward); the writes found at
        the next check are the forward's own. ``before_broadcast``: the forward is the first
        inside a DDP, whose constructor wrote rank 0's half values into every rank's model and
        whose masters amp broadcasts next (ddp.py): those writes are taken where they changed
        a value, so that rank 0 keeps its fp32 bits for the broadcast."""
        self.sync("forward", compare_all=self.first("forward"), partial=before_broadcast)
        self.forward_since_check = True

    def first(self, point: str) -> bool:
        """Whether this is the first check at ``point`` ("forward", "step"), where the values
        are compared once."""
        if point in self.compared:
            return False
        self.compared.add(point)
        return True

    def sync(self, caller: str, compare_all: bool = False, partial: bool = False) -> None:
        """Carry every write made since the last record to the other copy, and every change of
        ``requires_grad`` to the master; then record. Raises, before anything changes, when both
        copies of a parameter were written. ``compare_all``: also compare every half parameter
        with its master's rounding, for writes that no counter shows (through ``p.data``, or a
        ``dist.broadcast``): one pass over the model. ``partial``: take writes to the model only
        where they changed a value, as a forward's own (before a master broadcast)."""
        in_forward = self.forward_since_check or partial
        self.forward_since_check = False
        plans = []
        for watch, pairs in self._current():
            written, flipped = watch.changed()
            n = len(pairs)
            if not written and not flipped and not compare_all:
                continue
            # Indices below n are half parameters, from n on their masters.
            model_written = {i for i in written if i < n}
            to_model = []
            for i in written:
                if i >= n:
                    if i - n in model_written:
                        _refuse_both(caller, pairs[i - n])
                    to_model.append(pairs[i - n])
            to_master = [pairs[i] for i in sorted(model_written)]
            for pair in to_model + to_master:
                _check_shapes(caller, pair)
            plans.append((watch, pairs, to_model, to_master,
                          [pairs[i] for i in flipped if i < n]))
        for watch, pairs, to_model, to_master, flipped in plans:
            for pair in flipped:
                if pair.master.requires_grad != pair.model.requires_grad:
                    pair.master.requires_grad_(pair.model.requires_grad)
            with torch.inference_mode(False), torch.no_grad():
                if to_model:
                    self._round_into_model(to_model)
                if to_master:
                    _take_model_writes(to_master, whole=not in_forward)
                if compare_all:
                    seen = {id(p) for p in to_model + to_master}
                    _take_model_writes([p for p in pairs if id(p) not in seen],
                                       whole=not in_forward, where_differs=True)
            watch.record()

    # ---- amp's writes -----------------------------------------------------------------------
    def round_into_model(self, pairs: Optional[Sequence[ParamPair]] = None) -> None:
        """The masters of ``pairs`` (default: all) rounded into their half parameters, one fused
        call per device; then recorded."""
        with torch.inference_mode(False), torch.no_grad():
            self._round_into_model(self.pairs.all if pairs is None else pairs)
        self.record()

    def _round_into_model(self, pairs: Sequence[ParamPair]) -> None:
        for device, on_device in self.pairs.on_device(pairs).items():
            flag = self._scratch.get(device)
            if flag is None:
                flag = self._scratch[device] = torch.zeros(1, dtype=torch.float32,
                                                           device=device)
            fused_scale([p.master for p in on_device], [p.model for p in on_device], 1.0, flag)

    def load(self, values: Sequence[Tuple[ParamPair, torch.Tensor]]) -> None:
        """Each pair's master set to its fp32 value exactly, and the half parameter to its
        rounding (a checkpoint's masters, a broadcast's); then recorded."""
        with torch.inference_mode(False), torch.no_grad():
            for pair, value in values:
                pair.master.copy_(value)
                pair.model.copy_(pair.master)
        self.record()


def _refuse_both(caller: str, pair: ParamPair) -> None:
    raise RuntimeError(
        f"{caller}: both copies of parameter {pair.name!r} were written since amp last made "
        f"them equal: its half parameter in the model and its fp32 master weight in the "
        f"optimizer. amp cannot tell which write to keep, and keeping either would silently "
        f"undo the other; nothing was changed. {BOTH_WRITTEN_FIX}")


def _check_shapes(caller: str, pair: ParamPair) -> None:
    if pair.model.shape != pair.master.shape:
        raise RuntimeError(
            f"{caller}: parameter {pair.name!r} was given another shape since amp.initialize "
            f"(the model's half parameter is {tuple(pair.model.shape)}, its fp32 master "
            f"{tuple(pair.master.shape)}): a `.data = tensor` of another shape. The optimizer "
            f"and its state keep the old one. Build the model at its final shape before "
            f"amp.initialize.")


def _take_model_writes(pairs: Sequence[ParamPair], whole: bool,
                       where_differs: bool = False) -> None:
    """For each pair, the half value written into the master. ``whole``: the master becomes the
    upcast of the half parameter (with ``where_differs``, only for a pair whose half value
    differs somewhere from the master's rounding: a write no counter showed); else only where
    the half value differs from the master's rounding, the fp32 bits kept elsewhere. One
    comparison per parameter, on the device; no host read."""
    for pair in pairs:
        param, master = pair.model, pair.master
        if whole and not where_differs:
            master.copy_(param)
            continue
        rounded = master.to(param.dtype)
        # NaN where NaN was is no write (NaN != NaN).
        written = torch.ne(param, rounded) & ~(torch.isnan(param) & torch.isnan(rounded))
        if whole:
            written = written.any()
        master.copy_(torch.where(written, param.to(master.dtype), master))
