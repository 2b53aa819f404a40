"""apex_lite: mixed-precision training for PyTorch with apex.amp's API."""
__version__ = "0.1.0"

from . import amp  # noqa: E402  (``from apex_lite import amp``)


def __getattr__(name):
    # Loaded on use, so that ``python -m apex_lite.apex_alias`` executes that module only once.
    if name in ("install_apex_alias", "ApexAliasError"):
        from .apex_compat import alias as apex_alias
        return getattr(apex_alias, name)
    raise AttributeError(f"module 'apex_lite' has no attribute {name!r}")
