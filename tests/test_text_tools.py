"""The text tools, in-process: WikiText and SGML text, the moa-corpus commands, atomic outputs,
and that the tools load neither torch nor fairseq."""

import os
import subprocess
import sys

import pytest
import sentencepiece as spm

from helpers import needs_shared, sacrebleu_sgm_text
from moa_tools.commands import corpus
from moa_tools.corpora import sgm_segments
from moa_tools.textio import read_lines, write_lines_atomically
from moa_tools.wikitext import normalise_line

needs_sgm, SGM = needs_shared("newstest2014", "sgm")


def test_the_tools_import_neither_torch_nor_fairseq():
    code = ("import sys, moa_tools.commands.corpus, moa_tools.commands.fetch, moa_tools.commands.score, "
            "moa_tools.commands.demo, moa_tools.commands.eval_ppl, moa_tools.commands.average_checkpoints, "
            "moa_tools.commands.convert_moh; "
            "print(sorted(m for m in ('torch', 'fairseq', 'moa') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_normalise_line_undoes_the_tokenised_format():
    assert normalise_line(" = = Early life = = \n") == "Early life"
    assert normalise_line(" = Valkyria Chronicles III = \n") == "Valkyria Chronicles III"
    assert normalise_line(" It sold 1 @,@ 000 copies in the mid @-@ 1990s at 2 @.@ 5 <unk> each . \n") == \
        "It sold 1,000 copies in the mid-1990s at 2.5 <unk> each ."
    assert normalise_line(" \n") is None


@needs_sgm
@pytest.mark.parametrize("name", ["newstest2014-deen-src.en.sgm", "newstest2014-deen-ref.de.sgm",
                                  "newstest2014-fren-src.en.sgm", "newstest2014-fren-ref.fr.sgm"])
def test_sgm_text_is_sacrebleus_on_the_full_newstest2014(name, tmp_path):
    segments = sgm_segments(os.path.join(SGM, name))
    assert len(segments) == 3003
    assert [s[2] for s in segments] == sacrebleu_sgm_text(os.path.join(SGM, name), tmp_path)


def test_wikitext_then_sentencepiece_keeps_unk_as_one_piece(tmp_path, capsys):
    raw = tmp_path / "wiki.train.tokens"
    paragraphs = [f" The {i} th <unk> of the mid @-@ {1900 + i} s sold {i} @,@ 000 copies . \n" for i in range(300)]
    raw.write_text(" = A heading = \n \n" + "".join(paragraphs), encoding="utf-8")
    text = tmp_path / "train.txt"
    assert corpus.main(["wikitext", str(raw), str(text)]) == 0
    lines = list(read_lines(str(text)))
    assert lines[0] == "A heading" and len(lines) == 301 and lines[2] == "The 1 th <unk> of the mid-1901 s sold 1,000 copies ."
    prefix = str(tmp_path / "spm")
    assert corpus.main(["spm-train", "--model-prefix", prefix, "--vocab-size", "120", "--keep-symbol", "<unk>",
                        str(text)]) == 0
    assert capsys.readouterr().out.strip() == prefix + ".model"
    pieces = tmp_path / "train.spm"
    assert corpus.main(["spm-encode", "--model", prefix + ".model", str(text), str(pieces)]) == 0
    encoded = list(read_lines(str(pieces)))
    assert len(encoded) == 301 and "<unk>" in encoded[1].split()
    model = spm.SentencePieceProcessor(model_file=prefix + ".model")
    assert model.decode(encoded[2].split()) == lines[2]


def test_corpus_errors_follow_the_convention(tmp_path, capsys):
    assert corpus.main(["wikitext", str(tmp_path / "missing.tokens"), str(tmp_path / "out.txt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moa-corpus: error: ") and "missing.tokens" in err
    assert not (tmp_path / "out.txt").exists() and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(SystemExit) as usage:
        corpus.main(["spm-encode", "--model", "m.model", "only-one-file"])
    assert usage.value.code == 2 and "spm-encode takes IN OUT pairs" in capsys.readouterr().err


def test_filter_that_cannot_write_its_second_output_leaves_nothing_behind(tmp_path, capsys):
    (tmp_path / "in.en").write_text("a b\nc d e\n", encoding="utf-8")
    (tmp_path / "in.de").write_text("x y\nz w v\n", encoding="utf-8")
    previous = tmp_path / "train.en"
    previous.write_text("from an earlier run\n", encoding="utf-8")
    missing = tmp_path / "no-such-dir" / "train.de"
    assert corpus.main(["filter", str(tmp_path / "in.en"), str(tmp_path / "in.de"), str(previous), str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moa-corpus: error:") and "no-such-dir" in err and "Traceback" not in err
    assert previous.read_text(encoding="utf-8") == "from an earlier run\n"
    assert not list(tmp_path.rglob("*.tmp"))


def test_filter_writes_both_outputs_when_it_succeeds(tmp_path, capsys):
    (tmp_path / "in.en").write_text("a b\nc d e\none two three four five\n", encoding="utf-8")
    (tmp_path / "in.de").write_text("x y\nz w v\nok\n", encoding="utf-8")
    assert corpus.main(["filter", str(tmp_path / "in.en"), str(tmp_path / "in.de"),
                        str(tmp_path / "out.en"), str(tmp_path / "out.de")]) == 0
    assert "kept 2 of 3 pairs" in capsys.readouterr().err
    assert (tmp_path / "out.en").read_text(encoding="utf-8") == "a b\nc d e\n"
    assert (tmp_path / "out.de").read_text(encoding="utf-8") == "x y\nz w v\n"
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_failure_midway_through_the_lines_keeps_the_old_file(tmp_path):
    path = tmp_path / "train.en"
    path.write_text("old\n", encoding="utf-8")

    def lines():
        yield "first"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_lines_atomically(str(path), lines())
    assert path.read_text(encoding="utf-8") == "old\n" and not list(tmp_path.glob("*.tmp"))
    assert write_lines_atomically(str(path), ["new", "lines"]) == 2
    assert path.read_text(encoding="utf-8") == "new\nlines\n"


def test_the_demo_shows_training_progress_from_fairseqs_log_lines(capsys):
    from moa_tools.commands.demo import training_progress

    show = training_progress(400, started=0.0)
    show("2026-12-01 10:40:00 | INFO | train_inner | epoch 001:    100 / 255 loss=5.694, nll_loss=4.536, "
         "ppl=23.19, wps=2569.8, ups=1.39, num_updates=100, lr=0.000353553\n")
    show("2026-12-01 10:40:01 | INFO | fairseq.trainer | begin training epoch 2\n")
    show("2026-12-01 10:42:30 | INFO | valid | epoch 002 | valid on 'valid' subset | loss 5.364 | nll_loss 4.03\n")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("  update   100/400: loss 5.694 bits, 2,570 target words/s, ")
    assert lines[1] == "  validation after epoch 002: loss 5.364 bits"
