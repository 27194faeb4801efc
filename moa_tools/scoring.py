"""BLEU for MoA translation output: detokenised sacreBLEU, and the paper's tokenised BLEU.

Two figures, computed on the same hypotheses:

* **sacreBLEU** on detokenised text against the raw references (for WMT14, the plain
  text of the newstest2014 ``.sgm`` files). Comparable across papers; printed with
  sacreBLEU's signature.
* **tokenised BLEU with compound splitting**, as the MoA paper (and Vaswani et al.
  2017, via tensor2tensor's ``get_ende_bleu.sh``) reports it: both sides Moses-tokenised,
  then every intra-word hyphen ``a-b`` becomes ``a ##AT##-##AT## b``, then BLEU on those
  tokens with no further tokenisation (multi-bleu.perl's computation). Splitting adds easy
  matches, so it tends to score above sacreBLEU; only comparable with numbers made the same way.
"""

import re
from dataclasses import dataclass
from typing import Dict, List, Sequence

import sacrebleu

from moa_tools import ToolError

_COMPOUND = re.compile(r"(\S)-(\S)")


@dataclass
class BleuReport:
    sacrebleu: float
    signature: str
    tokenized_bleu: float
    sentences: int

    def lines(self) -> List[str]:
        return [
            f"sacreBLEU = {self.sacrebleu:.2f}  ({self.signature})",
            "  detokenised output against the raw references: the figure to compare across papers and toolkits",
            f"tokenised BLEU with compound splitting = {self.tokenized_bleu:.2f}",
            "  Moses-tokenised, a-b -> a ##AT##-##AT## b, multi-bleu style: the MoA paper's (and Vaswani et al.'s) figure",
        ]


def read_hypotheses(generate_log: str) -> Dict[int, str]:
    """``{sentence id: detokenised hypothesis}`` from fairseq-generate's ``D-`` lines."""
    hyps = {}
    with open(generate_log, encoding="utf-8") as f:
        for line in f:
            match = re.match(r"^D-(\d+)\t[^\t]*\t(.*)$", line.rstrip("\n"))
            if match:
                hyps[int(match.group(1))] = match.group(2)
    return hyps


def ordered_hypotheses(hypotheses: Dict[int, str], count: int) -> List[str]:
    """The hypotheses in id order; an error naming the gap unless every id in ``range(count)`` is there."""
    missing = sorted(set(range(count)) - set(hypotheses))
    if missing or len(hypotheses) != count:
        raise ToolError(f"fairseq-generate translated {len(hypotheses)} sentences for {count} references; "
                         f"missing ids start {missing[:5]} (pass --required-batch-size-multiple 1 and "
                         "--skip-invalid-size-inputs-valid-test must not be set for the test set)")
    return [hypotheses[i] for i in range(count)]


def split_compounds(tokenized: str) -> str:
    r"""``Welt-Meister`` -> ``Welt ##AT##-##AT## Meister`` on Moses-tokenised text.

    One left-to-right pass, exactly as the reference perl ``s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g``:
    in ``a-b-c`` the second hyphen's left neighbour is already consumed, so it stays.
    """
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokenized)


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str], lang: str) -> float:
    """The paper's BLEU: Moses tokenisation (no escaping, no aggressive dash splits), compound splitting,
    then corpus BLEU on whitespace tokens."""
    from sacremoses import MosesTokenizer

    tokenizer = MosesTokenizer(lang=lang)

    def prepare(text: str) -> str:
        return split_compounds(tokenizer.tokenize(text, escape=False, return_str=True))

    bleu = sacrebleu.metrics.BLEU(tokenize="none", force=True)
    return bleu.corpus_score([prepare(h) for h in hypotheses], [[prepare(r) for r in references]]).score


def bleu_report(hypotheses: Sequence[str], references: Sequence[str], lang: str) -> BleuReport:
    """Both BLEU figures for aligned, detokenised hypotheses and raw references in language ``lang``."""
    if len(hypotheses) != len(references):
        raise ToolError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score(list(hypotheses), [list(references)]).score
    return BleuReport(score, str(bleu.get_signature()), tokenized_bleu(hypotheses, references, lang), len(references))
