#!/usr/bin/env bash
# Masked-token perplexity of a checkpoint on valid and test (or the subsets named), in natural
# units; fairseq's own "loss" is in bits (base 2). Masks are fairseq's deterministic validation
# masks, so two evaluations of one checkpoint agree exactly.
#
#   examples/mlm/eval-ppl.sh CHECKPOINT DATA_BIN [SUBSET ...]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$repo/.venv/bin" ] && PATH="$repo/.venv/bin:$PATH"
[ $# -ge 2 ] || { sed -n 2,7p "$0"; exit 2; }
exec moa-eval-ppl "$@"
