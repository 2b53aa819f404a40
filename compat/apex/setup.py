"""Build of apex_lite's ``apex`` distribution (the metadata is in pyproject.toml).

One check before setuptools runs: pip's offline install (``pip install --no-deps
--no-build-isolation ./compat/apex``) builds a wheel with the environment's setuptools as it is,
and setuptools older than 70.1 (what ``python3.11 -m venv`` installs: 65.5) needs the ``wheel``
package for that, which pip does not install under ``--no-build-isolation``. Without this check
the build stops at "invalid command 'bdist_wheel'"; with it, it says what to install. apex_lite's
own setup.py makes the same check (``check_wheel_tool``); this distribution imports nothing of
apex_lite's at build time, so the check is repeated here.
"""
import importlib.util
import re
import sys

import setuptools
from setuptools import setup

# setuptools from this version carries bdist_wheel itself; before it, the wheel package does.
SETUPTOOLS_OWN_BDIST_WHEEL = (70, 1)
# The setuptools commands that run bdist_wheel: pip's metadata step (dist_info) and its builds.
WHEEL_COMMANDS = ("bdist_wheel", "dist_info", "editable_wheel")


def _version_tuple(text):
    """(major, minor) of a version string such as '65.5.0', or None."""
    match = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def wheel_tool_problem(argv, setuptools_version, wheel_importable):
    """What stops a wheel build here (a sentence naming the package to install), or None: the
    ``argv`` commands run bdist_wheel, setuptools ``setuptools_version`` is older than 70.1 and
    ``wheel`` is not importable."""
    if wheel_importable or not any(command in argv for command in WHEEL_COMMANDS):
        return None
    if (_version_tuple(setuptools_version) or (0, 0)) >= SETUPTOOLS_OWN_BDIST_WHEEL:
        return None
    return (f"building a wheel of apex_lite's apex (what pip install does) with setuptools "
            f"{setuptools_version} needs the 'wheel' package, which is not installed here "
            f"(pip's --no-build-isolation uses the environment's build tools as they are). Run: "
            f"pip install wheel (or pip install 'setuptools>=70.1'), then install again.")


if __name__ == "__main__":
    problem = wheel_tool_problem(sys.argv, setuptools.__version__,
                                 importlib.util.find_spec("wheel") is not None)
    if problem:
        sys.exit(f"apex (apex_lite's) setup: error: {problem}")
    setup()
