"""``apex_lite.apex_multi_tensor``, the earlier name of ``apex_lite.apex_compat.multi_tensor``
(``amp_C`` and ``multi_tensor_applier``): importing it gives that module itself. (A package
rather than a module file, so that git sees apex_multi_tensor.py renamed, and changes made to it
elsewhere merge into its new home.)"""
import sys

from ..apex_compat import multi_tensor as _multi_tensor

sys.modules[__name__] = _multi_tensor
