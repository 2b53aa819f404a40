"""The fp8 state in ``amp.state_dict()``: under ``state["apex_lite"]["fp8"]``, versioned, plain
tensors and numbers (``torch.load(..., weights_only=True)`` reads it)::

    {"version": 1, "recipe": "delayed", "amax_history": 16, "margin": 0,
     "models": [{"steps": 12, "layers": {"fc1": {"counts": int64 (3, 2),
                                                 "amax_history": fp32 (3, 16),
                                                 "scale": fp32 (3,),
                                                 "pending_amax": fp32 (3,)}, ...}}, ...]}

(roles in the order input, weight, grad; the current recipe saves only the counts, and ``None``
for a model without fp8 layers). ``check`` reads a saved state whole and raises, changing
nothing, when it is damaged; what does not fit this run (another recipe, history length or set
of layers, or a run with fp8 on one side only) loads what carries over, and ``Fp8Load.apply``
says at INFO what was left out and what was defaulted. The scales are recomputed from the
histories, so they follow this run's ``margin``.
"""
from __future__ import annotations

import logging
from typing import List, Optional

import torch

from .cast import ROLES
from .state import Fp8Group

logger = logging.getLogger("apex_lite.amp")

KEY = "fp8"
VERSION = 1
_ROLES = len(ROLES)


def add_to(run, extra: dict) -> None:
    """Put ``run``'s fp8 state in ``extra`` (the ``"apex_lite"`` entry), when it has one."""
    fp8 = getattr(run, "fp8", None)
    if fp8 is None:
        return
    config = fp8.config
    extra[KEY] = {"version": VERSION, "recipe": config.recipe,
                  "amax_history": config.amax_history, "margin": config.margin,
                  "models": [_group_state(group) for group in fp8.groups]}


def _group_state(group: Optional[Fp8Group]) -> Optional[dict]:
    if group is None:
        return None
    layers = {}
    for i, name in enumerate(group.names):
        entry = {"counts": group.counts[i].detach().clone()}
        if group.delayed:
            entry.update(amax_history=group.history[i].detach().clone(),
                         scale=group.scale[i].detach().clone(),
                         pending_amax=group.pending[i].detach().clone())
        layers[name] = entry
    return {"steps": int(group.steps) if group.delayed else 0, "layers": layers}


class Fp8Load:
    """What of a saved fp8 state loads into a run (``check`` makes it; ``apply`` loads it)."""

    def __init__(self, run):
        self.run = run
        self.loads: List[tuple] = []   # (group, row, entry, history length to copy)
        self.steps: List[tuple] = []   # (group, steps)
        self.words: List[str] = []

    def apply(self) -> None:
        """Load what was accepted, then say (INFO) what was left out or defaulted."""
        with torch.no_grad():
            for group, row, entry, length in self.loads:
                group.counts[row].copy_(entry["counts"])
                if length:
                    group.history[row].zero_()
                    group.history[row, :, :length].copy_(entry["amax_history"][:, :length])
                    group.pending[row].copy_(entry["pending_amax"])
            for group, steps in self.steps:
                group.steps.fill_(steps)
            for group in {id(g): g for g, *_ in self.loads}.values():
                if group.delayed:
                    group.refresh_scales()
                    # amaxes saved before their fold are folded at the next step (a host
                    # read, once per load)
                    group.dirty = bool(group.pending.any())
        run = self.run
        if self.words and run.verbosity >= 1:
            from ..overflow import is_logging_rank
            if is_logging_rank():
                logger.info("amp.load_state_dict: fp8: %s.", "; ".join(self.words))


def _fail(what: str) -> None:
    raise ValueError(f"the amp state's fp8 entry {what}; the checkpoint is damaged or not an "
                     f"amp state")


def check(run, extra) -> Fp8Load:
    """What of ``extra`` (the saved ``"apex_lite"`` entry, None for apex's state) loads into
    ``run``'s fp8 layers; raises ValueError, changing nothing, on a damaged fp8 entry."""
    fp8 = getattr(run, "fp8", None)
    saved = extra.get(KEY) if isinstance(extra, dict) else None
    load = Fp8Load(run)
    if saved is None:
        if fp8 is not None and fp8.layer_count():
            load.words.append(
                "the checkpoint holds no fp8 state (saved without fp8=), so the fp8 layers keep "
                "the state this run gave them (" + ("empty amax histories: the first step "
                "scales by its own amaxes; " if fp8.config.recipe == "delayed" else "")
                + "counts from 0)")
        return load
    _check_shape(saved)
    models = saved["models"]
    if fp8 is None:
        layers = sum(len(m["layers"]) for m in models if m is not None)
        load.words.append(f"left out the saved fp8 state ({saved['recipe']} recipe, {layers} "
                          f"layer(s)): this run does not use fp8")
        return load
    if len(models) != len(fp8.groups):
        raise ValueError(f"the amp state's fp8 entry covers {len(models)} model(s) but this run "
                         f"has {len(fp8.groups)}")
    config = fp8.config
    histories = saved["recipe"] == "delayed" and config.recipe == "delayed"
    length = min(saved["amax_history"], config.amax_history) if histories else 0
    if saved["recipe"] != config.recipe:
        load.words.append(
            f"saved with the {saved['recipe']} recipe, this run uses {config.recipe}: "
            + ("left out the amax histories" if saved["recipe"] == "delayed" else
               "the amax histories start empty (the first step scales by its own amaxes)"))
    elif histories and saved["amax_history"] != config.amax_history:
        load.words.append(f"amax histories of {saved['amax_history']} steps loaded into "
                          f"{config.amax_history}: the newest {length} kept")
    missing, extra_names = [], []
    for m, (group, saved_model) in enumerate(zip(fp8.groups, models)):
        prefix = f"model {m}: " if len(models) > 1 else ""
        names = [] if group is None else group.names
        saved_layers = {} if saved_model is None else saved_model["layers"]
        for name in saved_layers:
            if name not in names:
                extra_names.append(prefix + name)
        for row, name in enumerate(names):
            entry = saved_layers.get(name)
            if entry is None:
                missing.append(prefix + name)
                continue
            _check_entry(prefix + name, entry, saved["recipe"], saved["amax_history"])
            load.loads.append((group, row, entry, length))
        if group is not None and histories and saved_model is not None:
            load.steps.append((group, saved_model["steps"]))
    if extra_names:
        load.words.append(f"left out the saved state of {len(extra_names)} layer(s) that do "
                          f"not run in fp8 here ({', '.join(extra_names[:5])}"
                          f"{', ...' if len(extra_names) > 5 else ''})")
    if missing:
        load.words.append(f"{len(missing)} fp8 layer(s) had no saved state and keep this run's "
                          f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})")
    return load


def _check_shape(saved) -> None:
    if not isinstance(saved, dict):
        _fail(f"is a {type(saved).__name__}, not a dict")
    if saved.get("version") != VERSION:
        raise ValueError(f"the amp state's fp8 entry has version {saved.get('version')!r}; this "
                         f"apex_lite reads version {VERSION}")
    expected = {"version", "recipe", "amax_history", "margin", "models"}
    if set(saved) != expected:
        _fail(f"has keys {sorted(map(str, saved))}, not {sorted(expected)}")
    if saved["recipe"] not in ("current", "delayed"):
        _fail(f"names the recipe {saved['recipe']!r}")
    for key, low in (("amax_history", 1), ("margin", 0)):
        value = saved[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            _fail(f"has {key}={value!r}")
    models = saved["models"]
    if not isinstance(models, list):
        _fail(f"holds models as a {type(models).__name__}")
    for model in models:
        if model is None:
            continue
        if not isinstance(model, dict) or set(model) != {"steps", "layers"} \
                or not isinstance(model["layers"], dict) \
                or isinstance(model["steps"], bool) or not isinstance(model["steps"], int) \
                or model["steps"] < 0:
            _fail("holds a model entry that is not {'steps': int, 'layers': {name: ...}}")


def _check_entry(name: str, entry, recipe: str, history: int) -> None:
    expected = {"counts": ((_ROLES, 2), torch.int64)}
    if recipe == "delayed":
        expected.update(amax_history=((_ROLES, history), torch.float32),
                        scale=((_ROLES,), torch.float32),
                        pending_amax=((_ROLES,), torch.float32))
    if not isinstance(entry, dict) or set(entry) != set(expected):
        _fail(f"holds for layer {name!r} "
              f"{sorted(entry) if isinstance(entry, dict) else type(entry).__name__}, not "
              f"{sorted(expected)}")
    for key, (shape, dtype) in expected.items():
        value = entry[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape \
                or value.dtype != dtype or value.is_meta:
            got = (f"shape {tuple(value.shape)}, {value.dtype}" if isinstance(value, torch.Tensor)
                   else type(value).__name__)
            _fail(f"holds {key} of layer {name!r} as {got}, not shape {shape}, {dtype}")
