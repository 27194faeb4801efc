"""``moa-corpus``: the text steps of the WMT recipes (see :mod:`moa.data.parallel`).

    moa-corpus unpack ARCHIVE DEST_DIR MEMBER [MEMBER ...]
    moa-corpus sgm SOURCE.sgm REFERENCE.sgm SOURCE_OUT REFERENCE_OUT
    moa-corpus normalize --lang L [--workers N] OUT IN [IN ...]
    moa-corpus filter [--min-len 1] [--max-len 250] [--ratio 1.5] SRC_IN TGT_IN SRC_OUT TGT_OUT

Every output is written through a temporary name, so an interrupted step leaves nothing half-written.
"""

import argparse
import sys

from moa.data.parallel import CorpusError, extract_sgm_pair, filter_pairs, normalize_files, unpack


def main(argv=None) -> int:
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
    args = parser.parse_args(argv)
    try:
        if args.command == "unpack":
            for path in unpack(args.archive, args.members, args.dest_dir):
                print(path)
        elif args.command == "sgm":
            n = extract_sgm_pair(args.source_sgm, args.reference_sgm, args.source_out, args.reference_out)
            print(f"{n} segments", file=sys.stderr)
        elif args.command == "normalize":
            n = normalize_files(args.lang, args.inputs, args.output, args.workers)
            print(f"{args.output}: {n} lines", file=sys.stderr)
        else:
            kept, total = filter_pairs(args.source_in, args.target_in, args.source_out, args.target_out,
                                       args.min_len, args.max_len, args.ratio)
            print(f"kept {kept} of {total} pairs ({total - kept} removed by length or ratio)", file=sys.stderr)
    except (CorpusError, OSError) as e:
        print(f"moa-corpus: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
