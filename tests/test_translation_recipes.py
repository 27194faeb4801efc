"""The translation recipes, offline: prepare-multi30k.sh on the shared Multi30k and on .gz fixtures,
train-wmt14.sh and evaluate.sh on a tiny model, and the Python API against fairseq-interactive."""

import gzip
import json
import os

import pytest
import sacrebleu
import sentencepiece as spm

from helpers import ROOT, needs_shared, run_cli
from moa_tools.scoring import read_hypotheses
from moa_tools.textio import read_lines

pytestmark = pytest.mark.slow
SCRIPTS = os.path.join(ROOT, "examples", "translation")
needs_multi30k, MULTI30K = needs_shared("multi30k")
SPLITS = {"train": 29000, "val": 1014, "test_2016_flickr": 1000}
TINY_MOA = ["--arch", "moa_small", "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
            "--encoder-ffn-embed-dim", "64", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8"]


def _prepare(*args):
    return run_cli("bash", os.path.join(SCRIPTS, "prepare-multi30k.sh"), "--workers", "1", *args, check=False)


def _script(name, *args):
    return run_cli("bash", os.path.join(SCRIPTS, name), *args, check=False)


@needs_multi30k
def test_multi30k_en_de_from_the_shared_folder(tmp_path):
    out = tmp_path / "m30k"
    first = _prepare("--pair", "en-de", "--out", str(out), "--mirror", MULTI30K)
    assert first.returncode == 0, first.stderr[-3000:]
    for split, count in SPLITS.items():
        assert f"{split}: {count} sentence pairs" in first.stdout
        for lang in ("en", "de"):
            assert len((out / "spm" / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()) == count
    reference = (out / "raw" / "test_2016_flickr.de").read_text(encoding="utf-8")
    assert reference == open(os.path.join(MULTI30K, "test_2016_flickr.de"), encoding="utf-8").read()
    model = spm.SentencePieceProcessor(model_file=str(out / "spm" / "spm.model"))
    pieces = (out / "spm" / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()
    assert [model.decode(p.split()) for p in pieces[:50]] == reference.splitlines()[:50]
    for name in ("dict.en.txt", "dict.de.txt", "train.en-de.en.bin", "test.en-de.de.idx"):
        assert (out / "data-bin" / name).exists()
    assert (out / "data-bin" / "dict.en.txt").read_text() == (out / "data-bin" / "dict.de.txt").read_text()
    again = _prepare("--pair", "en-de", "--out", str(out), "--mirror", MULTI30K)
    assert again.returncode == 0 and "already binarised" in again.stdout


def _gz_mirror(folder, lines_per_file, short=None):
    folder.mkdir()
    for split in SPLITS:
        for lang in ("en", "fr"):
            n = lines_per_file - 3 if (split, lang) == short else lines_per_file
            text = "".join(f"{lang} sentence {i} of {split} with words {i % 7} and {i % 11}\n" for i in range(n))
            with gzip.open(folder / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write(text)


def test_gzip_mirror_and_mismatched_corpora(tmp_path):
    _gz_mirror(tmp_path / "good", 60)
    ok = _prepare("--pair", "en-fr", "--out", str(tmp_path / "a"), "--mirror", str(tmp_path / "good"),
                  "--vocab-size", "60")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "val: 60 sentence pairs" in ok.stdout and (tmp_path / "a" / "data-bin" / "dict.fr.txt").exists()

    _gz_mirror(tmp_path / "bad", 60, short=("val", "fr"))
    bad = _prepare("--pair", "en-fr", "--out", str(tmp_path / "b"), "--mirror", str(tmp_path / "bad"),
                   "--vocab-size", "60")
    assert bad.returncode != 0
    assert "mismatched parallel corpora: val.en has 60 lines, val.fr has 57" in bad.stderr
    assert not (tmp_path / "b" / "raw" / "val.fr").exists() and not (tmp_path / "b" / "data-bin").exists()


def test_python_api_translates_like_fairseq_interactive(tmp_path):
    import moa.hub
    from moa_tools import USER_DIR

    _gz_mirror(tmp_path / "mirror", 60)
    out = tmp_path / "m"
    assert _prepare("--pair", "en-fr", "--out", str(out), "--mirror", str(tmp_path / "mirror"),
                    "--vocab-size", "60").returncode == 0
    data_bin, ckpt = str(out / "data-bin"), str(tmp_path / "ckpt")
    run_cli("fairseq-train", data_bin, "--user-dir", USER_DIR, *TINY_MOA, "--share-all-embeddings",
            "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "1024", "--max-update", "5", "--cpu",
            "--save-dir", ckpt, "--no-epoch-checkpoints", "--num-workers", "0")
    sentences = ["en sentence 3 of val with words 3 and 3", "en sentence 8 of val with words 1 and 8"]
    translator = moa.hub.load_translator(os.path.join(ckpt, "checkpoint_last.pt"), data_bin,
                                         sentencepiece_model=str(out / "spm" / "spm.model"), cpu=True)
    batch = translator.translate(sentences, beam=2)
    assert isinstance(batch, list) and len(batch) == 2 and translator.translate(sentences[0], beam=2) == batch[0]
    interactive = run_cli("fairseq-interactive", data_bin, "--user-dir", USER_DIR, "--cpu",
                          "--path", os.path.join(ckpt, "checkpoint_last.pt"), "--beam", "2",
                          "--bpe", "sentencepiece", "--sentencepiece-model", str(out / "spm" / "spm.model"),
                          input="\n".join(sentences) + "\n")
    detok = [line.split("\t")[2] for line in interactive.stdout.splitlines() if line.startswith("D-")]
    assert batch == detok
    with pytest.raises(FileNotFoundError, match="nowhere.pt"):
        moa.hub.load_translator(str(tmp_path / "nowhere.pt"), data_bin)


def test_train_script_keeps_the_papers_effective_batch_for_any_gpu_count(tmp_path):
    (tmp_path / "dict.en.txt").write_text("a 1\n")
    for gpus, freq in (("1", "32"), ("4", "8"), ("8", "4")):
        dry = _script("train-wmt14.sh", "--pair", "en-de", "--data", str(tmp_path), "--gpus", gpus, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert f"--update-freq {freq} " in dry.stdout and "--max-tokens 8192 " in dry.stdout
        assert "--lr 7e-4" in dry.stdout and "--warmup-updates 4000" in dry.stdout and "--adam-eps 1e-9" in dry.stdout
        assert (f"--distributed-world-size {gpus}" in dry.stdout) == (gpus != "1")
    two_nodes = _script("train-wmt14.sh", "--pair", "en-de", "--data", str(tmp_path), "--gpus", "8", "--nodes", "2",
                        "--node-rank", "1", "--master", "node0:29500", "--dry-run")
    assert two_nodes.returncode == 0, two_nodes.stderr
    assert two_nodes.stdout.startswith("torchrun --nnodes 2 --nproc-per-node 8 --node-rank 1 --master-addr node0 "
                                       "--master-port 29500 ")
    assert "--update-freq 2 " in two_nodes.stdout and "--distributed-world-size" not in two_nodes.stdout
    no_master = _script("train-wmt14.sh", "--pair", "en-de", "--data", str(tmp_path), "--nodes", "2", "--dry-run")
    assert no_master.returncode == 2 and "needs --master HOST:PORT" in no_master.stderr
    bad = _script("train-wmt14.sh", "--pair", "en-de", "--data", str(tmp_path), "--gpus", "3", "--dry-run")
    assert bad.returncode == 2 and "does not divide the paper's 262144 tokens per update" in bad.stderr
    missing = _script("train-wmt14.sh", "--pair", "en-fr", "--data", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "run prepare-wmt14.sh --pair en-fr first" in missing.stderr


def test_train_then_evaluate_averages_translates_everything_and_reports_both_bleus(tmp_path):
    _gz_mirror(tmp_path / "mirror", 60)
    out = tmp_path / "m"
    assert _prepare("--pair", "en-fr", "--out", str(out), "--mirror", str(tmp_path / "mirror"),
                    "--vocab-size", "60").returncode == 0
    ckpt = tmp_path / "ckpt"
    train = _script("train-wmt14.sh", "--pair", "en-fr", "--data", str(out), "--gpus", "32", "--max-tokens", "8192",
                    "--save-dir", str(ckpt), "--", "--cpu", "--distributed-world-size", "1", *TINY_MOA, "--max-epoch", "3", "--num-workers", "0")
    assert train.returncode == 0, train.stderr[-3000:]
    assert "8192 tokens x 32 GPU(s) x update-freq 1 = 262144" in train.stderr
    assert sorted(p.name for p in ckpt.glob("checkpoint[0-9]*.pt")) == ["checkpoint1.pt", "checkpoint2.pt",
                                                                       "checkpoint3.pt"]
    ref = out / "raw" / "test_2016_flickr.fr"
    ev = _script("evaluate.sh", "--pair", "en-fr", "--data", str(out / "data-bin"), "--ref", str(ref),
                 "--checkpoints", str(ckpt), "--last", "2", "--cpu", "--max-tokens", "500",
                 "--", "--max-len-b", "12")  # an untrained model would otherwise write 200 tokens a sentence
    assert ev.returncode == 0, ev.stdout[-2000:] + ev.stderr[-3000:]
    assert (ckpt / "averaged-last2.pt").exists() and "60 of 60 test sentences translated" in ev.stdout
    refs = list(read_lines(str(ref)))
    hyps = read_hypotheses(str(ckpt / "generate-test.log"))
    report = json.loads((ckpt / "bleu-test.json").read_text())
    assert report["sacrebleu"] == pytest.approx(sacrebleu.corpus_bleu([hyps[i] for i in range(60)], [refs]).score)
    assert f"({report['signature']})" in ev.stdout and "tokenised BLEU with compound splitting" in ev.stdout
    too_many = _script("evaluate.sh", "--pair", "en-fr", "--data", str(out / "data-bin"), "--ref", str(ref),
                       "--checkpoints", str(ckpt), "--last", "5", "--cpu")
    assert too_many.returncode != 0 and "holds 3 epoch checkpoints, fewer than the 5 asked for" in too_many.stderr
