#!/usr/bin/env bash
# Sets up .venv for moa: torch (the CPU 2.13.0 wheel unless a torch is already in .venv),
# fairseq-fixed built without build isolation (about 3 minutes the first time), and this
# project in editable mode with its test tools. Safe to re-run: finished steps are skipped.
set -euo pipefail
cd "$(dirname "$0")"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==${MOA_TORCH_VERSION:-2.13.0}"
pip install numpy cython setuptools wheel
.venv/bin/python -c "import fairseq" 2>/dev/null || pip install --no-build-isolation "fairseq-fixed==0.12.3.1"
pip install --no-build-isolation -e ".[test]"
.venv/bin/python -c "import moa, torch, fairseq; print('moa ready: torch', torch.__version__, 'fairseq', fairseq.__version__)" 2>&1 | grep -v tensorboardX
