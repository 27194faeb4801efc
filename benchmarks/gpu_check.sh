#!/usr/bin/env bash
# The GPU check in one command, for the first machine with a CUDA device (about 8 minutes on one GPU):
#   bash benchmarks/gpu_check.sh            # tests/gpu, then python -m benchmarks.gpu_check
#   bash benchmarks/gpu_check.sh --quick    # the same at a small size (what the slow tests run on a CPU)
# 1. tests/gpu: CUDA equals CPU (forward, backward, decoding), the grouped expert projections equal the
#    loop, a MoA training step without synchronisation, bf16 and fp16 training and generation via the CLIs;
# 2. benchmarks.gpu_check: the synchronisations of one training step and the bf16 table of MoA modules at
#    8,192 tokens (loop, grouped GEMM, dense attention of the same active width), written to
#    benchmarks/results/gpu/ on a GPU. Without CUDA, tests/gpu skips and the measurements run on the CPU
#    (host reads counted in place of synchronisations), written to a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
quick=()
for arg in "$@"; do
    case "$arg" in
        --quick) quick=(--quick) ;;
        *) echo "usage: bash benchmarks/gpu_check.sh [--quick]" >&2; exit 2 ;;
    esac
done
if "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    device=cuda
    mkdir -p benchmarks/results/gpu
    "$python" -c "import torch; print('GPU:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
else
    device=cpu
    echo "No CUDA device: tests/gpu will skip, and the measurements run on the CPU." >&2
fi
if [ "$device" = cuda ]; then
    "$python" -m pytest -q -m "slow or not slow" tests/gpu 2>&1 | tee benchmarks/results/gpu/tests.txt
else
    "$python" -m pytest -q -m "slow or not slow" tests/gpu
fi
"$python" -m benchmarks.gpu_check --device "$device" "${quick[@]}"
