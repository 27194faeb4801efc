#!/usr/bin/env bash
# Builds .device-kit/: the wheels that the GPU check needs and a GPU machine without network access lacks, for a machine
# that reaches no package registry. That machine has Python 3.12 with torch, numpy, sacrebleu,
# sentencepiece, regex, tqdm, PyYAML and pytest, but no fairseq, hydra-core, omegaconf, antlr4 or bitarray.
#   bash benchmarks/dev/device_kit.sh                          # cp312 manylinux wheels (such a machine's Python)
#   bash benchmarks/dev/device_kit.sh --python-version 3.11    # for a rehearsal on this machine's Python
#   bash benchmarks/dev/device_kit.sh --out DIR                # somewhere else than .device-kit
# The versions are the ones this project is tested with. antlr4-python3-runtime 4.9.3 exists only as a
# source archive (pure Python): it is built into a wheel here. benchmarks/dev/gpu_check.sh installs the kit
# by itself where fairseq is missing; by hand (no network, no dependency resolution):
#   python3 -m pip install --no-index --no-deps --target /tmp/moa-kit .device-kit/*.whl
#   PYTHONPATH=/tmp/moa-kit:$PWD PATH=/tmp/moa-kit/bin:$PATH python3 -c "import fairseq, moa"
set -euo pipefail
cd "$(dirname "$0")/../.."
PACKAGES=(fairseq-fixed==0.12.3.1 hydra-core==1.3.2 omegaconf==2.3.0 bitarray==3.12.3 sacremoses==0.2.0)
SOURCE_ONLY=(antlr4-python3-runtime==4.9.3)
LIMIT_MIB=40
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
version=3.12
out=.device-kit
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) version=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        *) echo "usage: bash benchmarks/dev/device_kit.sh [--python-version X.Y] [--out DIR]" >&2; exit 2 ;;
    esac
done
[[ "$version" =~ ^3\.[0-9]+$ ]] || { echo "--python-version: expected X.Y such as 3.12, got '$version'" >&2; exit 2; }
abi=cp${version/./}
work=$(mktemp -d "${TMPDIR:-/tmp}/moa-device-kit.XXXXXX")
trap 'rm -rf "$work"' EXIT
pip() { "$python" -m pip --disable-pip-version-check -q "$@"; }
own=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
for package in "${PACKAGES[@]}"; do
    if ! pip download --no-deps --only-binary=:all: --implementation cp --python-version "$version" --abi "$abi" \
            --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d "$work/kit" "$package" 2>"$work/error"; then
        # no published wheel for this Python (fairseq-fixed has none for 3.11): build one, for this Python only
        if [ "$version" != "$own" ]; then
            cat "$work/error" >&2
            echo "no $package wheel for Python $version on the index, and $python is Python $own: build the kit" \
                 "with a Python $version (PYTHON=...)" >&2
            exit 1
        fi
        pip wheel --no-deps --no-build-isolation -w "$work/kit" "$package"
    fi
done
pip download --no-deps --no-binary=:all: -d "$work/sources" "${SOURCE_ONLY[@]}"
pip wheel --no-deps --no-build-isolation -w "$work/kit" "$work"/sources/*
size=$(du -sm "$work/kit" | cut -f1)
if [ "$size" -gt "$LIMIT_MIB" ]; then
    echo "the kit is $size MiB, more than $LIMIT_MIB: the device call carries at most 64 MiB with the checkout" >&2
    exit 1
fi
cat > "$work/kit/INSTALL" <<EOF
Wheels for Python $version ($abi, manylinux x86_64), made by bash benchmarks/dev/device_kit.sh --python-version $version.
Install with no network and no dependency resolution, from the checkout's root:
  python3 -m pip install --no-index --no-deps --target /tmp/moa-kit $out/*.whl
  export PYTHONPATH=/tmp/moa-kit:\$PWD PATH=/tmp/moa-kit/bin:\$PATH
benchmarks/dev/gpu_check.sh does this by itself where fairseq cannot be imported.
EOF
rm -rf "$out.old"
[ ! -e "$out" ] || mv "$out" "$out.old"
mv "$work/kit" "$out"
rm -rf "$out.old"
echo "device kit: $out ($size MiB) for Python $version:"
ls -1 "$out"
