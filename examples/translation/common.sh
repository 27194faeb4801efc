# Shell functions shared by the translation recipes (sourced, not run).

# binarise SRC TGT SPM_DIR VALID_NAME TEST_NAME DEST WORKERS: fairseq-preprocess --joined-dictionary of
# SPM_DIR/{train,VALID_NAME,TEST_NAME}.{SRC,TGT} into DEST, through DEST.tmp; skipped if DEST is complete.
binarise() {
    local src=$1 tgt=$2 spm=$3 valid=$4 test=$5 dest=$6 workers=$7
    if [ -f "$dest/dict.$src.txt" ]; then
        echo "  $dest already binarised"
        return
    fi
    rm -rf "$dest.tmp"
    fairseq-preprocess --source-lang "$src" --target-lang "$tgt" --joined-dictionary \
        --trainpref "$spm/train" --validpref "$spm/$valid" --testpref "$spm/$test" \
        --destdir "$dest.tmp" --workers "$workers"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
}
