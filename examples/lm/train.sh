#!/usr/bin/env bash
# Train a decoder-only LM with fairseq's language_modeling task and fairseq's WikiText-103 recipe
# (Adam, inverse square-root schedule, 512-token blocks, 32,768 tokens per update), the routers'
# auxiliary losses through moa_cross_entropy.
#
#   examples/lm/train.sh DATA_BIN SAVE_DIR [ARCH] [extra fairseq-train arguments ...]
#
# ARCH defaults to moh_lm_base (twin: transformer_lm_gpt, which trains with cross_entropy here);
# GPUS (default: all visible, else CPU) sets --update-freq so that GPUS x 2,048 tokens x UPDATE_FREQ
# stays 32,768. A trained transformer_lm converts to MoH with moa-convert-moh.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$repo/.venv/bin" ] && PATH="$repo/.venv/bin:$PATH"
[ $# -ge 2 ] || { sed -n 2,10p "$0"; exit 2; }
data=$1; save=$2; arch=${3:-moh_lm_base}; shift $(( $# >= 3 ? 3 : 2 ))
gpus=${GPUS:-$(python -c "import torch; print(torch.cuda.device_count())")}
device=()
if [ "$gpus" -eq 0 ]; then gpus=1; device=(--cpu); fi
criterion=moa_cross_entropy
case "$arch" in transformer_lm*) criterion=cross_entropy ;; esac
fairseq-train "$data" --user-dir "$repo/moa" --task language_modeling --criterion "$criterion" \
    --arch "$arch" --share-decoder-input-output-embed --sample-break-mode none --tokens-per-sample 512 \
    --optimizer adam --adam-betas '(0.9, 0.98)' --weight-decay 0.01 --clip-norm 0.0 \
    --lr 0.0005 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 \
    --max-tokens 2048 --update-freq $(( 16 / gpus > 0 ? 16 / gpus : 1 )) --max-update 50000 \
    --save-dir "$save" --log-format simple --log-interval 100 "${device[@]}" "$@"
