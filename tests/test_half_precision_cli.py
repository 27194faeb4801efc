"""bfloat16 and float16 through fairseq's own flags on a CPU: fairseq-train --bf16 and
--memory-efficient-bf16 (which fairseq alone refuses without torch_xla) and --memory-efficient-fp16
train a MoA translation model and a MoH language model on the same batches as float32, to a validation
loss within 0.05 bits of float32's after 50 updates; fairseq-generate, fairseq-eval-lm and
fairseq-interactive with --bf16 run the model in bfloat16, and on one checkpoint give float32's hypotheses and
loss within bfloat16's rounding."""

import math
import os
import re

import pytest

from helpers import run_cli
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus

pytestmark = pytest.mark.slow
PRECISIONS = {"float32": [], "bf16": ["--bf16"], "memory-efficient-bf16": ["--memory-efficient-bf16"],
              "memory-efficient-fp16": ["--memory-efficient-fp16"]}
COMMON = ["--optimizer", "adam", "--lr", "2e-3", "--cpu", "--num-workers", "0", "--log-format", "simple",
          "--log-interval", "10", "--max-update", "50", "--seed", "2", "--no-epoch-checkpoints"]
MODELS = {
    "moa_small": ["--task", "translation", "--arch", "moa_small", "--encoder-layers", "1", "--decoder-layers", "1",
                  "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128", "--moa-experts", "4", "--moa-top-k",
                  "2", "--moa-head-dim", "16", "--share-all-embeddings", "--criterion",
                  "moa_label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "1024"],
    "moh_lm_small": ["--task", "language_modeling", "--arch", "moh_lm_small", "--decoder-layers", "2",
                     "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128", "--moh-shared-heads", "1",
                     "--moh-top-k", "2", "--criterion", "moa_cross_entropy", "--tokens-per-sample", "64",
                     "--max-tokens", "1024"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("half")
    raw = str(work / "raw")
    write_corpus(raw, {"train": 3000, "valid": 60, "test": 30}, seed=5)
    data = {"moa_small": str(work / "mt-bin"), "moh_lm_small": str(work / "lm-bin")}
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", data["moa_small"],
            "--joined-dictionary", "--workers", "1")
    run_cli("fairseq-preprocess", "--only-source", "--trainpref", f"{raw}/train.en", "--validpref", f"{raw}/valid.en",
            "--testpref", f"{raw}/test.en", "--destdir", data["moh_lm_small"], "--workers", "1")
    results = {}
    for model, flags in MODELS.items():
        for precision, extra in PRECISIONS.items():
            save = str(work / f"{model}-{precision}")
            proc = run_cli("fairseq-train", data[model], "--user-dir", USER_DIR, *flags, *COMMON, *extra, "--save-dir", save)
            log = proc.stdout + proc.stderr
            results[(model, precision)] = {
                "log": log, "checkpoint": os.path.join(save, "checkpoint_last.pt"), "data": data[model],
                "train": [float(v) for v in re.findall(r"train_inner \|.*? loss=([-\d.naninf]+)", log)],
                "valid": float(re.findall(r"\| valid \|.*? \| loss ([-\d.naninf]+)", log)[-1])}
    results["raw"] = raw
    return results


@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p != "float32"])
@pytest.mark.parametrize("model", MODELS)
def test_half_precision_trains_like_float32(runs, model, precision):
    run, reference = runs[(model, precision)], runs[(model, "float32")]
    assert "num_updates 50" in run["log"] and "Traceback" not in run["log"], run["log"][-3000:]
    assert all(math.isfinite(v) for v in run["train"]) and run["train"][-1] < run["train"][0] - 0.5
    assert abs(run["valid"] - reference["valid"]) <= 0.05, (run["valid"], reference["valid"])
    if "bf16" in precision:
        assert "--bf16 without torch_xla: bfloat16 on the CPU" in run["log"]


def test_generate_translates_the_same_checkpoint_in_bf16_as_in_float32(runs):
    """bf16 inference isolated: the float32-trained checkpoint decoded in float32 and with --bf16. Where both
    find the same hypothesis its score (the mean log-probability of its tokens, computed in float32 from
    bfloat16 logits) is float32's within 8 u = 2^-5 bits, a few roundings of logits of order a few bits
    (measured: 0.011). bfloat16's roundings tip close beams of this barely trained model: 5 of the 30
    hypotheses differ (measured); bound: a third. A broken bfloat16 path changes every hypothesis and score."""
    run = runs[("moa_small", "float32")]
    outputs = {}
    for precision in ("float32", "bf16"):
        proc = run_cli("fairseq-generate", run["data"], "--user-dir", USER_DIR, "--path", run["checkpoint"], "--cpu",
                       "--gen-subset", "test", "--beam", "4", "--batch-size", "16", "--required-batch-size-multiple",
                       "1", *PRECISIONS[precision])
        outputs[precision] = proc.stdout + proc.stderr
    assert "MoATransformerModel runs in bfloat16" in outputs["bf16"]
    assert "MoATransformerModel runs in bfloat16" not in outputs["float32"]
    hypotheses = {p: {i: (float(score), text) for i, score, text in re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", out, re.M)}
                  for p, out in outputs.items()}
    assert len(hypotheses["float32"]) == len(hypotheses["bf16"]) == 30
    same = [i for i, (_, text) in hypotheses["float32"].items() if hypotheses["bf16"][i][1] == text]
    gaps = [abs(hypotheses["bf16"][i][0] - hypotheses["float32"][i][0]) for i in same]
    print(f"bf16 against float32 on one checkpoint: {30 - len(same)} of 30 hypotheses differ; "
          f"score gaps of the same ones up to {max(gaps):.4f}")
    assert len(same) >= 20 and max(gaps) <= 8 * 2 ** -8, (len(same), max(gaps))


def test_eval_lm_scores_the_same_checkpoint_in_bf16_as_in_float32_and_interactive_samples(runs):
    """bf16 scoring isolated: the float32-trained LM scored in float32 and with --bf16. The loss is a mean of
    log-probabilities, each a few bfloat16 roundings off, which the mean averages: bound u = 2^-8 of the loss
    (measured: 2.9173 against 2.917 bits, 0.03 u)."""
    run = runs[("moh_lm_small", "float32")]
    losses = {}
    for precision in ("float32", "bf16"):
        proc = run_cli("fairseq-eval-lm", run["data"], "--user-dir", USER_DIR, "--path", run["checkpoint"], "--cpu",
                       "--gen-subset", "test", "--tokens-per-sample", "64", "--max-tokens", "1024",
                       *PRECISIONS[precision])
        out = proc.stdout + proc.stderr
        assert ("MoHLanguageModel runs in bfloat16" in out) == (precision == "bf16"), out[-2000:]
        losses[precision] = float(re.search(r"Loss \(base 2\): ([\d.]+)", out).group(1))
    print(f"bf16 against float32 on one checkpoint: losses {losses}")
    assert abs(losses["bf16"] - losses["float32"]) <= 2 ** -8 * losses["float32"], losses
    run = runs[("moh_lm_small", "bf16")]
    proc = run_cli("fairseq-interactive", run["data"], "--user-dir", USER_DIR, "--path", run["checkpoint"], "--cpu",
                   "--task", "language_modeling", "--bf16", "--sampling", "--beam", "1", "--seed", "1",
                   "--max-len-b", "8", input="The green apple\n")
    out = proc.stdout + proc.stderr
    assert "MoHLanguageModel runs in bfloat16" in out and re.search(r"^H-0\t", out, re.M), out[-2000:]
