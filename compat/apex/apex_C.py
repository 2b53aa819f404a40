"""NVIDIA apex's compiled ``apex_C`` module (``flatten``, ``unflatten``), served by apex_lite: this
module is ``apex_lite.apex_compat.apex_c``."""
import sys

from apex_lite.apex_compat import apex_c

sys.modules[__name__] = apex_c
