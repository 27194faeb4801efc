"""The real corpora the studies train on, prepared offline from the shared data, and the models' recipes.

* Multi30k (``../shared/data/multi30k``) through examples/translation/prepare-multi30k.sh (8,000 joint
  sentencepiece pieces); :func:`multi30k_models` are the models every Multi30k study trains, at
  :data:`SHAPE` (d_model 256, FFN 1024, 3+3 layers, 4 heads of 64), with :data:`COMMON_TRAINING`.
* WikiText-2 (``../shared/data/wikitext-2/wiki.valid.tokens``, the only split kept): its first 90% of
  lines train, the next 5% validate, the last 5% test, through examples/mlm/prepare-wikitext-103.sh;
  :func:`mlm_models`, :func:`mlm_train` and :func:`mlm_perplexities` are the masked-LM recipe.
"""

import os
import re
import zipfile

from benchmarks.harness.fairseq_runs import fairseq_train
from benchmarks.harness.models import SMALL as SHAPE
from benchmarks.harness.results import ROOT, require_shared, shared_data
from moa_tools import fairseq_command, run_logged

MULTI30K = shared_data("multi30k")
WIKITEXT = shared_data("wikitext-2", "wiki.valid.tokens")
DEFAULT_MOA = "4K8E64D"
# SwitchHead at MoA 4K8E64D's MACs per target token (within 1%), and at the Transformer's parameters (within
# 0.5%) with one attention matrix per module, the Transformer's head width and the released k = 2
SWITCHHEAD_EQUAL_COST, SWITCHHEAD_PARAMETERS = "2H2K4E56D", "1H2K7E64D"
NARROW_FFN = 768  # the FFN width at which the Transformer costs what MoA 4K8E64D does (within 3%)
# what every Multi30k study trains with; learning rate, warmup, dropout, batch and checkpoints are each study's own
COMMON_TRAINING = ["--task", "translation", "--share-all-embeddings", "--label-smoothing", "0.1",
                   "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0",
                   "--lr-scheduler", "inverse_sqrt", "--attention-dropout", "0.1", "--weight-decay", "0.0001",
                   "--cpu", "--num-workers", "0", "--log-format", "simple", "--log-interval", "50"]
SHORT_TRAINING = COMMON_TRAINING + ["--lr", "1e-3", "--dropout", "0.3", "--no-epoch-checkpoints"]  # short budgets
TRANSFORMER = ["--arch", "transformer", "--criterion", "label_smoothed_cross_entropy"]
MLM_SHAPE = ["--encoder-layers", "4", "--encoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024",
             "--encoder-attention-heads", "4"]


def moa_expert_flags(moa_config: str) -> list:
    """fairseq-train's MoA expert flags for a configuration written as in the paper, kKeEdD (top-k of e
    experts of width d, e.g. 4K8E64D); ValueError naming the expected form otherwise."""
    shape = re.fullmatch(r"(\d+)K(\d+)E(\d+)D", moa_config)
    if not shape or int(shape.group(1)) > int(shape.group(2)):
        raise ValueError(f"--moa-config {moa_config!r}: expected kKeEdD with k <= e, such as 4K8E64D")
    k, e, d = shape.groups()
    return ["--moa-top-k", k, "--moa-experts", e, "--moa-head-dim", d]


def switchhead_expert_flags(config: str) -> list:
    """fairseq-train's SwitchHead flags for a configuration written HhKkEeDd (``2H2K4E56D``: 2 heads of width
    56, each choosing 2 of 4 value and output experts); ValueError naming the expected form otherwise."""
    match = re.fullmatch(r"(\d+)H(\d+)K(\d+)E(\d+)D", config)
    if not match:
        raise ValueError(f"SwitchHead configuration {config!r}: write it as HhKkEeDd, e.g. 2H2K4E56D")
    heads, top_k, experts, head_dim = match.groups()
    return ["--switchhead-heads", heads, "--switchhead-top-k", top_k, "--switchhead-experts", experts,
            "--switchhead-head-dim", head_dim]


def multi30k_models(moa_config=DEFAULT_MOA):
    """--models id -> (label in the tables, fairseq-train arguments), MoA as ``moa_config`` (kKeEdD).
    Result rows carry the id (``model_id``); the label is only what the tables print."""
    moa_args = ["--arch", "moa_small", "--criterion", "moa_label_smoothed_cross_entropy", "--moa-alpha", "0.01",
                "--moa-beta", "0.001", *moa_expert_flags(moa_config)]
    moh_args = ["--arch", "moh_small", "--criterion", "moa_label_smoothed_cross_entropy", "--moh-beta", "0.01"]
    self_only = ["--moa-attention-types", "encoder-self,decoder-self"]
    switchhead_args = ["--arch", "switchhead_small", "--criterion", "moa_label_smoothed_cross_entropy"]
    return {
        "moa": (f"MoA {moa_config} (moa_small)", moa_args),
        "moa-self": (f"MoA {moa_config} self-attn, MHA cross (moa_small)", moa_args + self_only),
        "moa-normal-router": (f"MoA {moa_config}, normal-initialised router", moa_args + ["--moa-router-init", "normal"]),
        "moa-self-normal-router": (f"MoA {moa_config} self-attn, MHA cross, normal-initialised router",
                                   moa_args + self_only + ["--moa-router-init", "normal"]),
        "moa-aux-per-batch": (f"MoA {moa_config}, aux loss per batch", moa_args + ["--moa-aux-loss-scale", "per-batch"]),
        "moa-raw-gates": (f"MoA {moa_config}, raw gate weights", moa_args + ["--moa-gate-weights", "raw"]),
        "moa-released": (f"MoA {moa_config}, the released code's choices", moa_args + ["--moa-released-code"]),
        "moh": ("MoH 2+1of2, paper gates (moh_small)", moh_args + ["--moh-gate-scale", "softmax"]),
        "moh-unit": ("MoH 2+1of2, unit gates (moh_small)", moh_args + ["--moh-gate-scale", "unit"]),
        "switchhead": (f"SwitchHead {SWITCHHEAD_EQUAL_COST} (switchhead_small)",
                       switchhead_args + switchhead_expert_flags(SWITCHHEAD_EQUAL_COST)),
        "switchhead-params": (f"SwitchHead {SWITCHHEAD_PARAMETERS}, the Transformer's parameters (switchhead_small)",
                              switchhead_args + switchhead_expert_flags(SWITCHHEAD_PARAMETERS)),
        "transformer": ("Transformer 4x64 (transformer)", TRANSFORMER),
        "transformer-narrow": (f"Transformer 4x64, FFN {NARROW_FFN} (transformer)",
                               TRANSFORMER + [f"--{side}-ffn-embed-dim={NARROW_FFN}" for side in ("encoder", "decoder")]),
    }


def multi30k_mirror(work, smoke=False):
    """The shared Multi30k folder, or for ``smoke`` a folder in ``work`` with its first lines only."""
    require_shared(MULTI30K)
    if not smoke:
        return MULTI30K
    mirror = os.path.join(work, "mirror")
    os.makedirs(mirror, exist_ok=True)
    for split, n in (("train", 3000), ("val", 200), ("test_2016_flickr", 100)):
        for lang in ("en", "de", "fr"):
            with open(os.path.join(MULTI30K, f"{split}.{lang}"), encoding="utf-8") as f:
                lines = [next(f) for _ in range(n)]
            with open(os.path.join(mirror, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                f.writelines(lines)
    return mirror


def prepare_multi30k(pair, workdir, smoke=False, once=False):
    """prepare-multi30k.sh for ``pair`` into WORKDIR/multi30k-PAIR (8,000 pieces; ``smoke``: 2,000 pieces of
    the first lines); ``once``: keep a folder prepared before (runs that resume need their dictionaries)."""
    data_dir = os.path.join(workdir, f"multi30k-{pair}")
    if once and os.path.exists(os.path.join(data_dir, "data-bin", f"test.{pair}.{pair.split('-')[1]}.idx")):
        return data_dir
    run_logged(["bash", os.path.join(ROOT, "examples", "translation", "prepare-multi30k.sh"), "--pair", pair,
                "--out", data_dir, "--mirror", multi30k_mirror(workdir, smoke), "--vocab-size",
                "2000" if smoke else "8000", "--workers", "2"])
    return data_dir


def prepare_wikitext(work):
    """WikiText-2's lines split 90/5/5 and prepared (8,000 pieces) in ``work``; the data-bin folder."""
    with open(require_shared(WIKITEXT), encoding="utf-8") as f:
        lines = f.readlines()
    a, b = int(0.9 * len(lines)), int(0.95 * len(lines))
    mirror = os.path.join(work, "mirror")
    os.makedirs(mirror, exist_ok=True)
    with zipfile.ZipFile(os.path.join(mirror, "wikitext-103-v1.zip"), "w") as z:
        for split, part in (("train", lines[:a]), ("valid", lines[a:b]), ("test", lines[b:])):
            z.writestr(f"wikitext-103/wiki.{split}.tokens", "".join(part))
    run_logged(["bash", os.path.join(ROOT, "examples", "mlm", "prepare-wikitext-103.sh"), "--out",
                os.path.join(work, "wt2"), "--mirror", mirror, "--sha1", "none", "--vocab-size", "8000", "--workers", "2"])
    return os.path.join(work, "wt2", "data-bin")


def mlm_models(moa_config=DEFAULT_MOA):
    """The masked-LM models by id: (label, fairseq-train arguments), at :data:`MLM_SHAPE`."""
    moa_args = ["--arch", "moa_roberta_small", "--criterion", "moa_masked_lm", *moa_expert_flags(moa_config)]
    return {"moa": (f"MoA {moa_config} (moa_roberta_small)", moa_args),
            "moa-normal-router": (f"MoA {moa_config}, normal-initialised router", moa_args + ["--moa-router-init", "normal"]),
            "moh": ("MoH 2+1of2, 75% active (moh_roberta_small)", ["--arch", "moh_roberta_small", "--criterion", "moa_masked_lm"]),
            "transformer": ("Transformer 4x64 (roberta)", ["--arch", "roberta", "--criterion", "masked_lm"])}


def mlm_train(data_bin, model_args, save, updates, extra=(), seed=1):
    """The masked-LM recipe: batches of 16 x 256-token samples, Adam, lr 5e-4 with a polynomial decay over
    ``updates`` (a tenth warmup), dropout 0.1, into a fresh ``save``; its log."""
    return fairseq_train(data_bin, ["--task", "masked_lm", *model_args, "--sample-break-mode", "complete",
                                    "--tokens-per-sample", "256", "--batch-size", "16", "--optimizer", "adam",
                                    "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4", "--lr-scheduler", "polynomial_decay",
                                    "--warmup-updates", str(updates // 10), "--total-num-update", str(updates),
                                    "--max-update", str(updates), "--dropout", "0.1", "--attention-dropout", "0.1",
                                    "--no-epoch-checkpoints", "--cpu", "--num-workers", "0", "--seed", str(seed),
                                    "--log-format", "simple", "--log-interval", "50",
                                    "--skip-invalid-size-inputs-valid-test", *extra], save)


def mlm_perplexities(checkpoint, data_bin) -> dict:
    """moa-eval-ppl's masked-token perplexity of ``checkpoint`` on the valid and test lines."""
    out = run_logged([fairseq_command("moa-eval-ppl"), checkpoint, data_bin, "valid", "test", "--",
                      "--skip-invalid-size-inputs-valid-test"])
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+): .*exp\(NLL\) = ([\d.]+)", out, re.M)}
