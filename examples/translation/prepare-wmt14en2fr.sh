#!/usr/bin/env bash
# WMT14 English->French for MoA: prepare-wmt14.sh --pair en-fr (see there for the steps and options).
#   examples/translation/prepare-wmt14en2fr.sh [--out DIR] [--mirror DIR] [--vocab-size N] ...
exec "$(dirname "$0")/prepare-wmt14.sh" --pair en-fr "$@"
