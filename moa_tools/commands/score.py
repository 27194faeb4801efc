"""``moa-score``: both BLEU figures for a fairseq-generate log against raw references.

    moa-score GENERATE_LOG REFERENCES --lang de [--json OUT]

Reads the ``D-`` lines (detokenised hypotheses; generate with ``--post-process
sentencepiece``), checks that every reference line has its hypothesis, then prints
sacreBLEU with its signature and the paper's tokenised, compound-split BLEU
(see :mod:`moa_tools.scoring`).
"""

import argparse
import json
import sys

from moa_tools import run_tool
from moa_tools.scoring import bleu_report, ordered_hypotheses, read_hypotheses
from moa_tools.textio import atomic_text_outputs, read_lines


def _main(argv) -> int:
    parser = argparse.ArgumentParser(prog="moa-score", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("generate_log")
    parser.add_argument("references", help="raw (detokenised) reference text, one sentence per line")
    parser.add_argument("--lang", required=True, help="target language, for Moses tokenisation (de, fr, ...)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    references = list(read_lines(args.references))
    hypotheses = ordered_hypotheses(read_hypotheses(args.generate_log), len(references))
    report = bleu_report(hypotheses, references, args.lang)
    print(f"{report.sentences} of {len(references)} test sentences translated")
    print("\n".join(report.lines()))
    if args.json:
        with atomic_text_outputs(args.json) as (f,):
            json.dump(report.__dict__, f, indent=1)
    return 0


def main(argv=None) -> int:
    return run_tool("moa-score", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
