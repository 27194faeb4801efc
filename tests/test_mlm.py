"""Masked LM with MoA: WikiText preparation offline, training and perplexity through the CLIs."""

import math
import os
import re
import zipfile

import pytest
import torch
import torch.nn.functional as F
from fairseq.data import Dictionary

from helpers import ROOT, needs_shared, run_cli
from moa_tools import USER_DIR

needs_wikitext, WIKITEXT2_VALID = needs_shared("wikitext-2", "wiki.valid.tokens")
pytestmark = [pytest.mark.slow, needs_wikitext]
PREPARE = os.path.join(ROOT, "examples", "mlm", "prepare-wikitext-103.sh")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """prepare-wikitext-103.sh, offline, on an archive in WikiText-103's layout cut from WikiText-2."""
    work = tmp_path_factory.mktemp("mlm")
    with open(WIKITEXT2_VALID, encoding="utf-8") as f:
        lines = f.readlines()
    splits = {"train": lines[:3000], "valid": lines[3000:3400], "test": lines[3400:]}
    mirror = work / "mirror"
    mirror.mkdir()
    with zipfile.ZipFile(mirror / "wikitext-103-v1.zip", "w") as z:
        for split, part in splits.items():
            z.writestr(f"wikitext-103/wiki.{split}.tokens", "".join(part))
    cmd = ["bash", PREPARE, "--out", str(work / "wt"), "--mirror", str(mirror), "--sha1", "none",
           "--vocab-size", "2000", "--workers", "1"]
    run_cli(*cmd)
    second = run_cli(*cmd)
    return {"work": work, "out": work / "wt", "splits": splits, "rerun": second.stdout + second.stderr}


def test_preparation_keeps_every_paragraph_and_no_markup(prepared):
    out = prepared["out"]
    for split, part in prepared["splits"].items():
        expected = sum(1 for line in part if line.strip())
        text = (out / "spm" / f"{split}.txt").read_text(encoding="utf-8").splitlines()
        pieces = (out / "spm" / f"{split}.spm").read_text(encoding="utf-8").splitlines()
        assert len(text) == len(pieces) == expected
        joined = "\n".join(text)
        assert " @-@ " not in joined and " @,@ " not in joined and not re.search(r"^ ?= ", joined, re.M)
    assert "<unk>" in (out / "spm" / "train.spm").read_text(encoding="utf-8").split()
    assert (out / "data-bin" / "dict.txt").exists() and (out / "data-bin" / "test.bin").exists()
    assert "already unpacked" in prepared["rerun"] and "already binarised" in prepared["rerun"]


def test_a_truncated_archive_is_refused(prepared, tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    data = (prepared["work"] / "mirror" / "wikitext-103-v1.zip").read_bytes()
    (mirror / "wikitext-103-v1.zip").write_bytes(data[: len(data) // 2])
    proc = run_cli("bash", PREPARE, "--out", str(tmp_path / "wt"), "--mirror", str(mirror), "--sha1", "none",
                   check=False)
    assert proc.returncode != 0 and "not a complete zip archive" in proc.stderr
    assert not (tmp_path / "wt" / "raw").exists()


TRAIN = ["--task", "masked_lm", "--criterion", "moa_masked_lm", "--moa-alpha", "0.02", "--moa-beta", "0.002",
         "--encoder-layers", "2", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
         "--sample-break-mode", "complete",
         "--tokens-per-sample", "128", "--optimizer", "adam", "--lr", "5e-4", "--batch-size", "16",
         "--max-update", "12", "--cpu", "--num-workers", "0", "--log-format", "simple", "--log-interval", "4",
         "--no-epoch-checkpoints", "--skip-invalid-size-inputs-valid-test", "--seed", "3"]
ARCHS = {"moa": ["--arch", "moa_roberta_small", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "16"],
         "moh": ["--arch", "moh_roberta_small", "--encoder-attention-heads", "4", "--moh-shared-heads", "1",
                 "--moh-top-k", "2", "--moh-beta", "0.05"]}


def _train(prepared, kind):
    save = prepared["work"] / f"ckpt-{kind}"
    proc = run_cli("fairseq-train", str(prepared["out"] / "data-bin"), "--user-dir", USER_DIR, *TRAIN, *ARCHS[kind],
                   "--save-dir", str(save))
    return {"ckpt": str(save / "checkpoint_last.pt"), "data_bin": str(prepared["out"] / "data-bin"),
            "log": proc.stdout + proc.stderr, "save": save, "kind": kind}


@pytest.fixture(scope="module")
def trained(prepared):
    return _train(prepared, "moa")


@pytest.fixture(scope="module")
def trained_moh(prepared):
    return _train(prepared, "moh")


def test_training_logs_mlm_and_moa_figures(trained):
    last = [line for line in trained["log"].splitlines() if "| train |" in line][-1]
    figures = dict(re.findall(r"\| (\w+) ([-\d.]+)", last))
    assert int(figures["num_updates"]) == 12
    la, lz, aux = float(figures["moa_la"]), float(figures["moa_lz"]), float(figures["aux_loss"])
    # 12 updates leave the masked LM better than the uniform guess over its dictionary (fairseq's masked_lm
    # dictionary adds <mask>)
    assert float(figures["loss"]) < math.log2(len(Dictionary.load(os.path.join(trained["data_bin"], "dict.txt"))) + 1)
    # 2 MoA modules, --moa-alpha 0.02 --moa-beta 0.002, logged in bits like fairseq's loss
    assert aux == pytest.approx(2 * (0.02 * la + 0.002 * lz) / math.log(2), rel=0.01)
    assert float(figures["ppl"]) == pytest.approx(2 ** float(figures["loss"]), rel=0.02)


def test_moh_training_logs_its_figures(trained_moh):  # resuming: bit for bit in test_exact_resume
    last = [line for line in trained_moh["log"].splitlines() if "| train |" in line][-1]
    figures = dict(re.findall(r"\| (\w+) ([-\d.]+)", last))
    assert int(figures["num_updates"]) == 12 and "moa_la" not in figures
    lb, aux = float(figures["moh_lb"]), float(figures["aux_loss"])
    # 1 shared + top-2 of 3 routed; 2 modules averaged, --moh-beta 0.05
    assert float(figures["moh_active"]) == pytest.approx(0.75)
    assert aux == pytest.approx(0.05 * lb / math.log(2), rel=0.01)


def _masked_nll(checkpoint, data_bin, subset):
    """exp(mean masked NLL) computed here, from the checkpoint and fairseq's validation masks."""
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint], arg_overrides={"data": data_bin})
    model = models[0].eval()
    task.load_dataset(subset, combine=False, epoch=1)
    batches = task.get_batch_iterator(dataset=task.dataset(subset), max_sentences=16,
                                      max_positions=task.max_positions(), ignore_invalid_inputs=True,
                                      required_batch_size_multiple=1).next_epoch_itr(shuffle=False)
    total, count = 0.0, 0
    with torch.no_grad():
        for sample in batches:
            target = sample["target"]
            masked = target.ne(task.source_dictionary.pad())
            logits = model(**sample["net_input"], masked_tokens=masked)[0]
            total += F.cross_entropy(logits.float(), target[masked], reduction="sum").item()
            count += int(masked.sum())
    return total / count


@pytest.mark.parametrize("model", ["trained", "trained_moh"])
def test_perplexity_is_deterministic_and_matches_an_independent_computation(model, request):
    trained = request.getfixturevalue(model)
    cmd = ["bash", os.path.join(ROOT, "examples", "mlm", "eval-ppl.sh"), trained["ckpt"], trained["data_bin"],
           "valid", "--", "--skip-invalid-size-inputs-valid-test"]
    runs = [run_cli(*cmd) for _ in range(2)]
    assert runs[0].stdout == runs[1].stdout
    match = re.search(r"valid: masked-token NLL ([\d.]+) nats \(([\d.]+) bits.*exp\(NLL\) = ([\d.]+)", runs[0].stdout)
    nats, bits, ppl = (float(g) for g in match.groups())
    assert nats == pytest.approx(bits * math.log(2), abs=1e-3) and ppl == pytest.approx(math.exp(nats), rel=1e-3)
    independent = _masked_nll(trained["ckpt"], trained["data_bin"], "valid")
    assert independent / math.log(2) == pytest.approx(bits, abs=6e-4)  # read from ppl, printed to 0.01
