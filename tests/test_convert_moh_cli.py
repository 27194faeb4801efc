"""moa-convert-moh through the real CLIs: fairseq-train a Transformer, convert it, and use the MoH
checkpoint with fairseq-generate (the same translations when every head is active),
fairseq-validate, and fairseq-train with the printed flags (continue, save, resume)."""

import os
import re
import shlex

import pytest

from helpers import run_cli
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus

pytestmark = pytest.mark.slow

SHAPE = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim",
         "128", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings"]
TRAINING = ["--label-smoothing", "0.1", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "2048", "--cpu",
            "--num-workers", "0", "--log-format", "simple", "--log-interval", "1", "--no-epoch-checkpoints",
            "--seed", "3"]
GENERATE = ["--user-dir", USER_DIR, "--cpu", "--gen-subset", "test", "--beam", "4", "--batch-size", "8",
            "--required-batch-size-multiple", "1"]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    work = tmp_path_factory.mktemp("convert")
    raw, data_bin, ckpt = (str(work / d) for d in ("raw", "data-bin", "transformer"))
    write_corpus(raw, {"train": 1500, "valid": 30, "test": 21}, seed=11)
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", data_bin,
            "--joined-dictionary", "--workers", "1")
    run_cli("fairseq-train", data_bin, "--arch", "transformer", *SHAPE, "--criterion", "label_smoothed_cross_entropy",
            *TRAINING, "--save-dir", ckpt, "--max-update", "30")
    return {"work": work, "data_bin": data_bin, "checkpoint": os.path.join(ckpt, "checkpoint_last.pt")}


def _hypotheses(data_bin, checkpoint):
    """{sentence id: (score, hypothesis)} of fairseq-generate's H- lines."""
    out = run_cli("fairseq-generate", data_bin, "--path", checkpoint, *GENERATE).stdout
    rows = [line.split("\t") for line in out.splitlines() if line.startswith("H-")]
    return {int(sid[2:]): (float(score), text) for sid, score, text in rows}


def test_with_every_head_active_fairseq_generate_translates_as_the_original(original):
    out = str(original["work"] / "all-heads.pt")
    run_cli("moa-convert-moh", original["checkpoint"], "--shared-heads", "1", "--top-k", "3", "--router", "query-norm",
            "--out", out)
    expected = _hypotheses(original["data_bin"], original["checkpoint"])
    converted = _hypotheses(original["data_bin"], out)
    assert len(expected) == 21 and sorted(converted) == sorted(expected)
    for sid, (score, text) in expected.items():
        assert converted[sid][1] == text and converted[sid][0] == pytest.approx(score, abs=1e-5)


def test_a_converted_model_validates_and_continues_training_with_the_printed_flags(original):
    out = str(original["work"] / "moh-75.pt")
    converted = run_cli("moa-convert-moh", original["checkpoint"], "--shared-heads", "2", "--top-k", "1",
                        "--router", "learned", "--out", out).stdout
    assert "75% active" in converted
    validate = run_cli("fairseq-validate", original["data_bin"], "--user-dir", USER_DIR, "--cpu", "--path", out,
                       "--task", "translation", "--max-tokens", "2048")
    assert re.search(r"valid on 'valid' subset \| loss [\d.]+", validate.stdout + validate.stderr)

    command = re.search(r"^continue training with: fairseq-train DATA (.*)$", converted, re.M).group(1)
    flags = shlex.split(command)
    assert flags[flags.index("--finetune-from-model") + 1] == out
    save = str(original["work"] / "continued")
    train = ["fairseq-train", original["data_bin"], *flags, "--criterion", "moa_label_smoothed_cross_entropy",
             *TRAINING, "--save-dir", save, "--save-interval-updates", "2"]
    first = run_cli(*train, "--max-update", "4")
    log = first.stdout + first.stderr
    assert "MoHTransformerModel" in log and "router=learned" in log
    assert re.search(r"Loaded checkpoint .*moh-75\.pt \(epoch \d+ @ \d+ updates\)", log)
    figures = dict(re.findall(r"\| (\w+) ([-\d.]+)", [line for line in log.splitlines() if "| train |" in line][-1]))
    assert int(figures["num_updates"]) == 4 and float(figures["moh_active"]) == pytest.approx(0.75)
    resumed = run_cli(*train, "--max-update", "6")
    log = resumed.stdout + resumed.stderr
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 4 updates\)", log)
    assert "done training" in log and re.search(r"num_updates 6\b", log)
