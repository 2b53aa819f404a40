#!/usr/bin/env bash
# Builds the Sphinx site (docs/) as CI does, warnings as errors: a virtual environment at
# docs/_build/venv that sees the machine's packages (torch), the docs extra installed into it
# from PyPI (pip install ".[docs]": sphinx, myst-parser, furo, and apex_lite itself, pure), then
#   sphinx-build -W --keep-going -b html docs docs/_build/html
# Needs the network for the first install (PyPI); a failed install stops with that said.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=docs/_build/venv
started=$SECONDS

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
fi
if ! "$VENV/bin/python" -c "import sphinx, myst_parser, furo" 2>/dev/null; then
    if ! "$VENV/bin/python" -m pip install -q ".[docs]"; then
        echo "build_docs.sh: error: could not install the docs extra (sphinx, myst-parser, furo)" \
             "into $VENV: pip needs PyPI for it (no network here?). The documentation was not" \
             "built." >&2
        exit 1
    fi
fi
"$VENV/bin/python" -m sphinx -W --keep-going -q -b html docs docs/_build/html
echo "== docs built in $((SECONDS - started)) s: docs/_build/html/index.html"
