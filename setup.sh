#!/usr/bin/env bash
# Sets up a venv for moa (.venv, or $MOA_VENV): torch (one it already holds if that is a supported
# version, 2.11 to 2.13; else the CPU 2.13.0 wheel, or $MOA_TORCH_VERSION), fairseq-fixed built without
# build isolation (about 3 minutes the first time), and this project in editable mode with its test
# tools. Safe to re-run: finished steps are skipped.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
venv=${MOA_VENV:-.venv}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pin=${MOA_TORCH_VERSION:-2.13.0}
installed=$("$venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null || true)
if [ -z "$installed" ]; then
    pip install "torch==$pin"
elif ! "$venv/bin/python" -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if (2, 11) <= v <= (2, 13) else 1)"; then
    echo "setup.sh: $venv holds torch $installed, outside the versions moa supports (2.11 to 2.13): installing torch==$pin" >&2
    pip install "torch==$pin"
fi
pip install numpy cython setuptools wheel
"$venv/bin/python" -c "import fairseq" 2>/dev/null || pip install --no-build-isolation "fairseq-fixed==0.12.3.1"
pip install --no-build-isolation -e ".[test]"
"$venv/bin/python" -c "import moa, torch, fairseq; print('moa ready: torch', torch.__version__, 'fairseq', fairseq.__version__)" 2>&1 | grep -v tensorboardX
