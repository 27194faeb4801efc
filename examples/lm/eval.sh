#!/usr/bin/env bash
# Perplexity of a language-model checkpoint on the test split (or SUBSET), as fairseq reports it for
# WikiText-103: 512-token blocks scored with 400 tokens of context before each (--context-window).
#
#   examples/lm/eval.sh CHECKPOINT DATA_BIN [SUBSET] [extra fairseq-eval-lm arguments ...]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$repo/.venv/bin" ] && PATH="$repo/.venv/bin:$PATH"
[ $# -ge 2 ] || { sed -n 2,5p "$0"; exit 2; }
checkpoint=$1; data=$2; subset=${3:-test}; shift $(( $# >= 3 ? 3 : 2 ))
cpu=()
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || cpu=(--cpu)
exec fairseq-eval-lm "$data" --user-dir "$repo/moa" --path "$checkpoint" --task language_modeling \
    --gen-subset "$subset" --tokens-per-sample 512 --context-window 400 --batch-size 2 "${cpu[@]}" "$@"
