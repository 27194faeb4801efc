"""examples/translation/prepare-wmt14*.sh, offline, on archives in the real WMT14 layout.

The test sets are cut from the real newstest2014 .sgm files in ../shared/data/newstest2014/sgm;
the training and newstest2013 text are Multi30k lines from ../shared/data/multi30k, plus pairs that
carry line-break characters, a 300-word pair and a 1:40 pair.
"""

import gzip
import io
import os
import shutil
import tarfile

import pytest

from helpers import ROOT, needs_shared, run_cli, sacrebleu_sgm_text
from moa_tools.corpora import sgm_segments

SCRIPTS = os.path.join(ROOT, "examples", "translation")
needs_sgm, SGM = needs_shared("newstest2014", "sgm")
needs_multi30k, MULTI30K = needs_shared("multi30k")
pytestmark = [pytest.mark.slow, needs_sgm, needs_multi30k]

CORPORA = {  # archive -> (member pattern with {l} for the language, corpus pair code)
    "en-de": [("training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en.{l}"),
              ("training-parallel-commoncrawl.tgz", "commoncrawl.de-en.{l}"),
              ("training-parallel-nc-v9.tgz", "training/news-commentary-v9.de-en.{l}")],
    "en-fr": [("training-parallel-europarl-v7.tgz", "training/europarl-v7.fr-en.{l}"),
              ("training-parallel-commoncrawl.tgz", "commoncrawl.fr-en.{l}"),
              ("training-parallel-nc-v9.tgz", "training/news-commentary-v9.fr-en.{l}"),
              ("training-parallel-un.tgz", "un/undoc.2000.fr-en.{l}"),
              ("training-giga-fren.tar", "giga-fren.release2.fixed.{l}.gz")],
}
TEST_DOCS = 2
LONG = " ".join(["word"] * 300)
ODD_SOURCE = "A man\rin a red\u2028shirt is MARKERSRC climbing."
ODD_TARGET = "Ein Mann\x85im roten Hemd MARKERTGT klettert."


def read(path):
    with open(path, encoding="utf-8", newline="\n") as f:
        return [line[:-1] for line in f]


def multi30k(split, lang, n, skip=0):
    return read(os.path.join(MULTI30K, f"{split}.{lang}"))[skip:skip + n]


def cut_sgm(path, docs=TEST_DOCS):
    """The first ``docs`` documents of a real .sgm file, with its opening and closing set tags."""
    lines = read(path)
    kept, closed = [], 0
    for line in lines[:-1]:
        kept.append(line)
        closed += line.startswith("</doc>")
        if closed == docs:
            break
    return "\n".join(kept + [lines[-1]]) + "\n"


def add(tar, name, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def text(lines):
    return ("\n".join(lines) + "\n").encode("utf-8")


def build_mirror(folder, pair):
    """Archives named and laid out as statmt.org's, small. Returns the training pairs in corpus order."""
    tgt = pair.split("-")[1]
    os.makedirs(folder, exist_ok=True)
    pairs = []
    for i, (archive, member) in enumerate(CORPORA[pair]):
        src_lines, tgt_lines = multi30k("train", "en", 80, 80 * i), multi30k("train", tgt, 80, 80 * i)
        if i == 0:
            src_lines += [ODD_SOURCE, LONG, "Yes."]
            tgt_lines += [ODD_TARGET, LONG, " ".join(["ja"] * 40)]
        pairs += list(zip(src_lines, tgt_lines))
        mode = "w" if archive.endswith(".tar") else "w:gz"
        with tarfile.open(os.path.join(folder, archive), mode) as tar:
            for lang, lines in (("en", src_lines), (tgt, tgt_lines)):
                name = member.format(l=lang)
                add(tar, name, gzip.compress(text(lines)) if name.endswith(".gz") else text(lines))
    with tarfile.open(os.path.join(folder, "dev.tgz"), "w:gz") as tar:
        for lang in ("en", "de", "fr"):
            add(tar, f"dev/newstest2013.{lang}", text(multi30k("val", lang, 40)))
    with tarfile.open(os.path.join(folder, "test-full.tgz"), "w:gz") as tar:
        for code, lang in (("deen", "de"), ("fren", "fr")):
            for name in (f"newstest2014-{code}-src.en.sgm", f"newstest2014-{code}-ref.{lang}.sgm"):
                add(tar, f"test-full/{name}", cut_sgm(os.path.join(SGM, name)).encode("utf-8"))
    return pairs


def prepare(pair, out, mirror, check=True, test_md5="none"):
    script = os.path.join(SCRIPTS, f"prepare-wmt14en2{pair.split('-')[1]}.sh")
    md5 = ["--test-md5", test_md5] if test_md5 else []
    return run_cli("bash", script, "--out", str(out), "--mirror", str(mirror), "--vocab-size", "600",
                   "--workers", "2", *md5, check=check)


@pytest.fixture(scope="module")
def en_de(tmp_path_factory):
    work = tmp_path_factory.mktemp("wmt14-en-de")
    pairs = build_mirror(work / "mirror", "en-de")
    proc = prepare("en-de", work / "out", work / "mirror")
    return {"out": work / "out", "mirror": work / "mirror", "pairs": pairs, "log": proc.stdout + proc.stderr}


def test_test_set_is_whole_aligned_and_free_of_markup(en_de, tmp_path):
    out = en_de["out"]
    cut = tmp_path / "ref.sgm"
    cut.write_text(cut_sgm(os.path.join(SGM, "newstest2014-deen-ref.de.sgm")), encoding="utf-8")
    cut_src = tmp_path / "src.sgm"
    cut_src.write_text(cut_sgm(os.path.join(SGM, "newstest2014-deen-src.en.sgm")), encoding="utf-8")
    reference, source = sacrebleu_sgm_text(str(cut), tmp_path), sacrebleu_sgm_text(str(cut_src), tmp_path)
    assert len(reference) == len(sgm_segments(str(cut))) > 20
    assert read(out / "text" / "test.de") == reference  # the raw reference, untouched, for sacreBLEU
    assert read(out / "orig" / "newstest2014.en") == source
    assert len(read(out / "text" / "test.en")) == len(read(out / "spm" / "test.en")) == len(reference)
    for folder in ("orig", "text", "spm"):
        for name in os.listdir(out / folder):
            content = (out / folder / name).read_text(encoding="utf-8", errors="replace")
            assert "<seg" not in content and "</doc>" not in content and "<srcset" not in content, name
    assert f"newstest2014: {len(reference)} segments" in en_de["log"]


def test_training_text_stays_aligned_through_line_break_characters(en_de):
    out = en_de["out"]
    train_en, train_de = read(out / "text" / "train.en"), read(out / "text" / "train.de")
    assert len(train_en) == len(train_de) == len(en_de["pairs"])
    index = next(i for i, line in enumerate(train_en) if "MARKERSRC" in line)
    assert index == next(i for i, (s, _) in enumerate(en_de["pairs"]) if s == ODD_SOURCE)
    assert train_en[index] == "A man in a red shirt is MARKERSRC climbing."
    assert "MARKERTGT" in train_de[index]
    # Moses punctuation normalisation ran: the Multi30k text has none of its replaced characters left
    assert not any("\u201e" in line or "\u201c" in line for line in train_de)


def test_training_pairs_are_filtered_by_length_and_ratio(en_de):
    spm = en_de["out"] / "spm"
    all_en, all_de = read(spm / "train.all.en"), read(spm / "train.all.de")
    expected = [(s, t) for s, t in zip(all_en, all_de)
                if 1 <= len(s.split()) <= 250 and 1 <= len(t.split()) <= 250
                and max(len(s.split()), len(t.split())) <= 1.5 * min(len(s.split()), len(t.split()))]
    kept = list(zip(read(spm / "train.en"), read(spm / "train.de")))
    assert kept == expected and 0 < len(kept) < len(all_en)
    long_index = next(i for i, (s, _) in enumerate(en_de["pairs"]) if s == LONG)
    ratio_index = next(i for i, (s, _) in enumerate(en_de["pairs"]) if s == "Yes.")
    for i in (long_index, ratio_index):
        assert (all_en[i], all_de[i]) not in kept
    assert len(read(spm / "valid.en")) == 40  # validation stays whole too


def test_binarised_with_one_dictionary_and_rerun_skips(en_de):
    out = en_de["out"]
    bin_dir = out / "data-bin"
    assert (bin_dir / "dict.en.txt").read_text() == (bin_dir / "dict.de.txt").read_text()
    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            assert (bin_dir / f"{split}.en-de.{lang}.bin").stat().st_size > 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = prepare("en-de", out, en_de["mirror"])
    assert "already binarised" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_en_fr_reads_the_un_corpus_and_giga_fren_gz_members(tmp_path):
    pairs = build_mirror(tmp_path / "mirror", "en-fr")
    prepare("en-fr", tmp_path / "out", tmp_path / "mirror")
    train_en, train_fr = read(tmp_path / "out" / "text" / "train.en"), read(tmp_path / "out" / "text" / "train.fr")
    assert len(train_en) == len(train_fr) == len(pairs) == 5 * 80 + 3
    assert train_fr[-1] == pairs[-1][1].strip()  # the last giga-fren line, decompressed from its inner .gz
    assert (tmp_path / "out" / "data-bin" / "test.en-fr.fr.bin").exists()


def test_truncated_archive_is_an_error_and_leaves_nothing(tmp_path):
    build_mirror(tmp_path / "mirror", "en-de")
    archive = tmp_path / "mirror" / "training-parallel-commoncrawl.tgz"
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    proc = prepare("en-de", tmp_path / "out", tmp_path / "mirror", check=False)
    assert proc.returncode != 0
    assert "training-parallel-commoncrawl.tgz is truncated or corrupt" in proc.stderr
    out = tmp_path / "out"
    assert not (out / "data-bin").exists() and not (out / "text" / "train.en").exists()
    assert not list((out / "orig").glob("commoncrawl*")) and not list(out.rglob("*.tmp"))


def test_mismatched_parallel_corpus_is_refused_with_both_counts(tmp_path):
    build_mirror(tmp_path / "mirror", "en-de")
    archive = tmp_path / "mirror" / "training-parallel-nc-v9.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        add(tar, "training/news-commentary-v9.de-en.en", text(["one", "two", "three"]))
        add(tar, "training/news-commentary-v9.de-en.de", text(["eins", "zwei"]))
    proc = prepare("en-de", tmp_path / "out", tmp_path / "mirror", check=False)
    assert proc.returncode != 0
    assert ("mismatched parallel corpora in training-parallel-nc-v9.tgz: training/news-commentary-v9.de-en.en "
            "has 3 lines, training/news-commentary-v9.de-en.de has 2") in proc.stderr
    assert not (tmp_path / "out" / "data-bin").exists()
    shutil.rmtree(tmp_path / "out")


def test_test_archive_is_checked_against_sacrebleus_md5(tmp_path):
    from sacrebleu.dataset import DATASETS

    build_mirror(tmp_path / "mirror", "en-de")  # our cut test-full.tgz is not the real one
    proc = prepare("en-de", tmp_path / "out", tmp_path / "mirror", check=False, test_md5=None)
    assert proc.returncode != 0
    assert f"expected {DATASETS['wmt14/full'].md5[0]} (corrupt or wrong file)" in proc.stderr
    assert not (tmp_path / "out" / "download" / "test-full.tgz").exists()
