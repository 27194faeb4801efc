"""The two BLEU figures of moa_tools.scoring: compound splitting, and the tokenised BLEU's behaviour."""

import pytest
import sacrebleu

from moa_tools import ToolError
from moa_tools.scoring import bleu_report, ordered_hypotheses, split_compounds, tokenized_bleu


def test_compound_splitting_marks_every_intra_word_hyphen():
    assert split_compounds("die Fußball-Weltmeisterschaft") == "die Fußball ##AT##-##AT## Weltmeisterschaft"
    assert split_compounds("Ost-West-Achse") == "Ost ##AT##-##AT## West ##AT##-##AT## Achse"
    assert split_compounds("a-b-c") == "a ##AT##-##AT## b-c"  # perl's single pass: b was consumed by the first match
    assert split_compounds("a - b , 2-3") == "a - b , 2 ##AT##-##AT## 3"


def test_tokenized_bleu_is_moses_tokens_split_at_compounds():
    ref = ["Die Fußball-Weltmeisterschaft beginnt heute in Brasilien."]
    hyp = ["Die Fußball-Meisterschaft beginnt heute in Brasilien."]
    bleu = sacrebleu.metrics.BLEU(tokenize="none", force=True)
    split = bleu.corpus_score(["Die Fußball ##AT##-##AT## Meisterschaft beginnt heute in Brasilien ."],
                              [["Die Fußball ##AT##-##AT## Weltmeisterschaft beginnt heute in Brasilien ."]]).score
    unsplit = bleu.corpus_score(["Die Fußball-Meisterschaft beginnt heute in Brasilien ."],
                                [["Die Fußball-Weltmeisterschaft beginnt heute in Brasilien ."]]).score
    assert tokenized_bleu(hyp, ref, "de") == pytest.approx(split) and split != pytest.approx(unsplit)
    assert tokenized_bleu(ref, ref, "de") == pytest.approx(100.0)


def test_report_pairs_hypotheses_and_checks_counts():
    refs = ["Ein Mann fährt Rad.", "Zwei Hunde spielen im Schnee."]
    report = bleu_report(["Ein Mann fährt Rad.", "Zwei Hunde spielen im Schnee."], refs, "de")
    assert report.sacrebleu == pytest.approx(100.0) and report.sentences == 2
    assert report.signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    with pytest.raises(ToolError, match="1 hypotheses for 2 references"):
        bleu_report(["Ein Mann."], refs, "de")
    with pytest.raises(ToolError, match="missing ids start \\[1\\]"):
        ordered_hypotheses({0: "a", 2: "b"}, 3)
