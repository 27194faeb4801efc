#!/usr/bin/env bash
# WMT14 English->German or English->French for MoA, prepared as the paper's setup:
#   train  En-De: Europarl v7, Common Crawl, News Commentary v9
#          En-Fr: the same three, plus the UN corpus and the 10^9 French-English (giga-fren) corpus
#   valid  newstest2013 (dev.tgz)            test  newstest2014 "full" (test-full.tgz, .sgm), kept whole
# Steps: download (progress, resume, size check; test-full.tgz also against sacreBLEU's md5) or copy
# from --mirror DIR; unpack, reading every archive through (a truncated one is an error); check that
# every parallel corpus has as many source as target lines; Moses punctuation normalisation; one joint
# BPE sentencepiece model (32k pieces En-De, 40k En-Fr) learnt on a sample of the training text;
# encode; drop training pairs longer than --max-len pieces or with a length ratio above --ratio;
# fairseq-preprocess --joined-dictionary. The raw newstest2014 reference stays in OUT/text/test.TGT for
# sacreBLEU (evaluate.sh). Every step writes through temporary names; re-running skips finished steps.
#
#   examples/translation/prepare-wmt14.sh --pair en-de|en-fr [--out DIR] [--mirror DIR]
#       [--vocab-size N] [--spm-sentences N] [--max-len 250] [--ratio 1.5] [--workers N] [--test-md5 HEX|none]
# (prepare-wmt14en2de.sh and prepare-wmt14en2fr.sh call this with the pair set.)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
[ -d "$repo/.venv/bin" ] && PATH="$repo/.venv/bin:$PATH"
me=$(basename "$0")
. "$(dirname "$0")/common.sh"

pair=""
out=""
mirror=""
vocab=""
spm_sentences=10000000
max_len=250
ratio=1.5
workers=$(nproc)
test_md5=""
statmt=${WMT14_BASE_URL:-https://www.statmt.org}
while [ $# -gt 0 ]; do
    case "$1" in
        --pair) pair=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --mirror) mirror=$2; shift 2 ;;
        --vocab-size) vocab=$2; shift 2 ;;
        --spm-sentences) spm_sentences=$2; shift 2 ;;
        --max-len) max_len=$2; shift 2 ;;
        --ratio) ratio=$2; shift 2 ;;
        --workers) workers=$2; shift 2 ;;
        --test-md5) test_md5=$2; shift 2 ;;
        *) echo "$me: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [ -n "$mirror" ] && [ ! -d "$mirror" ]; then
    echo "$me: --mirror $mirror is not a folder" >&2; exit 2
fi

src=en
# Each training corpus: ARCHIVE_URL SOURCE_MEMBER TARGET_MEMBER (paths inside the archive).
case "$pair" in
    en-de)
        tgt=de; vocab=${vocab:-32000}
        corpora=(
            "$statmt/wmt13/training-parallel-europarl-v7.tgz training/europarl-v7.de-en.en training/europarl-v7.de-en.de"
            "$statmt/wmt13/training-parallel-commoncrawl.tgz commoncrawl.de-en.en commoncrawl.de-en.de"
            "$statmt/wmt14/training-parallel-nc-v9.tgz training/news-commentary-v9.de-en.en training/news-commentary-v9.de-en.de"
        ) ;;
    en-fr)
        tgt=fr; vocab=${vocab:-40000}
        corpora=(
            "$statmt/wmt13/training-parallel-europarl-v7.tgz training/europarl-v7.fr-en.en training/europarl-v7.fr-en.fr"
            "$statmt/wmt13/training-parallel-commoncrawl.tgz commoncrawl.fr-en.en commoncrawl.fr-en.fr"
            "$statmt/wmt14/training-parallel-nc-v9.tgz training/news-commentary-v9.fr-en.en training/news-commentary-v9.fr-en.fr"
            "$statmt/wmt13/training-parallel-un.tgz un/undoc.2000.fr-en.en un/undoc.2000.fr-en.fr"
            "$statmt/wmt10/training-giga-fren.tar giga-fren.release2.fixed.en.gz giga-fren.release2.fixed.fr.gz"
        ) ;;
    *) echo "$me: --pair must be en-de or en-fr" >&2; exit 2 ;;
esac
dev_url="$statmt/wmt14/dev.tgz"
test_url="$statmt/wmt14/test-full.tgz"
code=$tgt$src   # deen / fren, as in newstest2014's file names
test_src_member="test-full/newstest2014-$code-src.$src.sgm"
test_ref_member="test-full/newstest2014-$code-ref.$tgt.sgm"
if [ -z "$test_md5" ]; then  # sacreBLEU downloads the same archive and knows its checksum
    test_md5=$(python3 -c "from sacrebleu.dataset import DATASETS; print(DATASETS['wmt14/full'].md5[0])")
fi
out=${out:-wmt14-$pair}
mkdir -p "$out"/{download,orig,text,spm}

fetch() {  # fetch URL [moa-fetch options]: into OUT/download, from --mirror when given
    local url=$1; shift
    local cmd=(moa-fetch "$url" "$out/download/$(basename "$url")" "$@")
    [ -n "$mirror" ] && cmd+=(--mirror "$mirror")
    "${cmd[@]}"
}

unpack_pair() {  # unpack_pair NAME ARCHIVE SRC_MEMBER TGT_MEMBER: OUT/orig/NAME.{src,tgt}, equal line counts
    local name=$1 archive=$2 s_member=$3 t_member=$4
    local s_out="$out/orig/$name.$src" t_out="$out/orig/$name.$tgt"
    if [ ! -f "$s_out" ] || [ ! -f "$t_out" ]; then
        rm -rf "$out/orig/$name.tmp"
        moa-corpus unpack "$archive" "$out/orig/$name.tmp" "$s_member" "$t_member" >/dev/null \
            || { rm -rf "$out/orig/$name.tmp"; exit 1; }
        local s_file t_file
        s_file=$(basename "${s_member%.gz}"); t_file=$(basename "${t_member%.gz}")
        local n_s n_t
        n_s=$(wc -l < "$out/orig/$name.tmp/$s_file"); n_t=$(wc -l < "$out/orig/$name.tmp/$t_file")
        if [ "$n_s" -ne "$n_t" ]; then
            echo "error: mismatched parallel corpora in $(basename "$archive"): $s_member has $n_s lines, $t_member has $n_t" >&2
            rm -rf "$out/orig/$name.tmp"; exit 1
        fi
        mv "$out/orig/$name.tmp/$s_file" "$s_out"; mv "$out/orig/$name.tmp/$t_file" "$t_out"
        rm -rf "$out/orig/$name.tmp"
    fi
    echo "  $name: $(wc -l < "$s_out") sentence pairs"
}

check_pair() {  # check_pair A B: the same number of lines, or stop naming both
    local n_a n_b
    n_a=$(wc -l < "$1"); n_b=$(wc -l < "$2")
    if [ "$n_a" -ne "$n_b" ]; then echo "error: $1 has $n_a lines, $2 has $n_b" >&2; exit 1; fi
}

echo "[1/6] download (or copy from --mirror) and verify"
for spec in "${corpora[@]}"; do
    read -r url _ _ <<< "$spec"
    fetch "$url"
done
fetch "$dev_url"
if [ "$test_md5" = none ]; then fetch "$test_url"; else fetch "$test_url" --md5 "$test_md5"; fi

echo "[2/6] unpack, check parallel line counts"
train_src=(); train_tgt=()
for spec in "${corpora[@]}"; do
    read -r url s_member t_member <<< "$spec"
    name=$(basename "${s_member%.gz}"); name=${name%.$src}
    unpack_pair "$name" "$out/download/$(basename "$url")" "$s_member" "$t_member"
    train_src+=("$out/orig/$name.$src"); train_tgt+=("$out/orig/$name.$tgt")
done
unpack_pair newstest2013 "$out/download/$(basename "$dev_url")" "dev/newstest2013.$src" "dev/newstest2013.$tgt"
if [ ! -f "$out/orig/newstest2014.$tgt" ]; then
    rm -rf "$out/orig/sgm.tmp"
    moa-corpus unpack "$out/download/$(basename "$test_url")" "$out/orig/sgm.tmp" "$test_src_member" "$test_ref_member" \
        >/dev/null || { rm -rf "$out/orig/sgm.tmp"; exit 1; }
    moa-corpus sgm "$out/orig/sgm.tmp/$(basename "$test_src_member")" "$out/orig/sgm.tmp/$(basename "$test_ref_member")" \
        "$out/orig/newstest2014.$src" "$out/orig/newstest2014.$tgt.tmp"
    mv "$out/orig/newstest2014.$tgt.tmp" "$out/orig/newstest2014.$tgt"
    rm -rf "$out/orig/sgm.tmp"
fi
echo "  newstest2014: $(wc -l < "$out/orig/newstest2014.$tgt") segments"

echo "[3/6] normalise punctuation"
normalize() {  # normalize LANG OUT IN...
    local lang=$1 target=$2; shift 2
    [ -f "$target" ] || moa-corpus normalize --lang "$lang" --workers "$workers" "$target" "$@"
}
normalize "$src" "$out/text/train.$src" "${train_src[@]}"
normalize "$tgt" "$out/text/train.$tgt" "${train_tgt[@]}"
normalize "$src" "$out/text/valid.$src" "$out/orig/newstest2013.$src"
normalize "$tgt" "$out/text/valid.$tgt" "$out/orig/newstest2013.$tgt"
normalize "$src" "$out/text/test.$src" "$out/orig/newstest2014.$src"
[ -f "$out/text/test.$tgt" ] || cp "$out/orig/newstest2014.$tgt" "$out/text/test.$tgt"  # the raw reference
for split in train valid test; do check_pair "$out/text/$split.$src" "$out/text/$split.$tgt"; done

echo "[4/6] joint sentencepiece model ($vocab pieces, learnt on up to $spm_sentences sampled lines)"
moa-corpus spm-train --model-prefix "$out/spm/spm" --vocab-size "$vocab" --input-sentence-size "$spm_sentences" \
    "$out/text/train.$src" "$out/text/train.$tgt" >/dev/null

echo "[5/6] encode; filter training pairs (1..$max_len pieces, length ratio <= $ratio); valid and test stay whole"
moa-corpus spm-encode --model "$out/spm/spm.model" \
    "$out/text/train.$src" "$out/spm/train.all.$src" "$out/text/train.$tgt" "$out/spm/train.all.$tgt" \
    "$out/text/valid.$src" "$out/spm/valid.$src" "$out/text/valid.$tgt" "$out/spm/valid.$tgt" \
    "$out/text/test.$src" "$out/spm/test.$src" "$out/text/test.$tgt" "$out/spm/test.$tgt"
if [ ! -f "$out/spm/train.$tgt" ]; then
    moa-corpus filter --max-len "$max_len" --ratio "$ratio" "$out/spm/train.all.$src" "$out/spm/train.all.$tgt" \
        "$out/spm/train.$src" "$out/spm/train.$tgt"
fi

echo "[6/6] binarise"
binarise "$src" "$tgt" "$out/spm" valid test "$out/data-bin" "$workers"
echo "done: $out/data-bin ($(wc -l < "$out/spm/train.$src") training pairs, $(wc -l < "$out/text/test.$tgt") test sentences;" \
     "raw newstest2014 reference: $out/text/test.$tgt)"
