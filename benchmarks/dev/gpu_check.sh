#!/usr/bin/env bash
# The GPU check in one command, on a machine as it is (about 5 minutes on one GPU; --quick under 2):
#   bash benchmarks/dev/gpu_check.sh [--quick] [--no-tests] [--out DIR] [--kit DIR]
# --quick: tests/gpu without its slow (CLI) tests, and the table at 1,024 tokens: a first pass that finds
# a broken setup in seconds. --no-tests: the measurements alone (about 7 minutes on one GPU, whole models
# included).
# 1. tests/gpu: CUDA equals CPU (forward, backward, decoding), the grouped expert projections equal the
#    loop, a MoA training step without synchronisation, bf16 and fp16 training and generation via the CLIs;
# 2. benchmarks.dev.gpu_check: the synchronisations of one training step and the bf16 table of MoA modules at
#    8,192 tokens (loop, grouped GEMM, dense attention of the same active width), also when a test of 1.
#    failed (the script then exits with pytest's status), so that one call on a GPU machine brings both.
# Python: $PYTHON, else .venv/bin/python, else python3. Where that Python cannot import fairseq (a
# GPU machine without network access: no registry, no fairseq), the wheels of --kit (default .device-kit/, made by
# bash benchmarks/dev/device_kit.sh) are
# installed into a temporary folder with pip --no-index --no-deps --target, and this checkout's moa is
# imported from the checkout. Everything a reader needs lands in one folder, --out (default
# benchmarks/speed/results/gpu on a GPU, a temporary folder on a CPU): check.log (all output), environment.txt,
# gpu-check.json and gpu-check.md. Without CUDA, tests/gpu skips and the measurements run on the CPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
quick=()
tests="slow or not slow"
out=
kit_wheels=.device-kit
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=(--quick); tests="not slow"; shift ;;
        --no-tests) tests=; shift ;;
        --out) out=${2:?--out needs a folder}; shift 2 ;;
        --kit) kit_wheels=${2:?--kit needs a folder}; shift 2 ;;
        *) echo "usage: bash benchmarks/dev/gpu_check.sh [--quick] [--no-tests] [--out DIR] [--kit DIR]" >&2; exit 2 ;;
    esac
done
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
if ! "$python" -c "import fairseq" >/dev/null 2>&1; then
    if ! ls "$kit_wheels"/*.whl >/dev/null 2>&1; then
        echo "$python cannot import fairseq and $kit_wheels holds no wheels: run bash benchmarks/dev/device_kit.sh" \
             "on a machine with a package registry (or bash setup.sh here)" >&2
        exit 1
    fi
    kit=$(mktemp -d "${TMPDIR:-/tmp}/moa-kit.XXXXXX")
    trap 'rm -rf "$kit"' EXIT
    "$python" -m pip install --disable-pip-version-check -q --no-index --no-deps --target "$kit" "$kit_wheels"/*.whl
    export PYTHONPATH="$kit:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$kit/bin:$PATH"
    echo "installed $kit_wheels into $kit (PYTHONPATH, PATH)"
fi
if "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    device=cuda
    out=${out:-benchmarks/speed/results/gpu}
else
    device=cpu
    out=${out:-$(mktemp -d "${TMPDIR:-/tmp}/moa-gpu-check.XXXXXX")}
    echo "No CUDA device: tests/gpu will skip, and the measurements run on the CPU." >&2
fi
mkdir -p "$out"
exec > >(tee "$out/check.log") 2>&1
{
    "$python" -c "import sys, torch, numpy, fairseq; print('python', sys.version.split()[0], sys.executable); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'fairseq', fairseq.__version__); print('device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
    git rev-parse HEAD 2>/dev/null || echo "commit: not a git checkout"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
} > "$out/environment.txt" 2>&1 || true
cat "$out/environment.txt"
started=$SECONDS
tests_rc=0
if [ -n "$tests" ]; then "$python" -m pytest -q -p no:cacheprovider -m "$tests" tests/gpu || tests_rc=$?; fi
echo "tests/gpu: $((SECONDS - started)) s"
started=$SECONDS
"$python" -m benchmarks.dev.gpu_check --device "$device" "${quick[@]}" --out "$out/gpu-check.json"
echo "benchmarks.dev.gpu_check: $((SECONDS - started)) s; results in $out"
if [ "$tests_rc" != 0 ]; then
    echo "tests/gpu FAILED (exit $tests_rc): see $out/check.log" >&2
    exit "$tests_rc"
fi
