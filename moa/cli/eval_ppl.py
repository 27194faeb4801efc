"""``moa-eval-ppl``: masked-token perplexity of an MLM checkpoint, in natural units.

    moa-eval-ppl CHECKPOINT DATA_BIN [SUBSET ...] [-- extra fairseq-validate arguments]

Runs ``fairseq-validate --task masked_lm`` for each subset (default: valid test).
fairseq logs ``loss`` in bits per masked token (base 2) and ``ppl = 2 ** loss``;
this prints the mean negative log-likelihood in nats (``loss * ln 2``) and the
perplexity ``exp(nats)``, which is the same number as fairseq's ``ppl``. The
masks are fairseq's validation masks (seeded by the checkpoint's seed), so two
evaluations of one checkpoint agree exactly.
"""

import argparse
import math
import os
import re
import subprocess
import sys

from moa.cli import USER_DIR, cli

_RESULT = re.compile(r"valid on '([^']+)' subset \| loss ([\d.]+)")


def evaluate(checkpoint: str, data_bin: str, subset: str, extra=()) -> float:
    """fairseq-validate's masked-token loss on ``subset``, in bits per token."""
    cmd = [cli("fairseq-validate"), data_bin, "--user-dir", USER_DIR, "--task", "masked_lm", "--path", checkpoint,
           "--valid-subset", subset, "--batch-size", "16", "--required-batch-size-multiple", "1", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    match = _RESULT.search(output)
    if proc.returncode != 0 or not match:
        raise RuntimeError(f"fairseq-validate failed on {subset} ({proc.returncode}):\n{output[-3000:]}")
    return float(match.group(2))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="moa-eval-ppl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("data_bin")
    parser.add_argument("subsets", nargs="*", default=["valid", "test"])
    args = parser.parse_args(argv)
    for path in (args.checkpoint, args.data_bin):
        if not os.path.exists(path):
            print(f"moa-eval-ppl: error: {path} does not exist", file=sys.stderr)
            return 1
    for subset in args.subsets:
        bits = evaluate(args.checkpoint, args.data_bin, subset, extra)
        nats = bits * math.log(2)
        print(f"{subset}: masked-token NLL {nats:.4f} nats ({bits:.3f} bits, fairseq's 'loss'); "
              f"perplexity exp(NLL) = {math.exp(nats):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
