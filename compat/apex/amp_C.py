"""NVIDIA apex's compiled ``amp_C`` ops, served by apex_lite's kernels: this module is
``apex_lite.apex_compat.multi_tensor`` (multi_tensor_scale, multi_tensor_axpby,
multi_tensor_l2norm, multi_tensor_sgd, multi_tensor_adam, multi_tensor_lamb,
multi_tensor_novograd, multi_tensor_adagrad, multi_tensor_l2norm_mp, multi_tensor_lamb_mp,
multi_tensor_lamb_stage1_cuda, multi_tensor_lamb_stage2_cuda)."""
import sys

from apex_lite.apex_compat import multi_tensor as apex_multi_tensor

sys.modules[__name__] = apex_multi_tensor
