"""``moa-wikitext-encode``: WikiText ``.tokens`` -> normalised text -> sentencepiece pieces.

    moa-wikitext-encode RAW_DIR OUT_DIR [--vocab-size 50000] [--train-sentences 2000000]

Reads ``RAW_DIR/wiki.{train,valid,test}.tokens``, writes ``OUT_DIR/{split}.txt``
(normalised, see :mod:`moa.data.wikitext`), trains a BPE sentencepiece model on
the train split (``OUT_DIR/spm.model``) and writes ``OUT_DIR/{split}.spm``, one
line of space-separated pieces per paragraph, for ``fairseq-preprocess
--only-source``. Each output is written to a temporary name and renamed when
complete; outputs already there are kept (a finished step is skipped).
"""

import argparse
import os
import sys

from moa.data.subword import encode_file, train_sentencepiece, write_lines_atomically
from moa.data.wikitext import normalise_lines

SPLITS = ("train", "valid", "test")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moa-wikitext-encode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--vocab-size", type=int, default=50000)
    parser.add_argument("--train-sentences", type=int, default=2000000,
                        help="paragraphs sampled to train the sentencepiece model")
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)

    for split in SPLITS:
        source = os.path.join(args.raw_dir, f"wiki.{split}.tokens")
        if not os.path.exists(source):
            print(f"moa-wikitext-encode: error: {source} is missing; unpack the WikiText archive first",
                  file=sys.stderr)
            return 1
        target = os.path.join(args.out_dir, f"{split}.txt")
        if not os.path.exists(target):
            with open(source, encoding="utf-8") as f:
                n = write_lines_atomically(target, normalise_lines(f))
            print(f"{target}: {n} lines", file=sys.stderr)

    model = train_sentencepiece([os.path.join(args.out_dir, "train.txt")], os.path.join(args.out_dir, "spm"),
                                args.vocab_size, input_sentence_size=args.train_sentences,
                                shuffle_input_sentence=True, user_defined_symbols=["<unk>"], unk_piece="<spm-unk>")
    for split in SPLITS:
        n = encode_file(model, os.path.join(args.out_dir, f"{split}.txt"), os.path.join(args.out_dir, f"{split}.spm"))
        print(f"{split}.spm: {n} lines", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
