#!/usr/bin/env bash
# Train an MoA masked LM with fairseq's masked_lm task (RoBERTa's fairseq recipe: Adam, polynomial
# decay, 512-token samples), sized by an effective batch of 256 samples of 512 tokens.
#
#   examples/mlm/train.sh DATA_BIN SAVE_DIR [ARCH] [extra fairseq-train arguments ...]
#
# ARCH defaults to moa_roberta_8k8e128d; GPUS (default: all visible, else CPU) sets --update-freq
# so that GPUS x 16 samples x UPDATE_FREQ stays 256.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$repo/.venv/bin" ] && PATH="$repo/.venv/bin:$PATH"
[ $# -ge 2 ] || { sed -n 2,8p "$0"; exit 2; }
data=$1; save=$2; arch=${3:-moa_roberta_8k8e128d}; shift $(( $# >= 3 ? 3 : 2 ))
gpus=${GPUS:-$(python -c "import torch; print(torch.cuda.device_count())")}
device=()
if [ "$gpus" -eq 0 ]; then gpus=1; device=(--cpu); fi
fairseq-train "$data" --user-dir "$repo/moa" --task masked_lm --criterion moa_masked_lm \
    --arch "$arch" --sample-break-mode complete --tokens-per-sample 512 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps 1e-6 --clip-norm 0.0 --weight-decay 0.01 \
    --lr-scheduler polynomial_decay --lr 0.0005 --warmup-updates 10000 --total-num-update 125000 \
    --max-update 125000 --batch-size 16 --update-freq $(( 16 / gpus > 0 ? 16 / gpus : 1 )) \
    --moa-alpha 0.01 --moa-beta 0.001 --save-dir "$save" --skip-invalid-size-inputs-valid-test \
    --log-format simple --log-interval 100 "${device[@]}" "$@"
