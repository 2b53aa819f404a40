"""apex_lite's ``apex``: NVIDIA apex's names served by apex_lite (``compat/apex``).

``apex.amp``, ``apex.optimizers``, ``apex.multi_tensor_apply`` and ``apex.parallel`` are
apex_lite's own modules (``apex_lite.amp``, ``apex_lite.optimizers``,
``apex_lite.apex_compat.multi_tensor``, ``apex_lite.parallel``), found
through ``apex_lite.apex_compat.alias``'s finder, so that each exists once (``import apex.amp.scaler`` gives
``apex_lite.amp.scaler``). Other parts of apex raise an ImportError naming torch's replacement.
"""
try:
    from apex_lite.apex_compat import alias as _apex_alias
except ModuleNotFoundError as exc:
    if exc.name != "apex_lite":
        raise
    raise ImportError("this apex is apex_lite's stand-in for NVIDIA apex (the 'apex' "
                      "distribution from apex_lite's compat/apex), and apex_lite is not "
                      "installed: pip install apex_lite's source tree first, or uninstall this "
                      "apex (pip uninstall apex)") from exc

__getattr__ = _apex_alias.forward_subpackages()
