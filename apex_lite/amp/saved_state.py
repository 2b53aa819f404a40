"""The amp state that checkpoints carry, and the checks that refuse one that does not fit.

``amp.state_dict()`` writes apex's ``{"loss_scaler<i>": {"loss_scale", "unskipped"}}`` and,
under the versioned key ``STATE_KEY``, the scalers' counters and O2's master weights (what a
bitwise resume needs). Each amp optimizer's own ``state_dict()`` carries the scalers' part under
``AMP_STATE_KEY`` (``OptimizerAmpState``), so that a framework that saves only the model and the
optimizer resumes the loss scale and its counters; a plain torch optimizer's ``load_state_dict``
ignores that key. Either is checked whole before anything is loaded (``check_state``).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

STATE_KEY = "apex_lite"
STATE_VERSION = 1

# The key of the amp state in an amp optimizer's state_dict() (beside torch's "state" and
# "param_groups"; torch's load_state_dict reads only those two).
AMP_STATE_KEY = "apex_lite_amp"


def amp_state_dict(run) -> dict:
    """What ``amp.state_dict()`` returns for ``run``: ``scaler_state`` and the O2 masters."""
    state = scaler_state(run)
    state[STATE_KEY]["master_weights"] = [[master.detach().clone() for _, _, master in pairs]
                                          for pairs in run.master_pairs]
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


def check_state(run, state_dict: dict, *, with_masters: bool) -> None:
    """Raise ValueError, changing nothing, when ``state_dict`` (what ``amp.state_dict()`` or
    apex wrote; with ``with_masters=False``, what ``scaler_state()`` wrote) does not fit
    ``run``."""
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
    for scaler in run.scalers:
        key = f"loss_scaler{scaler.loss_id}"
        scaler.check_state(key, state_dict[key],
                           None if extra is None else extra["loss_scalers"][scaler.loss_id])


def apply_state(run, state_dict: dict) -> None:
    """Load a state that ``check_state`` accepted."""
    extra = state_dict.get(STATE_KEY)
    for scaler in run.scalers:
        key = f"loss_scaler{scaler.loss_id}"
        scaler.load_state(state_dict[key],
                          None if extra is None else extra["loss_scalers"][scaler.loss_id])
    if extra is not None and "master_weights" in extra:
        with torch.no_grad():
            for pairs, saved in zip(run.master_pairs, extra["master_weights"]):
                for (_, model_param, master), value in zip(pairs, saved):
                    master.copy_(value)
                    model_param.copy_(master)


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
    if set(extra) != keys:
        raise ValueError(f"the amp state's {STATE_KEY!r} entry has keys {sorted(extra)}, "
                         f"not those {'amp' if with_masters else 'an amp optimizer'}"
                         f".state_dict() writes")
    if extra["opt_level"] != run.properties.opt_level:
        raise ValueError(f"the amp state was saved at opt_level {extra['opt_level']!r} but "
                         f"this run uses {run.properties.opt_level!r}; initialize with "
                         f"opt_level={extra['opt_level']!r} to resume it")
    scalers = extra["loss_scalers"]
    if not isinstance(scalers, list) or len(scalers) != len(run.scalers):
        raise ValueError(f"the amp state's counters cover "
                         f"{len(scalers) if isinstance(scalers, list) else '?'} loss "
                         f"scaler(s) but this run has {len(run.scalers)}")
    if not with_masters:
        return
    masters = extra["master_weights"]
    if not isinstance(masters, list) or len(masters) != len(run.master_pairs):
        raise ValueError(f"the amp state holds master weights for "
                         f"{len(masters) if isinstance(masters, list) else '?'} model(s) but "
                         f"this run has {len(run.master_pairs)}")
    for m, (pairs, saved) in enumerate(zip(run.master_pairs, masters)):
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


class OptimizerAmpState:
    """The hooks on an amp optimizer that carry the amp state in its own ``state_dict()``."""

    def __init__(self, amp_opt):
        self.amp_opt = amp_opt
        # The amp state a load_state_dict is bringing in: checked before torch loads the
        # optimizer's part, applied after torch has (so that nothing changes when either fails).
        self._incoming: Optional[dict] = None

    def install(self) -> None:
        opt = self.amp_opt.optimizer
        opt.register_state_dict_post_hook(self._add)
        opt.register_load_state_dict_pre_hook(self._take)
        opt.register_load_state_dict_post_hook(self._load)

    def _add(self, optimizer, state_dict: dict) -> dict:
        """state_dict post-hook: the run's loss scalers beside torch's state (plain numbers)."""
        state_dict[AMP_STATE_KEY] = scaler_state(self.amp_opt.run)
        return state_dict

    def _take(self, optimizer, state_dict: dict) -> dict:
        """load_state_dict pre-hook, before torch changes anything: take the amp state out of
        torch's copy of the dict and check it as amp.load_state_dict does; one that does not fit
        this run is refused here, so the optimizer's state is not loaded either."""
        self._incoming = None
        carried = state_dict.pop(AMP_STATE_KEY, None)
        if carried is None:
            return state_dict
        label = self.amp_opt.label()
        if not isinstance(carried, dict):
            raise ValueError(f"{label}.load_state_dict: the state's {AMP_STATE_KEY!r} "
                             f"entry is a {type(carried).__name__}, not the dict an amp "
                             f"optimizer's state_dict() writes; the checkpoint is damaged")
        try:
            check_state(self.amp_opt.run, carried, with_masters=False)
        except ValueError as exc:
            raise ValueError(f"{label}.load_state_dict: the amp state this optimizer "
                             f"state carries (under {AMP_STATE_KEY!r}) does not fit this run, "
                             f"so nothing was loaded: {exc}") from exc
        self._incoming = carried
        return state_dict

    def _load(self, optimizer) -> None:
        """load_state_dict post-hook: torch loaded the optimizer's part; now the loss scalers."""
        carried, self._incoming = self._incoming, None
        if carried is not None:
            apply_state(self.amp_opt.run, carried)
