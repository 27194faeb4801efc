"""``moa-fetch``: download one file for a recipe: progress, resume, verification, offline mirror.

    moa-fetch URL DEST [--sha1 HEX | --sha256 HEX | --md5 HEX] [--size BYTES] [--mirror DIR]

DEST already there and verified: nothing to do. ``--mirror DIR`` holding a file named like the
URL's last part: copied from there, no network. Otherwise downloaded to ``DEST.part`` with
progress, resumed after an interruption, verified, and only then renamed to DEST.
"""

import argparse
import sys

from moa_tools import run_tool
from moa_tools.fetch import fetch


def _main(argv) -> int:
    parser = argparse.ArgumentParser(prog="moa-fetch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("dest")
    parser.add_argument("--size", type=int, help="expected size in bytes")
    for algorithm in ("sha1", "sha256", "md5"):
        parser.add_argument(f"--{algorithm}", help=f"expected {algorithm} hex digest")
    parser.add_argument("--mirror", help="a local folder to take the file from instead of the network")
    args = parser.parse_args(argv)
    checksums = {a: getattr(args, a) for a in ("sha1", "sha256", "md5") if getattr(args, a)}
    how = fetch(args.url, args.dest, args.size, checksums, args.mirror)
    print(f"{args.dest}: {how}, verified", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return run_tool("moa-fetch", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
