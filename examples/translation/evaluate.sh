#!/usr/bin/env bash
# Evaluate an MoA translation model as the paper does, and as sacreBLEU does:
#   1. average the last N epoch checkpoints (moa-average-checkpoints, safe loading);
#   2. fairseq-generate on the whole test set: beam 4, length penalty 0.6, --required-batch-size-multiple 1
#      (fairseq would otherwise drop a tail batch), sentencepiece removed; the count is checked;
#   3. moa-score: (a) detokenised sacreBLEU against the raw references, with its signature, and
#      (b) the paper's tokenised BLEU with compound splitting (see moa_tools/scoring.py).
#
#   examples/translation/evaluate.sh --pair en-de|en-fr [--data DIR] --checkpoints DIR [--last 10]
#       [--ref FILE] [--subset test] [--max-tokens 8192] [--cpu] [-- extra fairseq-generate arguments]
# --data is prepare-wmt14.sh's folder (data-bin and text/test.TGT); for another corpus pass its data-bin
# as --data and its raw references as --ref (e.g. multi30k-en-de/raw/test_2016_flickr.de).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$repo/.venv/bin" ] && PATH="$repo/.venv/bin:$PATH"
me=$(basename "$0")

pair=""
data=""
checkpoints=""
last=10
ref=""
subset=test
max_tokens=8192
device=()
while [ $# -gt 0 ]; do
    case "$1" in
        --pair) pair=$2; shift 2 ;;
        --data) data=$2; shift 2 ;;
        --checkpoints) checkpoints=$2; shift 2 ;;
        --last) last=$2; shift 2 ;;
        --ref) ref=$2; shift 2 ;;
        --subset) subset=$2; shift 2 ;;
        --max-tokens) max_tokens=$2; shift 2 ;;
        --cpu) device=(--cpu); shift ;;
        --) shift; break ;;
        *) echo "$me: unknown argument $1 (fairseq-generate arguments go after --)" >&2; exit 2 ;;
    esac
done
case "$pair" in en-de|en-fr) ;; *) echo "$me: --pair must be en-de or en-fr" >&2; exit 2 ;; esac
tgt=${pair#en-}
data=${data:-wmt14-$pair}
data_bin=$data
[ -f "$data_bin/dict.en.txt" ] || data_bin="$data/data-bin"
ref=${ref:-$data/text/test.$tgt}
for need in "$data_bin/dict.en.txt" "$ref"; do
    [ -f "$need" ] || { echo "$me: $need does not exist (see --data and --ref)" >&2; exit 2; }
done
[ -d "$checkpoints" ] || { echo "$me: --checkpoints $checkpoints is not a folder" >&2; exit 2; }

averaged="$checkpoints/averaged-last$last.pt"
echo "[1/3] average the last $last epoch checkpoints -> $averaged"
moa-average-checkpoints --inputs "$checkpoints" --num-epoch-checkpoints "$last" --output "$averaged"

log="$checkpoints/generate-$subset.log"
echo "[2/3] translate $subset: beam 4, length penalty 0.6 -> $log"
fairseq-generate "$data_bin" --user-dir "$repo/moa" "${device[@]}" --task translation --source-lang en \
    --target-lang "$tgt" --gen-subset "$subset" --path "$averaged" --beam 4 --lenpen 0.6 \
    --max-tokens "$max_tokens" --required-batch-size-multiple 1 --post-process sentencepiece "$@" > "$log"

echo "[3/3] score against $ref"
moa-score "$log" "$ref" --lang "$tgt" --json "$checkpoints/bleu-$subset.json"
