"""apex's private surfaces, in one place, for code written against NVIDIA apex.

- ``alias``: ``apex_lite.install_apex_alias()`` and ``python -m apex_lite.apex_alias``: the
  names ``apex``, ``amp_C`` and ``apex_C`` resolved to apex_lite;
- ``multi_tensor``: ``amp_C``'s ops and ``apex.multi_tensor_apply.multi_tensor_applier`` over
  apex_lite's kernels;
- ``apex_c``: ``apex_C``'s ``flatten`` and ``unflatten``;
- ``amp_state``: ``amp._amp_state``, a read-only view of apex's global amp state.

``apex_lite.apex_alias`` and ``apex_lite.apex_multi_tensor``, their names before this package,
import the same module objects. Nothing is imported here: each module is loaded on use.
"""
