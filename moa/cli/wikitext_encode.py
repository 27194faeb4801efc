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

import sentencepiece as spm

from moa.data.wikitext import normalise_lines

SPLITS = ("train", "valid", "test")


def _write_atomically(path: str, lines) -> int:
    count = 0
    with open(path + ".tmp", "w", encoding="utf-8") as out:
        for line in lines:
            out.write(line + "\n")
            count += 1
    os.replace(path + ".tmp", path)
    return count


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
                n = _write_atomically(target, normalise_lines(f))
            print(f"{target}: {n} lines", file=sys.stderr)

    prefix = os.path.join(args.out_dir, "spm")
    if not os.path.exists(prefix + ".model"):
        spm.SentencePieceTrainer.train(
            input=os.path.join(args.out_dir, "train.txt"), model_prefix=prefix + ".tmp",
            vocab_size=args.vocab_size, model_type="bpe", character_coverage=1.0,
            input_sentence_size=args.train_sentences, shuffle_input_sentence=True,
            user_defined_symbols=["<unk>"], unk_piece="<spm-unk>", bos_id=-1, eos_id=-1,
            minloglevel=2)
        os.replace(prefix + ".tmp.vocab", prefix + ".vocab")
        os.replace(prefix + ".tmp.model", prefix + ".model")
    model = spm.SentencePieceProcessor(model_file=prefix + ".model")

    for split in SPLITS:
        target = os.path.join(args.out_dir, f"{split}.spm")
        if os.path.exists(target):
            continue
        with open(os.path.join(args.out_dir, f"{split}.txt"), encoding="utf-8") as f:
            n = _write_atomically(target, (" ".join(model.encode(line.rstrip("\n"), out_type=str)) for line in f))
        print(f"{target}: {n} lines", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
