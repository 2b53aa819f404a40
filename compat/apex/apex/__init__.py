"""apex_lite's ``apex``: NVIDIA apex's names served by apex_lite (``compat/apex``).

``apex.<sub>`` for each subpackage in ``apex_lite.apex_compat.alias.TARGETS`` (``apex.amp``,
``apex.optimizers``, ``apex.parallel``, ``apex.normalization``, ``apex.fp16_utils``, ``apex.multi_tensor_apply``) is
apex_lite's own module (``apex_lite.amp``, ..., ``apex_lite.apex_compat.multi_tensor``), found
through that module's finder, so that each exists once (``import apex.amp.scaler`` gives
``apex_lite.amp.scaler``), and an attribute of ``apex`` loaded on first use. Other parts of apex
raise an ImportError.
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

__getattr__, __dir__, __all__ = _apex_alias.forward_subpackages()
