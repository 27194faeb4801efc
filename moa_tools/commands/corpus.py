"""``moa-corpus``: the text steps of the recipes (:mod:`moa_tools.corpora`, :mod:`moa_tools.subword`).

    moa-corpus unpack ARCHIVE DEST_DIR MEMBER [MEMBER ...]
    moa-corpus sgm SOURCE.sgm REFERENCE.sgm SOURCE_OUT REFERENCE_OUT
    moa-corpus normalize --lang L [--workers N] OUT IN [IN ...]
    moa-corpus filter [--min-len 1] [--max-len 250] [--ratio 1.5] SRC_IN TGT_IN SRC_OUT TGT_OUT
    moa-corpus wikitext IN.tokens OUT.txt
    moa-corpus spm-train --model-prefix DIR/spm --vocab-size N [--input-sentence-size N]
                         [--keep-symbol S ...] FILE [FILE ...]
    moa-corpus spm-encode --model DIR/spm.model IN OUT [IN OUT ...]

Every output is written through a temporary name, so an interrupted step leaves nothing
half-written; the sentencepiece steps keep outputs already there, so a recipe that runs them
again skips finished work.
"""

import argparse
import sys

from moa_tools import run_tool
from moa_tools.corpora import extract_sgm_pair, filter_pairs, normalize_files, unpack
from moa_tools.subword import encode_file, train_sentencepiece
from moa_tools.textio import read_lines, write_lines_atomically
from moa_tools.wikitext import normalise_lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moa-corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("unpack", help="extract named members of a .tgz/.tar, verifying the whole archive")
    p.add_argument("archive")
    p.add_argument("dest_dir")
    p.add_argument("members", nargs="+")
    p = sub.add_parser("sgm", help="plain text of an aligned WMT source/reference .sgm pair")
    for name in ("source_sgm", "reference_sgm", "source_out", "reference_out"):
        p.add_argument(name)
    p = sub.add_parser("normalize", help="Moses punctuation normalisation, inputs concatenated")
    p.add_argument("--lang", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("output")
    p.add_argument("inputs", nargs="+")
    p = sub.add_parser("filter", help="drop pairs by length and length ratio (in subword pieces)")
    p.add_argument("--min-len", type=int, default=1)
    p.add_argument("--max-len", type=int, default=250)
    p.add_argument("--ratio", type=float, default=1.5)
    for name in ("source_in", "target_in", "source_out", "target_out"):
        p.add_argument(name)
    p = sub.add_parser("wikitext", help="WikiText's tokenised release as plain text, one paragraph a line")
    p.add_argument("input")
    p.add_argument("output")
    p = sub.add_parser("spm-train", help="train a joint BPE sentencepiece model (kept if already there)")
    p.add_argument("--model-prefix", required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--input-sentence-size", type=int, default=0,
                   help="learn from this many randomly sampled lines (0: all); for corpora of millions of lines")
    p.add_argument("--keep-symbol", action="append", default=[], metavar="S",
                   help="a string kept as one piece, never split (WikiText's <unk>); repeatable")
    p.add_argument("inputs", nargs="+")
    p = sub.add_parser("spm-encode", help="encode files to space-separated pieces (outputs already there are kept)")
    p.add_argument("--model", required=True)
    p.add_argument("pairs", nargs="+", metavar="IN OUT")
    return parser


def _main(argv) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "unpack":
        for path in unpack(args.archive, args.members, args.dest_dir):
            print(path)
    elif args.command == "sgm":
        n = extract_sgm_pair(args.source_sgm, args.reference_sgm, args.source_out, args.reference_out)
        print(f"{n} segments", file=sys.stderr)
    elif args.command == "normalize":
        n = normalize_files(args.lang, args.inputs, args.output, args.workers)
        print(f"{args.output}: {n} lines", file=sys.stderr)
    elif args.command == "filter":
        kept, total = filter_pairs(args.source_in, args.target_in, args.source_out, args.target_out,
                                   args.min_len, args.max_len, args.ratio)
        print(f"kept {kept} of {total} pairs ({total - kept} removed by length or ratio)", file=sys.stderr)
    elif args.command == "wikitext":
        n = write_lines_atomically(args.output, normalise_lines(read_lines(args.input)))
        print(f"{args.output}: {n} lines", file=sys.stderr)
    elif args.command == "spm-train":
        print(train_sentencepiece(args.inputs, args.model_prefix, args.vocab_size, args.input_sentence_size,
                                  args.keep_symbol))
    else:
        if len(args.pairs) % 2:
            parser.error("spm-encode takes IN OUT pairs")
        for source, target in zip(args.pairs[::2], args.pairs[1::2]):
            print(f"{target}: {encode_file(args.model, source, target)} lines", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_tool("moa-corpus", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
