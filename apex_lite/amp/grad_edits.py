"""O2: an edit of the model's half gradients between ``scale_loss`` and ``step()`` is refused.

Under O2 a cast model parameter's ``.grad`` (half) still holds the backward multiplied by the
loss scale after ``scale_loss``; the true gradients are its fp32 master's, the optimizer's
parameter. ``clip_grad_norm_(model.parameters(), ...)`` (torch.amp's way, after
``scaler.unscale_``), ``clip_grad_value_``, in-place arithmetic or a new ``.grad`` on the model
would then be applied to the scaled values (the fused step reads the half gradients: a clip to 1
of gradients 65536 times too large stops training) or ignored (the unfused step reads the
masters'), silently. So ``step()``, and a ``scale_loss`` that would add another backward to them,
refuse such an edit before anything changes, naming the parameter and the fix: edit the true
gradients, ``amp.clip_grad_norm_(optimizer, max_norm)`` or any edit on
``amp.master_params(optimizer)`` (or ``optimizer.param_groups``).

How: at the end of each ``scale_loss`` (not ``delay_unscale``) amp records, per device, the half
gradient tensor of every cast parameter and its version counter (bumped by every in-place op), and
compares them at ``step()``: host integers, no sync; one C++ call each where the native backend
serves (``watch_grads``), whose loop reads what the step's own gather reads next. amp's own
writes bump nothing it compares: its kernels run below autograd, and its accumulation across
``scale_loss`` blocks records again at each block's end. A ``.grad`` set to None counts as
cleared. Edits through ``.data`` (``p.grad.data.mul_``) bypass the version counter, as they bypass
autograd's checks, and are not seen.

Parameters that are both the model's and the optimizer's (modules kept in fp32, FSDP2's sharded
parameters) hold their true gradient after ``scale_loss`` on both step paths: editing them is
right, and is not watched. O1 and O3 have no cast parameters with masters: nothing is watched.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..multi_tensor._backend import ops_for

_FIX = ("The true gradients are the fp32 master weights' (the optimizer's parameters). Clip with "
        "amp.clip_grad_norm_(optimizer, max_norm) or "
        "torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm), and make any "
        "other edit on amp.master_params(optimizer) (or optimizer.param_groups), whose "
        "gradients are the true ones. To go on from here, call optimizer.zero_grad() and run "
        "the backward again.")


class HalfGradEdits:
    """The watch over one amp optimizer's half model gradients (``AmpOptimizer.grad_edits``)."""

    def __init__(self):
        # (device, watch, the half model parameters it reads)
        self._watches: List[tuple] = []
        self._groups: Optional[dict] = None

    def _watches_for(self, amp_opt) -> List[tuple]:
        groups = amp_opt.groups()
        if groups is not self._groups:      # built again after add_param_group
            self.forget()
            self._watches = [(device, ops_for(device).watch_grads(group.half_models),
                              group.half_models)
                             for device, group in groups.items() if group.half_models]
            self._groups = groups
        return self._watches

    def record(self, amp_opt) -> None:
        """At the end of a ``scale_loss``: the half gradients as they are now are amp's."""
        for _, watch, _ in self._watches_for(amp_opt):
            watch.record()

    def refuse(self, amp_opt, caller: str) -> None:
        """Raise, naming the first parameter and the fix, when a half gradient changed since the
        last ``record``."""
        for _, watch, params in self._watches:
            index = watch.changed()
            if index >= 0:
                name = amp_opt.run.param_name(params[index])
                raise RuntimeError(
                    f"{caller}: the gradient of model parameter {name!r} was changed after the "
                    f"amp.scale_loss that checked it (clip_grad_norm_ or clip_grad_value_ on "
                    f"model.parameters(), in-place arithmetic on its .grad, or a new .grad). "
                    f"At O2 the model's half .grad still holds the gradient multiplied by the "
                    f"loss scale, so the edit would be applied to scaled values or not at all; "
                    f"nothing was changed. {_FIX}")

    def cleared(self) -> List[tuple]:
        """``[(device, indices into its group's half_models)]``: the half gradients that were
        there at the last ``record`` and are None now (set to None by hand, or by a submodule's
        ``zero_grad()``)."""
        out = []
        for device, watch, _ in self._watches:
            indices = list(watch.cleared())
            if indices:
                out.append((device, indices))
        return out

    def forget(self) -> None:
        """Drop the record (and its references to the gradients): at step(), zero_grad."""
        for _, watch, _ in self._watches:
            watch.clear()
