"""apex.normalization on torch's kernels: ``FusedLayerNorm``, ``FusedRMSNorm``,
``MixedFusedLayerNorm`` and ``MixedFusedRMSNorm``, with apex's signatures and output dtypes
(``apex.normalization`` through apex_lite's alias is this package). The functional forms are in
``apex_lite.normalization.fused_layer_norm``."""
from .fused_layer_norm import FusedLayerNorm, MixedFusedLayerNorm, FusedRMSNorm, MixedFusedRMSNorm
