"""The amp state that checkpoints carry, and the checks that refuse one that does not fit.

``amp.state_dict()`` writes apex's ``{"loss_scaler<i>": {"loss_scale", "unskipped"}}`` and,
under the versioned key ``STATE_KEY``, the scalers' counters and O2's master weights (what a
bitwise resume needs). Each amp optimizer's own ``state_dict()`` carries the scalers' part under
``AMP_STATE_KEY`` (``OptimizerAmpState``), so that a framework that saves only the model and the
optimizer resumes the loss scale and its counters; a plain torch optimizer's ``load_state_dict``
ignores that key. Either is checked whole before anything is loaded (``check_state``).

A state saved at another opt level is a legitimate resume: what carries over loads
(``Accepted``). ``amp.load_state_dict`` says at INFO what it left out; an optimizer's
``load_state_dict`` always loads torch's part and leaves out what of the amp part does not fit,
with one WARNING.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import List, Optional

import torch

from .fp8 import saved as fp8_saved
from .opt_levels import OPT_LEVELS, Properties
from .overflow import is_logging_rank

logger = logging.getLogger("apex_lite.amp")

STATE_KEY = "apex_lite"
STATE_VERSION = 1

# The key of the amp state in an amp optimizer's state_dict() (beside torch's "state" and
# "param_groups"; torch's load_state_dict reads only those two).
AMP_STATE_KEY = "apex_lite_amp"


def amp_state_dict(run) -> dict:
    """What ``amp.state_dict()`` returns for ``run``: ``scaler_state`` and the O2 masters (with
    the writes to the half model that amp did not make taken in first)."""
    run.copies.sync("amp.state_dict()", compare_all=True)
    state = scaler_state(run)
    state[STATE_KEY]["master_weights"] = [[pair.master.detach().clone() for pair in pairs]
                                          for pairs in run.pairs.per_model]
    fp8_saved.add_to(run, state[STATE_KEY])   # "fp8", only in a run with fp8=
    return state


def scaler_state(run) -> dict:
    """The loss scalers' state: apex's ``{"loss_scaler<i>": {"loss_scale", "unskipped"}}``
    and, under the versioned key "apex_lite", their counters (reads a device scale: a
    sync). ``amp.state_dict()`` adds the O2 master weights; an optimizer's ``state_dict()``
    carries this alone (the model's ``state_dict()`` holds the masters)."""
    state = OrderedDict()
    for scaler in run.scalers:
        state[f"loss_scaler{scaler.loss_id}"] = scaler.apex_state()
    state[STATE_KEY] = {"version": STATE_VERSION, "opt_level": run.properties.opt_level,
                        "loss_scalers": [scaler.extra_state() for scaler in run.scalers]}
    return state


class Accepted:
    """What of a checked amp state loads into a run. At the run's own opt level (or from apex,
    which records none): all of it. At another level: the loss scale and its counters only
    between levels whose scaling is dynamic (O1 and O2; the saved level's default tells the
    saved side, the run's own scaling this side); a static scale (O0, O3, O4, O5) stays the
    run's own; the master weights of O2 or O5 are needed by no other level (the model's
    ``state_dict()`` holds the fp32 weights at every level) and are left out."""

    def __init__(self, properties: Properties, saved_level: Optional[str], holds_masters: bool):
        self.level = properties.opt_level
        self.saved_level = saved_level
        self.other_level = saved_level is not None and saved_level != self.level
        saved_dynamic = saved_level is not None and OPT_LEVELS[saved_level].loss_scale == "dynamic"
        self.scalers = not self.other_level or (properties.dynamic and saved_dynamic)
        self.masters = not self.other_level
        self.left_out: List[str] = []
        if not self.scalers:
            why = (f"this run keeps its static loss scale {properties.loss_scale}"
                   if not properties.dynamic else
                   f"{saved_level}'s scale is static; this run's dynamic scale starts afresh")
            self.left_out.append(f"the loss scale and its counters ({why})")
        if not self.masters and holds_masters:
            self.left_out.append(f"{saved_level}'s master weights (no other level needs them: "
                                 f"the model's state_dict() holds the fp32 weights)")

    def describe(self) -> str:
        """What loads and what is left out, and why."""
        restored = "the loss scale and its counters" if self.scalers else "nothing"
        text = (f"the amp state was saved at opt_level {self.saved_level!r} and this run uses "
                f"{self.level!r}: restored {restored}")
        if self.left_out:
            text += f"; left out {' and '.join(self.left_out)}"
        return text


def load_amp_state(run, state_dict: dict) -> None:
    """``amp.load_state_dict``: check ``state_dict`` whole (raising, changing nothing, when it
    does not fit), say at INFO what of a state saved at another opt level was left out, load."""
    accepted = check_state(run, state_dict, with_masters=True)
    fp8_load = fp8_saved.check(run, state_dict.get(STATE_KEY))
    if accepted.other_level and run.verbosity >= 1 and is_logging_rank():
        logger.info("amp.load_state_dict: %s.", accepted.describe())
    apply_state(run, state_dict, accepted)
    fp8_load.apply()


def check_state(run, state_dict: dict, *, with_masters: bool) -> Accepted:
    """What of ``state_dict`` (what ``amp.state_dict()`` or apex wrote; with
    ``with_masters=False``, what ``scaler_state()`` wrote) loads into ``run``. Raises
    ValueError, changing nothing, when it is not an amp state, holds another number of losses,
    or holds values that are damaged or (where they would load) do not fit ``run``."""
    _refuse_what_is_not_an_amp_state(state_dict)
    n = len(run.scalers)
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
        _check_extra(run, extra, with_masters)
    accepted = Accepted(run.properties, None if extra is None else extra["opt_level"],
                        with_masters and extra is not None and any(extra["master_weights"]))
    for scaler in run.scalers:
        key = f"loss_scaler{scaler.loss_id}"
        scaler.check_state(key, state_dict[key],
                           None if extra is None else extra["loss_scalers"][scaler.loss_id],
                           fit=accepted.scalers)
    return accepted


def apply_state(run, state_dict: dict, accepted: Accepted) -> None:
    """Load what ``check_state`` accepted of ``state_dict``."""
    extra = state_dict.get(STATE_KEY)
    if accepted.scalers:
        for scaler in run.scalers:
            key = f"loss_scaler{scaler.loss_id}"
            scaler.load_state(state_dict[key],
                              None if extra is None else extra["loss_scalers"][scaler.loss_id])
    if accepted.masters and extra is not None and "master_weights" in extra:
        run.copies.load([(pair, value) for pairs, saved in zip(run.pairs.per_model,
                                                              extra["master_weights"])
                         for pair, value in zip(pairs, saved)])


def _check_extra(run, extra, with_masters: bool) -> None:
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
    if set(extra) - ({fp8_saved.KEY} if with_masters else set()) != keys:
        raise ValueError(f"the amp state's {STATE_KEY!r} entry has keys {sorted(extra)}, "
                         f"not those {'amp' if with_masters else 'an amp optimizer'}"
                         f".state_dict() writes")
    if not isinstance(extra["opt_level"], str) or extra["opt_level"] not in OPT_LEVELS:
        raise ValueError(f"the amp state's opt_level is {extra['opt_level']!r}, which is not an "
                         f"opt level ({', '.join(OPT_LEVELS)}): the checkpoint is damaged or "
                         f"not an amp state")
    scalers = extra["loss_scalers"]
    if not isinstance(scalers, list) or len(scalers) != len(run.scalers):
        raise ValueError(f"the amp state's counters cover "
                         f"{len(scalers) if isinstance(scalers, list) else '?'} loss "
                         f"scaler(s) but this run has {len(run.scalers)}")
    if not with_masters:
        return
    masters = extra["master_weights"]
    if isinstance(masters, list) and extra["opt_level"] != run.properties.opt_level:
        return   # another level's masters are left out (Accepted)
    per_model = run.pairs.per_model
    if not isinstance(masters, list) or len(masters) != len(per_model):
        raise ValueError(f"the amp state holds master weights for "
                         f"{len(masters) if isinstance(masters, list) else '?'} model(s) but "
                         f"this run has {len(per_model)}")
    for m, (pairs, saved) in enumerate(zip(per_model, masters)):
        if not isinstance(saved, list) or len(saved) != len(pairs):
            held = len(saved) if isinstance(saved, list) else "?"
            raise ValueError(f"the amp state holds {held} master weights for model {m}, "
                             f"which has {len(pairs)}")
        for pair, value in zip(pairs, saved):
            name, master = pair.name, pair.master
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


class OptimizerAmpState:
    """The hooks on an amp optimizer that carry the amp state in its own ``state_dict()``."""

    def __init__(self, amp_opt):
        self.amp_opt = amp_opt
        # The amp state a load_state_dict is bringing in, with what of it loads (Accepted):
        # checked before torch loads the optimizer's part, applied after torch has (so that
        # nothing changes when torch refuses), and what was left out, said once torch loaded.
        self._incoming: Optional[tuple] = None
        self._left_out: Optional[str] = None

    def install(self, optimizers) -> None:
        """On each of ``optimizers`` (the stepping one, and wrappers around it with a
        ``state_dict`` of their own, such as SAM's)."""
        for opt in optimizers:
            opt.register_state_dict_post_hook(self._add)
            opt.register_load_state_dict_pre_hook(self._take)
            opt.register_load_state_dict_post_hook(self._load)

    def _add(self, optimizer, state_dict: dict) -> dict:
        """state_dict post-hook: the run's loss scalers beside torch's state (plain numbers)."""
        state_dict[AMP_STATE_KEY] = scaler_state(self.amp_opt.run)
        return state_dict

    def _take(self, optimizer, state_dict: dict) -> dict:
        """load_state_dict pre-hook, before torch changes anything: take the amp state out of
        torch's copy of the dict and check it as amp.load_state_dict does. torch's part always
        loads: what of the amp part does not fit this run is left out (``_load`` says so)."""
        self._incoming = self._left_out = None
        carried = state_dict.pop(AMP_STATE_KEY, None)
        if carried is None:
            return state_dict
        what = (f"{self.amp_opt.label()}.load_state_dict: the optimizer's state loaded, but the "
                f"amp state it carries (under {AMP_STATE_KEY!r})")
        try:
            if not isinstance(carried, dict):
                raise ValueError(f"it is a {type(carried).__name__}, not the dict an amp "
                                 f"optimizer's state_dict() writes; the checkpoint is damaged")
            accepted = check_state(self.amp_opt.run, carried, with_masters=False)
        except ValueError as exc:
            self._left_out = f"{what} was not restored: {exc}. The loss scalers keep their state"
            return state_dict
        self._incoming = (carried, accepted)
        if accepted.left_out:
            self._left_out = f"{what} was not restored whole: {accepted.describe()}"
        return state_dict

    def _load(self, optimizer) -> None:
        """load_state_dict post-hook: torch loaded the optimizer's part; now the loss scalers,
        and one WARNING when part of the amp state was left out."""
        incoming, self._incoming = self._incoming, None
        left_out, self._left_out = self._left_out, None
        run = self.amp_opt.run
        if incoming is not None:
            apply_state(run, *incoming)
        if left_out is not None and run.verbosity >= 1 and is_logging_rank():
            logger.warning("%s.", left_out)
