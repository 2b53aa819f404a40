"""``optimizer._amp_stash``: apex's ``AmpOptimizerState`` (apex/amp/_process_optimizer.py), the
mark ``amp.initialize`` leaves on each optimizer it returns, with the attributes apex code reads
from it, over the optimizer's ``AmpOptimizer``.

What apex code reads and writes (DeepLearningExamples' BERT run_pretraining.py, engines that
initialise lazily):

- ``hasattr(optimizer, "_amp_stash")``: whether ``initialize`` took the optimizer (mmengine's
  ``ApexOptimWrapper``, Lightning);
- with master weights (O2, O5): ``all_fp16_params`` (the model's half parameters that have an
  fp32 master), ``all_fp32_from_fp16_params`` (those masters, in the same order: BERT sets their
  ``.grad`` to None after a skipped step), ``all_fp32_from_fp32_params`` (the optimizer's
  parameters that stayed fp32: their own masters), and per param group ``fp16_groups``,
  ``fp32_from_fp16_groups``, ``fp32_from_fp32_groups``; without (O0, O1, O3, O4):
  ``all_fp16_params`` (half parameters, fp16 or bf16) and ``all_fp32_params``. Only parameters
  that require a gradient are listed, as in apex. Each read is of the optimizer as it is now
  (``add_param_group`` included);
- ``lazy_init_called``: True (apex_lite makes the masters at ``initialize``); BERT's resume sets
  it True after calling ``optimizer._lazy_init_maybe_master_weights()``, which, like
  ``optimizer._amp_lazy_init()``, has nothing left to do here. Setting it False is refused;
- ``already_patched``: False (apex_lite never patches ``step`` to skip one);
- other attributes: kept on the stash (apex's was a plain object).

The stash reads the ``AmpOptimizer`` through ``optimizer`` (its ``param_groups``),
``run.pairs.model_of`` (master -> the model parameter it feeds, itself when not cast) and
``run.properties.master_weights``.
"""
from __future__ import annotations

import types
from typing import Dict, List

import torch

__all__ = ["AmpStash", "attach_amp_stash"]

_HALF = (torch.float16, torch.bfloat16)
_WITH_MASTERS = ("all_fp16_params", "all_fp32_from_fp16_params", "all_fp32_from_fp32_params",
                 "fp16_groups", "fp32_from_fp16_groups", "fp32_from_fp32_groups")
_WITHOUT_MASTERS = ("all_fp16_params", "all_fp32_params")
_REFUSED = {
    "already_patched": "apex_lite's step() skips a step itself; it never patches step()",
    "params_have_scaled_gradients": "amp.scale_loss(..., delay_unscale=...) says whether the "
                                    "gradients stay scaled",
}


def attach_amp_stash(optimizer, amp_optimizer) -> None:
    """Give ``optimizer`` (which ``initialize`` took, its state ``amp_optimizer``) apex's
    ``_amp_stash`` and apex's lazy-initialisation methods."""
    optimizer._amp_stash = AmpStash(amp_optimizer)
    optimizer._lazy_init_maybe_master_weights = types.MethodType(_nothing_left_to_do, optimizer)
    optimizer._amp_lazy_init = types.MethodType(_nothing_left_to_do, optimizer)


def _nothing_left_to_do(optimizer) -> None:
    """apex made the master weights on the first step (or on this call); apex_lite made them at
    ``amp.initialize``, and they are in ``optimizer.param_groups`` already."""


class AmpStash:
    """``optimizer._amp_stash`` over ``amp_optimizer`` (see the module doc)."""

    def __init__(self, amp_optimizer):
        self.__dict__["_amp_optimizer"] = amp_optimizer
        self.__dict__["_extra"] = {}

    @property
    def lazy_init_called(self) -> bool:
        return True

    @property
    def already_patched(self) -> bool:
        return False

    def _master_weights(self) -> bool:
        return bool(self._amp_optimizer.run.properties.master_weights)

    def _groups(self) -> Dict[str, List[List[torch.Tensor]]]:
        """The parameter lists of apex's stash, per param group."""
        amp_opt = self._amp_optimizer
        model_of = amp_opt.run.pairs.model_of
        lists: Dict[str, List[List[torch.Tensor]]] = {
            name: [] for name in ("fp16", "fp32_from_fp16", "fp32_from_fp32", "fp32")}
        for group in amp_opt.optimizer.param_groups:
            fp16, from_fp16, from_fp32, fp32 = [], [], [], []
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                model_param = model_of(p)
                if model_param is not p:
                    fp16.append(model_param)
                    from_fp16.append(p)
                elif p.dtype in _HALF:
                    fp16.append(p)
                else:
                    from_fp32.append(p)
                    fp32.append(p)
            for name, values in zip(lists, (fp16, from_fp16, from_fp32, fp32)):
                lists[name].append(values)
        return lists

    def _provided(self):
        return (_WITH_MASTERS if self._master_weights() else _WITHOUT_MASTERS) + \
            ("lazy_init_called", "already_patched")

    def __getattr__(self, name):
        extra = self.__dict__["_extra"]
        if name in extra:
            return extra[name]
        provided = self._provided()
        if name in provided:
            lists = self._groups()
            if name.endswith("_groups"):
                return lists[name[:-len("_groups")]]
            return [p for group in lists[name[len("all_"):-len("_params")]] for p in group]
        raise AttributeError(f"optimizer._amp_stash (apex_lite's view of apex's amp state of "
                             f"this optimizer) has no attribute {name!r}; at this opt level it "
                             f"has {sorted(provided)}")

    def __setattr__(self, name, value):
        if name == "lazy_init_called":
            if value is not True:
                raise AttributeError(
                    "optimizer._amp_stash.lazy_init_called cannot be set to "
                    f"{value!r}: apex_lite makes the master weights at amp.initialize, and they "
                    "are in optimizer.param_groups already (set it True, or leave it)")
            return
        if name in _REFUSED:
            raise AttributeError(f"optimizer._amp_stash.{name} cannot be set in apex_lite: "
                                 f"{_REFUSED[name]}")
        if name in _WITH_MASTERS + _WITHOUT_MASTERS:
            raise AttributeError(f"optimizer._amp_stash.{name} cannot be set in apex_lite: it "
                                 f"lists the optimizer's parameters as they are (add parameters "
                                 f"with optimizer.add_param_group)")
        self.__dict__["_extra"][name] = value   # apex's stash was a plain object

    def __repr__(self) -> str:
        return f"<optimizer._amp_stash (apex_lite) of {self._amp_optimizer.label()}>"
