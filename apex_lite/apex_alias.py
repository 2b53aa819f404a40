"""``apex_lite.apex_alias``, the documented name of ``apex_lite.apex_compat.alias``: importing it
gives that module itself, and ``python -m apex_lite.apex_alias [script.py | -m module] [args]``
runs its ``main``."""
import sys

from .apex_compat import alias as _alias

if __name__ == "__main__":
    sys.exit(_alias.main())
sys.modules[__name__] = _alias
