"""apex.fp16_utils on apex_lite: ``FP16_Optimizer`` (fp32 master weights and loss scaling around
a torch optimizer), the model helpers (``FP16Model``, ``network_to_half``, ``convert_network``,
``prep_param_lists``, ...) and the stand-alone ``LossScaler`` / ``DynamicLossScaler``, with apex's
names, signatures and defaults, for fp16 and bf16 models on any device. ``apex.fp16_utils``
through apex_lite's alias is this package, and ``from apex.fp16_utils import *`` gives apex's
names (this file imports exactly what apex's did)."""
from .fp16util import (
    BN_convert_float,
    network_to_half,
    prep_param_lists,
    model_grads_to_master_grads,
    master_params_to_model_params,
    tofp16,
    to_python_float,
    clip_grad_norm,
    convert_module,
    convert_network,
    FP16Model,
)

from .fp16_optimizer import FP16_Optimizer
from .loss_scaler import LossScaler, DynamicLossScaler
