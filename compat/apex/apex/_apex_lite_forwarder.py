"""Marks this ``apex`` as apex_lite's forwarding package: ``apex_lite.install_apex_alias()`` and
``python -m apex_lite.apex_alias`` find this file on disk and leave the package alone."""
