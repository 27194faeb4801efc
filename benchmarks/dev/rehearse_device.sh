#!/usr/bin/env bash
# A rehearsal, on this CPU, of the GPU check as a GPU machine without network access runs it, and of the fast tests on another
# torch (not in CI: torch 2.11 from the package index is a CUDA build of about 4.6 GB).
#   bash benchmarks/dev/rehearse_device.sh                  # torch 2.11.0, a Python 3.12 H200 machine's
#   bash benchmarks/dev/rehearse_device.sh --torch 2.13.0
# 1. A fresh venv with only that torch and what such a machine's image also holds (numpy, pytest,
#    sacrebleu, sentencepiece, regex, tqdm, PyYAML, packaging, matplotlib, scikit-learn): no fairseq, hydra-core,
#    omegaconf, antlr4 or bitarray, and this project not installed.
# 2. The device kit for this Python (bash benchmarks/dev/device_kit.sh --python-version of this Python), then
#    bash benchmarks/dev/gpu_check.sh --quick with that venv's Python: the kit installed with
#    pip --no-index --no-deps --target, every import and every step short of CUDA.
# 3. bash setup.sh into the same venv (MOA_VENV; it keeps the torch it finds) and README's fast tests.
# Works in benchmarks/work-rehearsal/torch-VERSION/ (ignored; delete it afterwards: several GB).
set -euo pipefail
cd "$(dirname "$0")/../.."
torch_version=2.11.0
while [ $# -gt 0 ]; do
    case "$1" in
        --torch) torch_version=${2:?--torch needs a version}; shift 2 ;;
        *) echo "usage: bash benchmarks/dev/rehearse_device.sh [--torch VERSION]" >&2; exit 2 ;;
    esac
done
work=benchmarks/work-rehearsal/torch-$torch_version
venv=$work/venv
python=${PYTHON:-python3}
started=$SECONDS
step() { echo; echo "== $* ($((SECONDS - started)) s)"; }
step "1. a venv with torch $torch_version and that image's other packages only"
rm -rf "$work"
mkdir -p "$work"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip --disable-pip-version-check -q install "torch==$torch_version" numpy pytest sacrebleu \
    sentencepiece regex tqdm pyyaml packaging matplotlib scikit-learn
if "$venv/bin/python" -c "import fairseq" 2>/dev/null; then echo "the venv imports fairseq: not a rehearsal" >&2; exit 1; fi
step "2. the device kit for Python $("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])'), then the GPU check's quick pass"
bash benchmarks/dev/device_kit.sh --python-version "$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
    --out "$work/kit"
PYTHON="$venv/bin/python" bash benchmarks/dev/gpu_check.sh --quick --kit "$work/kit" --out "$work/gpu-check"
ls "$work/gpu-check"
step "3. setup.sh into the venv (keeping torch $torch_version), then the fast tests"
MOA_VENV="$venv" bash setup.sh
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests
step "the rehearsal passed with torch $torch_version"
