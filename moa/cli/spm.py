"""``moa-spm``: train a joint BPE sentencepiece model, and encode files with it.

    moa-spm train --model-prefix DIR/spm --vocab-size 8000 [--input-sentence-size N] FILE [FILE ...]
    moa-spm encode --model DIR/spm.model IN OUT [IN OUT ...]

Both steps write through temporary names and keep outputs already there, so a
recipe that calls them again skips finished work.
"""

import argparse
import sys

from moa.data.subword import encode_file, train_sentencepiece


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moa-spm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train")
    train.add_argument("--model-prefix", required=True)
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--input-sentence-size", type=int, default=0,
                       help="learn from this many randomly sampled lines (0: all); for corpora of millions of lines")
    train.add_argument("inputs", nargs="+")
    encode = sub.add_parser("encode")
    encode.add_argument("--model", required=True)
    encode.add_argument("pairs", nargs="+", metavar="IN OUT")
    args = parser.parse_args(argv)
    if args.command == "train":
        sample = dict(input_sentence_size=args.input_sentence_size, shuffle_input_sentence=True) \
            if args.input_sentence_size else {}
        print(train_sentencepiece(args.inputs, args.model_prefix, args.vocab_size, **sample))
        return 0
    if len(args.pairs) % 2:
        parser.error("encode takes IN OUT pairs")
    for source, target in zip(args.pairs[::2], args.pairs[1::2]):
        print(f"{target}: {encode_file(args.model, source, target)} lines", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
