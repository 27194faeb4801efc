"""``moa-eval-ppl``: masked-token perplexity of an MLM checkpoint, in natural units.

    moa-eval-ppl CHECKPOINT DATA_BIN [SUBSET ...] [-- extra fairseq-validate arguments]

Runs ``fairseq-validate --task masked_lm`` for each subset (default: valid test).
fairseq logs ``loss`` in bits per masked token (base 2) and ``ppl = 2 ** loss``;
this prints the mean negative log-likelihood in nats and the perplexity
``exp(nats)``, which is fairseq's ``ppl``. Both are read from ``ppl``: fairseq rounds
the logged ``loss`` to 0.01 bits (0.7% of perplexity) and ``ppl`` to 0.01. The
masks are fairseq's validation masks (seeded by the checkpoint's seed), so two
evaluations of one checkpoint agree exactly.
"""

import argparse
import math
import os
import re
import sys

from moa_tools import USER_DIR, ToolError, fairseq_command, require_subset, run_logged, run_tool

_RESULT = re.compile(r"valid on '([^']+)' subset \|.* \| ppl ([\d.]+)")  # routing figures may come between


def evaluate(checkpoint: str, data_bin: str, subset: str, extra=()) -> float:
    """fairseq-validate's masked-token perplexity on ``subset`` (``2 ** loss`` before rounding)."""
    output = run_logged([fairseq_command("fairseq-validate"), data_bin, "--user-dir", USER_DIR, "--task", "masked_lm",
                         "--path", checkpoint, "--valid-subset", subset, "--batch-size", "16",
                         "--required-batch-size-multiple", "1", *extra])
    match = _RESULT.search(output)
    if not match:
        raise ToolError(f"fairseq-validate printed no loss for {subset}:\n{output[-3000:]}")
    return float(match.group(2))


def _main(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="moa-eval-ppl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("data_bin")
    parser.add_argument("subsets", nargs="*", default=["valid", "test"])
    args = parser.parse_args(argv)
    if not os.path.exists(args.checkpoint):
        raise ToolError(f"{args.checkpoint} does not exist")
    for subset in args.subsets:
        require_subset(args.data_bin, subset, "the SUBSET arguments")
    for subset in args.subsets:
        ppl = evaluate(args.checkpoint, args.data_bin, subset, extra)
        nats = math.log(ppl)
        print(f"{subset}: masked-token NLL {nats:.4f} nats ({nats / math.log(2):.4f} bits, fairseq's 'loss'); "
              f"perplexity exp(NLL) = {ppl:.2f}")
    return 0


def main(argv=None) -> int:
    return run_tool("moa-eval-ppl", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
