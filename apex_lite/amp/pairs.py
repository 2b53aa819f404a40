"""O2's pairs: each half parameter of the model and its fp32 master, one object per parameter.

At O2 and O5 a parameter that an optimizer steps lives twice: the half tensor the model
computes with, and the fp32 master the optimizer updates. ``ParamPair`` is one such parameter:
both tensors, its name, the model it belongs to. ``Pairs`` is the registry of one run: it makes
the pairs (at ``initialize``, and for a parameter that joins an optimizer later), finds a pair
from either tensor, and counts its changes (``generation``), so that every view derived from it
(the per-device lists of the step, the watches of two_copies.py) is rebuilt from one place and
cannot go stale apart from the others.

What keeps the two copies equal, and which write wins, is two_copies.py's; the pairs only hold.

Note: a pair is also the fp32 values its half parameter carries (``param._apex_lite_fp32``, read
by the model's state_dict and load hooks, model_hooks.py), so the master is found from the
parameter itself, never by module or name: a tied parameter gives its master under every name.
Pickled with the model (``torch.save(model)``, a spawned worker) a pair becomes plain carried
values (``Fp32Values``, not live): the copy trusts them only while they round to its parameter.
``copy.deepcopy`` of a parameter keeps no attributes (torch's ``Parameter.__deepcopy__``), so a
deep copy of the model (an EMA, ``AveragedModel``) carries none.
"""
from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .opt_levels import HALF_DTYPES

# The attribute of a half parameter that holds its fp32 values: its ParamPair, or Fp32Values.
FP32_ATTR = "_apex_lite_fp32"


class Fp32Values:
    """fp32 values a half parameter carries without being a live master: those of a model that
    was pickled with its masters. ``live`` is False (a ``ParamPair`` is the live form)."""

    __slots__ = ("tensor", "live")

    def __init__(self, tensor: torch.Tensor, live: bool = False):
        self.tensor = tensor
        self.live = live

    def __reduce__(self):
        return Fp32Values, (self.tensor.detach(), False)


class ParamPair:
    """One cast parameter and its fp32 master.

    ``model``: the half parameter the model computes with (its ``.grad`` is what the backward
    writes); ``master``: the fp32 tensor the optimizer holds and updates; ``name``: the first name
    of the parameter in ``named_parameters`` order; ``model_index``: which model of the run."""

    __slots__ = ("model", "master", "name", "model_index", "_registry", "__weakref__")
    live = True

    def __init__(self, model: torch.Tensor, master: torch.Tensor, name: str, model_index: int):
        self.model = model
        self.master = master
        self.name = name
        self.model_index = model_index
        self._registry = None

    def copies(self):
        """The run's ``TwoCopies`` (two_copies.py), through which amp writes this pair; None
        once the run is gone."""
        registry = None if self._registry is None else self._registry()
        return None if registry is None else registry.copies

    @property
    def tensor(self) -> torch.Tensor:
        """The fp32 values the half parameter carries (``Fp32Values``'s interface)."""
        return self.master

    def __reduce__(self):
        return Fp32Values, (self.master.detach(), False)

    def __repr__(self) -> str:
        return (f"ParamPair({self.name!r}, {self.model.dtype} {tuple(self.model.shape)} on "
                f"{self.model.device})")


def fp32_truth(param: torch.Tensor) -> torch.Tensor:
    """What a checkpoint holds for ``param``: its live master; else the fp32 values it carries,
    where they round to it; else the parameter itself, upcast when half (exact)."""
    values = getattr(param, FP32_ATTR, None)
    if values is not None:
        fp32 = values.tensor
        if values.live or (fp32.shape == param.shape
                           and torch.equal(fp32.to(param.dtype), param)):
            return fp32.detach()
    return param.detach().float() if param.dtype in HALF_DTYPES else param.detach()


class Pairs:
    """The pairs of one run: made here, found here, counted here."""

    def __init__(self, models: Sequence[torch.nn.Module]):
        self.models = list(models)
        self.all: List[ParamPair] = []
        self._of_model: Dict[torch.Tensor, ParamPair] = {}
        self._of_master: Dict[torch.Tensor, ParamPair] = {}
        # Per model, its pairs in named_parameters order (a parameter shared with a model
        # prepared before is listed under both: the checkpoint layout of amp.state_dict()).
        self.per_model: List[List[ParamPair]] = [[] for _ in self.models]
        # The cast parameters that no optimizer held at initialize, which have no master yet:
        # id -> (model index, qualified name, parameter).
        self.unmastered: Dict[int, Tuple[int, str, torch.Tensor]] = {}
        # Bumped whenever a pair is made: every view built from the pairs compares it.
        self.generation = 0
        # The run's TwoCopies (two_copies.py), set by it.
        self.copies = None

    def __len__(self) -> int:
        return len(self.all)

    def __iter__(self):
        return iter(self.all)

    # ---- making pairs -----------------------------------------------------------------------
    def make(self, index: int, name: str, param: torch.Tensor) -> ParamPair:
        """Model ``index``'s parameter ``name`` becomes a pair, before the cast rounds it: its
        fp32 storage itself becomes the master (``.data``: no autograd history, its own version
        counter) and the cast then gives the parameter new half storage. No copy: O2's setup
        never holds fp32 twice. A parameter already paired (shared with a model prepared before)
        keeps its pair."""
        pair = self._of_model.get(param)
        if pair is None:
            master = param.data
            master.requires_grad_(param.requires_grad)
            pair = self._add(ParamPair(param, master, name, index))
        self.per_model[index].append(pair)
        return pair

    def leave_unmastered(self, index: int, name: str, param: torch.Tensor) -> None:
        """A parameter no optimizer holds at initialize is cast without a master (apex's rule: a
        frozen weight costs its half bytes); it gets one if it joins an optimizer later."""
        self.unmastered.setdefault(id(param), (index, name, param))

    def add(self, param: torch.Tensor) -> ParamPair:
        """The pair of a cast parameter that joins an optimizer after initialize, its master from
        the best value amp has: fp32 values the parameter carries where they round to it (a
        pickled copy's), else the upcast of its half value (exact)."""
        index, name, _ = self.unmastered.pop(id(param))
        with torch.inference_mode(False), torch.no_grad():
            master = fp32_truth(param).clone()
        master.requires_grad_(param.requires_grad)
        pair = self._add(ParamPair(param, master, name, index))
        self.per_model[index].append(pair)
        setattr(param, FP32_ATTR, pair)
        return pair

    def adopt(self, model: torch.Tensor, master: torch.Tensor, name: str) -> ParamPair:
        """A pair of a half parameter and an fp32 master that someone else made (apex's
        FP16_Optimizer makes its masters as copies), which the rule of two_copies.py keeps."""
        return self._add(ParamPair(model, master, name, 0))

    def _add(self, pair: ParamPair) -> ParamPair:
        pair._registry = weakref.ref(self)
        self.all.append(pair)
        self._of_model[pair.model] = pair
        self._of_master[pair.master] = pair
        self.generation += 1
        return pair

    def hang_on_parameters(self, index: int) -> None:
        """Each pair of model ``index`` on its half parameter (after the cast): its fp32 values."""
        for pair in self.per_model[index]:
            setattr(pair.model, FP32_ATTR, pair)

    # ---- finding pairs ----------------------------------------------------------------------
    def of_model(self, param: torch.Tensor) -> Optional[ParamPair]:
        """The pair whose half parameter is ``param``, or None."""
        return self._of_model.get(param)

    def of_master(self, master: torch.Tensor) -> Optional[ParamPair]:
        """The pair whose master is ``master``, or None."""
        return self._of_master.get(master)

    def model_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The model parameter whose ``.grad`` feeds ``tensor`` (an optimizer's parameter): the
        half parameter of a master, else ``tensor`` itself."""
        pair = self._of_master.get(tensor)
        return tensor if pair is None else pair.model

    def is_master(self, tensor: torch.Tensor) -> bool:
        return tensor in self._of_master

    def masters_for(self, params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
        """``params`` with each paired model parameter replaced by its master; a cast parameter
        without one yet (no optimizer held it at initialize) gets it now (``add``)."""
        out = []
        for p in params:
            pair = self._of_model.get(p)
            if pair is None and id(p) in self.unmastered:
                pair = self.add(p)
            out.append(p if pair is None else pair.master)
        return out

    def on_device(self, pairs: Iterable[ParamPair]) -> Dict[torch.device, List[ParamPair]]:
        """``pairs`` grouped by device, in order."""
        out: Dict[torch.device, List[ParamPair]] = {}
        for pair in pairs:
            out.setdefault(pair.model.device, []).append(pair)
        return out
