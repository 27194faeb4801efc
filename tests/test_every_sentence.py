"""Every sentence evaluated at fairseq's default flags (``--required-batch-size-multiple 8``), counted per entry
point against the split's size: fairseq-generate, fairseq-validate, the validation inside fairseq-train (the
loss that picks checkpoint_best.pt) and fairseq-eval-lm. Without the plugin fairseq drops the last batch of a
split whose size is no multiple of 8 (moa/fairseq_fixes/every_sentence.py; measured here without it: 96 of
101 test sentences translated, 32 of 37 validated); training keeps fairseq's rule. fairseq-eval-lm batches
with a multiple of 1 whatever the flag says, so it kept every token already: its count guards that."""

import re

import pytest

from helpers import run_cli
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus

pytestmark = pytest.mark.slow
TEST, VALID = 101, 37  # neither a multiple of 8
COMMON = ["--cpu", "--num-workers", "0", "--log-format", "simple", "--seed", "2", "--no-epoch-checkpoints",
          "--optimizer", "adam", "--lr", "2e-3", "--max-tokens", "1024"]  # and no --required-batch-size-multiple


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("every-sentence")
    raw, mt, lm = str(work / "raw"), str(work / "mt-bin"), str(work / "lm-bin")
    write_corpus(raw, {"train": 600, "valid": VALID, "test": TEST}, seed=4)
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", mt, "--joined-dictionary",
            "--workers", "1")
    run_cli("fairseq-preprocess", "--only-source", "--trainpref", f"{raw}/train.en", "--validpref", f"{raw}/valid.en",
            "--testpref", f"{raw}/test.en", "--destdir", lm, "--workers", "1")
    train = run_cli("fairseq-train", mt, "--user-dir", USER_DIR, "--arch", "moa_small", "--encoder-layers", "1",
                    "--decoder-layers", "1", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
                    "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "16", "--share-all-embeddings",
                    "--criterion", "moa_label_smoothed_cross_entropy", "--label-smoothing", "0.1", *COMMON,
                    "--max-epoch", "1", "--save-dir", str(work / "mt"))
    run_cli("fairseq-train", lm, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "moa_lm_small",
            "--decoder-layers", "1", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128", "--moa-experts",
            "4", "--moa-top-k", "2", "--moa-head-dim", "16", "--criterion", "moa_cross_entropy",
            "--tokens-per-sample", "64", *COMMON, "--max-update", "4", "--save-dir", str(work / "lm"))
    return {"mt": mt, "lm": lm, "raw_test": f"{raw}/test.en", "mt_ckpt": str(work / "mt" / "checkpoint_last.pt"),
            "lm_ckpt": str(work / "lm" / "checkpoint_last.pt"), "train_log": train.stdout + train.stderr}


def test_generate_translates_every_test_sentence_at_the_default_flags(runs):
    proc = run_cli("fairseq-generate", runs["mt"], "--user-dir", USER_DIR, "--path", runs["mt_ckpt"], "--cpu",
                   "--gen-subset", "test", "--beam", "4", "--batch-size", "16")
    out = proc.stdout + proc.stderr
    assert f"Translated {TEST} sentences" in out  # fairseq alone: 96
    assert sorted(int(i) for i in re.findall(r"^H-(\d+)\t", proc.stdout, re.M)) == list(range(TEST))
    assert "kept the last batch of 5 sentences" in out


def _validate(runs, *extra):
    proc = run_cli("fairseq-validate", runs["mt"], "--user-dir", USER_DIR, "--task", "translation", "--cpu",
                   "--path", runs["mt_ckpt"], "--valid-subset", "valid", "--batch-size", "8", *extra)
    out = proc.stdout + proc.stderr
    return re.search(r"valid on 'valid' subset \| loss ([\d.]+) .*\| bsz ([\d.]+)", out), out


def test_validate_and_the_validation_in_training_count_every_sentence(runs):
    """fairseq-validate at the default multiple: 37 sentences (its bsz, the sentences of all its batches; fairseq
    alone: 32), the loss of --required-batch-size-multiple 1; fairseq-train's validation (at the default
    too) printed that same loss for the model it saved."""
    default, out = _validate(runs)
    assert default, out[-2000:]
    assert float(default.group(2)) == VALID
    every, _ = _validate(runs, "--required-batch-size-multiple", "1")
    assert default.group(1) == every.group(1)
    trained = re.findall(r"\| valid \| epoch 001 \| .*?loss ([\d.]+)", runs["train_log"])
    assert trained == [default.group(1)], (trained, default.group(1))


def test_eval_lm_scores_every_token_of_the_split_at_the_default_flags(runs):
    proc = run_cli("fairseq-eval-lm", runs["lm"], "--user-dir", USER_DIR, "--path", runs["lm_ckpt"], "--cpu",
                   "--gen-subset", "test", "--tokens-per-sample", "64", "--batch-size", "8")
    out = proc.stdout + proc.stderr
    with open(runs["raw_test"], encoding="utf-8") as f:  # fairseq-preprocess's words, and an end of sentence each
        tokens = sum(len(line.split()) + 1 for line in f)
    assert re.search(rf"Evaluated {tokens:,} tokens", out), (tokens, out[-2000:])
