"""The generated corpus of the main job: correct German, reversible tokens, disjoint splits."""

from moa_tools.number_phrases import (de_number, de_ordinal, de_year, en_number, en_ordinal, generate_splits,
                                     join_tokens)


def _text(tokens):
    return join_tokens(" ".join(tokens))


def test_german_numbers_put_units_before_tens():
    assert _text(de_number(21)) == "einundzwanzig"
    assert _text(de_number(101)) == "einhunderteins"
    assert _text(de_number(347)) == "dreihundertsiebenundvierzig"
    assert _text(de_number(990)) == "neunhundertneunzig"
    assert _text(de_number(16)) == "sechzehn"
    assert de_number(21) == ["ein@@", "und@@", "zwanzig"]


def test_english_numbers_years_and_ordinals():
    assert _text(en_number(321)) == "three hundred and twenty-one"
    assert _text(en_number(40)) == "forty"
    assert _text(en_ordinal(21)) == "twenty-first" and _text(en_ordinal(30)) == "thirtieth"
    assert _text(en_ordinal(12)) == "twelfth" and _text(en_ordinal(19)) == "nineteenth"


def test_german_dates():
    assert _text(de_ordinal(1)) == "ersten" and _text(de_ordinal(7)) == "siebten"
    assert _text(de_ordinal(3)) == "dritten" and _text(de_ordinal(19)) == "neunzehnten"
    assert _text(de_ordinal(31)) == "einunddreißigsten"
    assert _text(de_year(1999)) == "neunzehnhundertneunundneunzig"
    assert _text(de_year(2000)) == "zweitausend" and _text(de_year(2021)) == "zweitausendeinundzwanzig"


def test_splits_are_disjoint_deterministic_and_reversible():
    splits = generate_splits({"train": 500, "valid": 30, "test": 40}, seed=3)
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [500, 30, 40]
    sources = [{p.src_text for p in pairs} for pairs in splits.values()]
    assert not (sources[0] & sources[1]) and not (sources[0] & sources[2]) and not (sources[1] & sources[2])
    assert generate_splits({"train": 500, "valid": 30, "test": 40}, seed=3) == splits
    for pair in splits["test"]:
        assert join_tokens(pair.tgt_tokens) == pair.tgt_text and "@@" not in pair.tgt_text
        assert pair.tgt_text.endswith(".") and pair.tgt_text[0].isupper()
