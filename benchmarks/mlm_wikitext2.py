"""Masked LM on WikiText-2 text: small MoA and MoH RoBERTas against a same-shape Transformer RoBERTa.

    .venv/bin/python benchmarks/mlm_wikitext2.py [--updates 600] [--workdir DIR]

Uses wikitext-2/wiki.valid.tokens of the shared data folder (the only WikiText split kept on
this machine): the first 90% of its lines train, the next 5% validate, the last
5% test. The text goes through examples/mlm/prepare-wikitext-103.sh (offline, via
--mirror, 8,000 sentencepiece pieces), then the three models train with the same
shape (d_model 256, FFN 1024, 4 layers; MoA 4K8E64D, MoH with 2 shared + top-1 of 2 of the
4 heads of 64, and 4 heads of 64), batch,
learning-rate schedule and number of updates, and are scored by moa-eval-ppl on
the held-out test lines. Writes benchmarks/results/mlm-wikitext2.{json,md}.
"""

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
import zipfile

from common import RESULTS, ROOT, shared_data
from moa_tools import USER_DIR, ToolError, fairseq_command, run_logged, run_tool

SOURCE = shared_data("wikitext-2", "wiki.valid.tokens")
SHAPE = ["--encoder-layers", "4", "--encoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024",
         "--encoder-attention-heads", "4"]
MODELS = {"MoA 4K8E64D (moa_roberta_small)": ["--arch", "moa_roberta_small", "--criterion", "moa_masked_lm"],
          "MoH 2+1of2, 75% active (moh_roberta_small)": ["--arch", "moh_roberta_small", "--criterion", "moa_masked_lm"],
          "Transformer 4x64 (roberta)": ["--arch", "roberta", "--criterion", "masked_lm"]}


def prepare(work):
    with open(SOURCE, encoding="utf-8") as f:
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


def train(data_bin, model_args, save, updates, extra=()):
    """fairseq-train on the benchmark's batches and schedule (warmup a tenth of ``updates``) into a
    fresh ``save`` folder (fairseq would resume a checkpoint left there); its log."""
    shutil.rmtree(save, ignore_errors=True)
    os.makedirs(save)
    return run_logged([fairseq_command("fairseq-train"), data_bin, "--user-dir", USER_DIR,
                       "--task", "masked_lm", *model_args, "--sample-break-mode", "complete",
                       "--tokens-per-sample", "256", "--batch-size", "16", "--optimizer", "adam",
                       "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4", "--lr-scheduler", "polynomial_decay",
                       "--warmup-updates", str(updates // 10), "--total-num-update", str(updates),
                       "--max-update", str(updates), "--dropout", "0.1", "--attention-dropout", "0.1",
                       "--save-dir", save, "--no-epoch-checkpoints", "--cpu", "--num-workers", "0", "--seed", "1",
                       "--log-format", "simple", "--log-interval", "50", "--skip-invalid-size-inputs-valid-test",
                       *extra], os.path.join(save, "train.log"))


def perplexities(checkpoint, data_bin) -> dict:
    """moa-eval-ppl's masked-token perplexity of ``checkpoint`` on the valid and test lines."""
    out = run_logged([fairseq_command("moa-eval-ppl"), checkpoint, data_bin, "valid", "test", "--",
                      "--skip-invalid-size-inputs-valid-test"])
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+): .*exp\(NLL\) = ([\d.]+)", out, re.M)}


def _main(argv):
    parser = argparse.ArgumentParser(prog="mlm_wikitext2.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=600)
    parser.add_argument("--workdir", default=os.path.join(ROOT, "benchmarks", "work-mlm"))
    parser.add_argument("--models", nargs="+", choices=list(MODELS), metavar="MODEL", default=list(MODELS),
                        help="train only these (names as in MODELS); their rows replace the same models' rows of "
                             "the results file, the other rows stay, each with its date")
    args = parser.parse_args(argv)
    if not os.path.exists(SOURCE):
        raise ToolError(f"{SOURCE} is missing: this benchmark reads the shared WikiText-2 file "
                        "(set MOA_SHARED_DATA to the folder that holds wikitext-2/)")
    data_bin = prepare(args.workdir)
    rows = []
    for name in args.models:
        model_args = MODELS[name]
        save = os.path.join(args.workdir, re.sub(r"\W+", "-", name))
        started = time.time()
        log = train(data_bin, [*model_args, *SHAPE], save, args.updates)
        wall = time.time() - started
        train_lines = [line for line in log.splitlines() if "| train |" in line]
        wps = [float(x) for line in train_lines for x in re.findall(r"\| wps ([\d.]+)", line)]
        ppl = perplexities(os.path.join(save, "checkpoint_last.pt"), data_bin)
        params = re.search(r"num\. shared model params: ([\d,]+)", log)
        row = {"model": name, "date": time.strftime("%Y-%m-%d"), "parameters": int(params.group(1).replace(",", "")) if params else None,
               "updates": args.updates, "train_wall_s": wall,
               "train_words_per_s": sum(wps) / len(wps) if wps else math.nan,
               "valid_ppl": ppl.get("valid"), "test_ppl": ppl.get("test")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = os.path.join(RESULTS, "mlm-wikitext2")
    if os.path.exists(out + ".json"):  # keep the rows of the models not trained now
        with open(out + ".json", encoding="utf-8") as f:
            kept = [r for r in json.load(f) if r["model"] not in args.models and r.get("updates") == args.updates]
        rows = sorted(kept + rows, key=lambda r: list(MODELS).index(r["model"]) if r["model"] in MODELS else 99)
    lines = [f"MLM on WikiText-2 text, {os.cpu_count()} CPUs, {args.updates} updates of 16 x 256-token samples each, "
             "masked-token perplexity exp(NLL) on held-out lines.", "",
             "| model | date | parameters | train words/s | wall s | valid ppl | test ppl |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['date']} | {r['parameters']:,} | {r['train_words_per_s']:.0f} | "
                     f"{r['train_wall_s']:.0f} | {r['valid_ppl']:.2f} | {r['test_ppl']:.2f} |")
    text = "\n".join(lines)
    print("\n" + text)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(text + "\n")


def main(argv=None) -> int:
    return run_tool("mlm_wikitext2.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
