#!/usr/bin/env bash
# WikiText-103 for masked-LM training: download (or take from --mirror), verify, unpack,
# normalise the tokenised release, train a BPE sentencepiece model on the train split,
# encode, and binarise with fairseq-preprocess --only-source. Re-running skips finished steps.
# --words binarises the tokenised release's words as they are instead (fairseq's language-model
# recipe, whose perplexities are per word; examples/lm/prepare-wikitext-103.sh).
#
#   examples/mlm/prepare-wikitext-103.sh [--out DIR] [--mirror DIR] [--url URL] [--sha1 HEX|none]
#                                        [--vocab-size N] [--workers N] [--words]
#
# The original S3 address answers 403 now; the default URL is WikiText's own host, and
# --url or WIKITEXT103_URL overrides it. --mirror DIR takes wikitext-103-v1.zip from DIR
# instead of the network. The archive's SHA-1 is checked (--sha1 none to skip, for a
# repackaged archive).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$repo/.venv/bin" ] && PATH="$repo/.venv/bin:$PATH"

out=wikitext-103
url=${WIKITEXT103_URL:-https://wikitext.smerity.com/wikitext-103-v1.zip}
sha1=0aec09a7537b58d4bb65362fee27650eeaba625a
mirror=""
vocab=50000
workers=$(nproc)
words=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=$2; shift 2 ;;
        --mirror) mirror=$2; shift 2 ;;
        --url) url=$2; shift 2 ;;
        --sha1) sha1=$2; shift 2 ;;
        --vocab-size) vocab=$2; shift 2 ;;
        --workers) workers=$2; shift 2 ;;
        --words) words=1; shift ;;
        *) echo "prepare-wikitext-103.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

archive="$out/download/$(basename "$url")"
fetch=(moa-fetch "$url" "$archive")
[ "$sha1" != none ] && fetch+=(--sha1 "$sha1")
[ -n "$mirror" ] && fetch+=(--mirror "$mirror")
echo "[1/4] fetch $(basename "$url")"
"${fetch[@]}"

echo "[2/4] unpack"
if [ ! -f "$out/raw/wiki.test.tokens" ]; then
    python -m zipfile -t "$archive" >/dev/null || { echo "error: $archive is not a complete zip archive" >&2; exit 1; }
    rm -rf "$out/raw.tmp" && mkdir -p "$out/raw.tmp"
    python -m zipfile -e "$archive" "$out/raw.tmp"
    for split in train valid test; do
        found=$(find "$out/raw.tmp" -name "wiki.$split.tokens" | head -n 1)
        [ -n "$found" ] || { echo "error: $archive holds no wiki.$split.tokens" >&2; exit 1; }
        mv "$found" "$out/raw.tmp/wiki.$split.tokens"
    done
    rm -rf "$out/raw" && mkdir -p "$out/raw"
    mv "$out/raw.tmp"/wiki.*.tokens "$out/raw/" && rm -rf "$out/raw.tmp"
else
    echo "  $out/raw already unpacked"
fi

if [ "$words" -eq 1 ]; then
    echo "[3/4] the tokenised words as they are (no subwords)"
    split_file() { echo "$out/raw/wiki.$1.tokens"; }
else
    echo "[3/4] normalise and sentencepiece-encode (vocabulary $vocab)"
    split_file() { echo "$out/spm/$1.spm"; }
    mkdir -p "$out/spm"
    for split in train valid test; do  # the @-markers undone, headings without their = markers
        [ -f "$out/spm/$split.txt" ] || moa-corpus wikitext "$out/raw/wiki.$split.tokens" "$out/spm/$split.txt"
    done
    moa-corpus spm-train --model-prefix "$out/spm/spm" --vocab-size "$vocab" --input-sentence-size 2000000 \
        --keep-symbol '<unk>' "$out/spm/train.txt" >/dev/null
    moa-corpus spm-encode --model "$out/spm/spm.model" \
        "$out/spm/train.txt" "$out/spm/train.spm" "$out/spm/valid.txt" "$out/spm/valid.spm" "$out/spm/test.txt" "$out/spm/test.spm"
fi

echo "[4/4] binarise"
if [ ! -f "$out/data-bin/dict.txt" ]; then
    rm -rf "$out/data-bin.tmp"
    fairseq-preprocess --only-source --trainpref "$(split_file train)" --validpref "$(split_file valid)" \
        --testpref "$(split_file test)" --destdir "$out/data-bin.tmp" --workers "$workers"
    rm -rf "$out/data-bin" && mv "$out/data-bin.tmp" "$out/data-bin"
else
    echo "  $out/data-bin already binarised"
fi
echo "done: $out/data-bin"
