#!/usr/bin/env bash
# WikiText-103 for language modelling, fairseq's recipe: the tokenised release's words binarised as
# they are (about 267k words), so perplexities are per word and compare with published ones.
# Download (or --mirror DIR with wikitext-103-v1.zip), verify, unpack and binarise; re-running skips
# finished steps. The options are examples/mlm/prepare-wikitext-103.sh's.
#
#   examples/lm/prepare-wikitext-103.sh [--out DIR] [--mirror DIR] [--url URL] [--sha1 HEX|none] [--workers N]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=wikitext-103-lm
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=$2; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
exec bash "$here/../mlm/prepare-wikitext-103.sh" --words --out "$out" "${args[@]}"
