#!/usr/bin/env bash
# Multi30k task 1 (Flickr30k captions) for MoA translation: English -> German or French.
# Takes the raw files from --mirror DIR (plain train.en, val.de, test_2016_flickr.fr, ... or the
# same names with .gz, as ../shared/data/multi30k holds them) or downloads the .gz files; checks
# that source and target line counts agree; learns one joint BPE sentencepiece model on the
# training text; encodes; binarises with fairseq-preprocess --joined-dictionary.
# The plain test references stay in OUT/raw for sacreBLEU. Re-running skips finished steps.
#
#   examples/translation/prepare-multi30k.sh [--pair en-de|en-fr] [--out DIR] [--mirror DIR]
#                                            [--vocab-size N] [--workers N]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$repo/.venv/bin" ] && PATH="$repo/.venv/bin:$PATH"
. "$(dirname "$0")/common.sh"

pair=en-de
out=""
mirror=""
vocab=8000
workers=$(nproc)
base=${MULTI30K_URL:-https://github.com/multi30k/dataset/raw/master/data/task1/raw}
while [ $# -gt 0 ]; do
    case "$1" in
        --pair) pair=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --mirror) mirror=$2; shift 2 ;;
        --vocab-size) vocab=$2; shift 2 ;;
        --workers) workers=$2; shift 2 ;;
        *) echo "prepare-multi30k.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
case "$pair" in en-de|en-fr) ;; *) echo "prepare-multi30k.sh: --pair must be en-de or en-fr" >&2; exit 2 ;; esac
src=${pair%-*}
tgt=${pair#*-}
out=${out:-multi30k-$pair}
splits=(train val test_2016_flickr)

echo "[1/4] raw text"
mkdir -p "$out/raw"
for split in "${splits[@]}"; do
    for lang in "$src" "$tgt"; do
        file="$out/raw/$split.$lang"
        [ -f "$file" ] && continue
        if [ -n "$mirror" ] && [ -f "$mirror/$split.$lang" ]; then
            cp "$mirror/$split.$lang" "$file.tmp"
        else
            fetch=(moa-fetch "$base/$split.$lang.gz" "$out/download/$split.$lang.gz")
            [ -n "$mirror" ] && fetch+=(--mirror "$mirror")
            "${fetch[@]}"
            gzip -t "$out/download/$split.$lang.gz" || { echo "error: $split.$lang.gz is not a complete gzip file" >&2; exit 1; }
            gzip -dc "$out/download/$split.$lang.gz" > "$file.tmp"
        fi
        mv "$file.tmp" "$file"
    done
    n_src=$(wc -l < "$out/raw/$split.$src")
    n_tgt=$(wc -l < "$out/raw/$split.$tgt")
    if [ "$n_src" -ne "$n_tgt" ]; then
        echo "error: mismatched parallel corpora: $split.$src has $n_src lines, $split.$tgt has $n_tgt" >&2
        rm -f "$out/raw/$split.$src" "$out/raw/$split.$tgt"
        exit 1
    fi
    echo "  $split: $n_src sentence pairs"
done

echo "[2/4] joint sentencepiece model ($vocab pieces)"
mkdir -p "$out/spm"
moa-corpus spm-train --model-prefix "$out/spm/spm" --vocab-size "$vocab" "$out/raw/train.$src" "$out/raw/train.$tgt" >/dev/null

echo "[3/4] encode"
pairs=()
for split in "${splits[@]}"; do
    for lang in "$src" "$tgt"; do pairs+=("$out/raw/$split.$lang" "$out/spm/$split.$lang"); done
done
moa-corpus spm-encode --model "$out/spm/spm.model" "${pairs[@]}"

echo "[4/4] binarise"
binarise "$src" "$tgt" "$out/spm" val test_2016_flickr "$out/data-bin" "$workers"
echo "done: $out/data-bin (test references: $out/raw/test_2016_flickr.$tgt)"
