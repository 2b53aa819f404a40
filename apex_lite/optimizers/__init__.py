"""apex's fused optimizers: ``FusedSGD``, ``FusedAdam``, ``FusedLAMB``, ``FusedNovoGrad``,
``FusedAdagrad`` and ``FusedMixedPrecisionLamb``.

Ordinary torch optimizers (torch's state layout, LR schedulers, param groups) whose step is one
multi-tensor op per param group and device, state in fp32 for every parameter dtype. The
per-device updates they are built from (``SGDUpdate``, ``AdamUpdate``, ``LambUpdate``,
``NovoGradUpdate``, ``AdagradUpdate``; see
``apex_lite.optimizers.update``) are what amp's O2 step runs, for these optimizers and for
torch.optim.SGD / Adam / AdamW (``apex_lite.optimizers.fusable``; amp's step path:
``apex_lite.amp.step_path``).
"""
from .fused_adam import AdamHyper, AdamUpdate, FusedAdam
from .fused_lamb import FusedLAMB, LambHyper, LambUpdate, global_grad_norm
from .fused_sgd import FusedSGD, SGDHyper, SGDUpdate
from .update import FusedUpdate, unit_scalars

__all__ = ["FusedSGD", "FusedAdam", "FusedLAMB", "FusedUpdate", "SGDUpdate", "AdamUpdate",
           "LambUpdate", "SGDHyper", "AdamHyper", "LambHyper", "global_grad_norm",
           "unit_scalars"]

# ---- issue 27: FusedMixedPrecisionLamb ----
from .fused_mixed_precision_lamb import (FusedMixedPrecisionLamb, MixedPrecisionLambHyper,
                                         MixedPrecisionLambUpdate)

__all__ += ["FusedMixedPrecisionLamb", "MixedPrecisionLambHyper", "MixedPrecisionLambUpdate"]
# ---- end issue 27 ----
# ---- NovoGrad and Adagrad ----
from .fused_adagrad import AdagradHyper, AdagradUpdate, FusedAdagrad  # noqa: E402
from .fused_novograd import FusedNovoGrad, NovoGradHyper, NovoGradUpdate  # noqa: E402

__all__ += ["FusedNovoGrad", "FusedAdagrad", "NovoGradUpdate", "AdagradUpdate", "NovoGradHyper",
            "AdagradHyper"]
