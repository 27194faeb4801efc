"""Language models on WikiText-2 text: the small MoA and MoH LMs against ``transformer_lm_small``, and
a trained ``transformer_lm_small`` converted to MoH and trained on, against the original trained on.

    .venv/bin/python -m benchmarks.lm_wikitext2 --seeds 1 2 3                 # equal updates (300)
    .venv/bin/python -m benchmarks.lm_wikitext2 --seeds 1 2 --minutes 2.5     # equal training time
    .venv/bin/python -m benchmarks.lm_wikitext2 --convert --seeds 1 2 3       # conversion (needs the first run)

Data: wikitext-2/wiki.valid.tokens of the shared data folder, split and prepared as the masked-LM
benchmark does (:func:`benchmarks.mlm_wikitext2.prepare`: the first 90% of the lines train, the next
5% validate, the last 5% test; 8,000 sentencepiece pieces). Every model trains with fairseq's
``language_modeling`` task on 128-token blocks, 8 per update, Adam with a polynomial decay over
--updates (a tenth warmup), dropout 0.1, and is scored by ``fairseq-eval-lm`` (``--context-window
64``) on the held-out lines: perplexity per sentencepiece token. The models (--models, by id):

* ``transformer``: ``transformer_lm_small`` (fairseq's transformer_lm, 4 heads of 64), criterion
  ``cross_entropy``;
* ``moa``: ``moa_lm_small`` (4K8E64D); ``moh-75``: ``moh_lm_small`` (2 shared + top-1 of 2);
  ``moh-50``: the same with 1 shared + top-1 of 3; all with ``moa_cross_entropy``.

The budget is --updates each, or the same training wall time (--minutes, fairseq's --stop-time-hours,
the schedule still that of --updates). ``--convert`` takes each seed's ``transformer`` checkpoint of
the equal-updates run, converts it with ``moa-convert-moh`` (query-norm router, 75% and 50% of the
heads), scores the converted models as they are, and trains each, and the original, --continue-updates
more (``--finetune-from-model``: a new optimiser and schedule for all three). Rows go to
benchmarks/results/lm-wikitext2/ (``lm-wikitext2`` and ``convert-lm``), each with the run that made it.
"""

import argparse
import json
import math
import os
import re
import sys
import time

from benchmarks.common import RESULTS, ROOT, provenance
from benchmarks.mlm_wikitext2 import SOURCE, prepare, write_report
from moa_tools import USER_DIR, ToolError, fairseq_command, run_logged, run_tool
from moa_tools.checkpoints import load_checkpoint
from moa_tools.moh_conversion import continue_flags

MODELS = {  # id: (label, fairseq-train arguments)
    "transformer": ("Transformer LM 4x64 (transformer_lm_small)", ["--arch", "transformer_lm_small", "--criterion",
                                                                   "cross_entropy"]),
    "moa": ("MoA 4K8E64D (moa_lm_small)", ["--arch", "moa_lm_small", "--criterion", "moa_cross_entropy"]),
    "moh-75": ("MoH 2 + top-1 of 2, 75% (moh_lm_small)", ["--arch", "moh_lm_small", "--criterion", "moa_cross_entropy"]),
    "moh-50": ("MoH 1 + top-1 of 3, 50% (moh_lm_small)", ["--arch", "moh_lm_small", "--criterion", "moa_cross_entropy",
                                                         "--moh-shared-heads", "1", "--moh-top-k", "1"]),
}
CONVERSIONS = {"moh-75": (2, 1), "moh-50": (1, 1)}  # id: (shared heads, top-k) of the 4 heads
TITLE = ("Language models on WikiText-2 text, {cpus} CPUs, 8 blocks of 128 sentencepiece tokens per update; "
         "fairseq-eval-lm perplexity (context window 64) on held-out lines; validation NLL in bits.")


def train(data_bin, model_args, save, updates, extra=(), seed=1):
    """fairseq-train on the benchmark's batches and schedule into a fresh ``save`` folder; its log."""
    import shutil

    shutil.rmtree(save, ignore_errors=True)
    os.makedirs(save)
    return run_logged([fairseq_command("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--task", "language_modeling",
                       *model_args, "--tokens-per-sample", "128", "--sample-break-mode", "none", "--batch-size", "8",
                       "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "1e-3", "--clip-norm", "1.0",
                       "--lr-scheduler", "polynomial_decay", "--warmup-updates", str(max(updates // 10, 1)),
                       "--total-num-update", str(updates), "--max-update", str(updates), "--dropout", "0.1",
                       "--save-dir", save, "--no-epoch-checkpoints", "--cpu", "--num-workers", "0", "--seed", str(seed),
                       "--log-format", "simple", "--log-interval", "50", "--disable-validation", *extra],
                      os.path.join(save, "train.log"))


def perplexities(checkpoint, data_bin) -> dict:
    """fairseq-eval-lm's perplexity of ``checkpoint`` on the valid and test lines."""
    result = {}
    for subset in ("valid", "test"):
        out = run_logged([fairseq_command("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--path", checkpoint,
                          "--task", "language_modeling", "--gen-subset", subset, "--tokens-per-sample", "128",
                          "--context-window", "64", "--batch-size", "16", "--cpu", "--num-workers", "0"])
        result[subset] = float(re.search(r"Perplexity: ([\d.]+)", out).group(1))
    return result


def measured_row(model_id, label, seed, budget, run, log, wall, checkpoint, data_bin):
    train_lines = [line for line in log.splitlines() if "| train |" in line]
    wps = [float(x) for line in train_lines for x in re.findall(r"\| wps ([\d.]+)", line)]
    updates = [int(x) for line in train_lines for x in re.findall(r"\| num_updates (\d+)", line)]
    params = re.search(r"num\. shared model params: ([\d,]+)", log)
    if params:
        parameters = int(params.group(1).replace(",", ""))
    else:  # a converted checkpoint, not trained here: count its weights, a tied one once
        weights = {t.data_ptr(): t for name, t in load_checkpoint(checkpoint)["model"].items()
                   if t.is_floating_point() and not name.endswith("_float_tensor")}  # fairseq's device marker
        parameters = sum(t.numel() for t in weights.values())
    ppl = perplexities(checkpoint, data_bin)
    row = {"model_id": model_id, "moa_config": None, "model": label, "seed": seed, "budget": budget,
           "date": time.strftime("%Y-%m-%d"), "run": run, "parameters": parameters,
           "updates": updates[-1] if updates else 0, "train_wall_s": wall,
           "train_words_per_s": sum(wps) / len(wps) if wps else math.nan,
           "valid_ppl": ppl["valid"], "test_ppl": ppl["test"]}
    print(json.dumps({k: v for k, v in row.items() if k != "run"}), flush=True)
    return row


def convert_and_continue(data_bin, workdir, seeds, updates, continue_updates, run):
    rows = []
    budget = f"trained {updates} updates, then {continue_updates} more"
    for seed in seeds:
        original = os.path.join(workdir, f"transformer-seed{seed}", "checkpoint_last.pt")
        if not os.path.exists(original):
            raise ToolError(f"{original} is missing: run the equal-updates benchmark for seed {seed} first")
        jobs = [("transformer", MODELS["transformer"][0] + ", trained on", original, MODELS["transformer"][1])]
        for model_id, (shared, top_k) in CONVERSIONS.items():
            converted = os.path.join(workdir, f"convert-{model_id}-seed{seed}.pt")
            run_logged([fairseq_command("moa-convert-moh"), original, "--shared-heads", str(shared), "--top-k",
                        str(top_k), "--router", "query-norm", "--out", converted])
            flags = continue_flags(load_checkpoint(converted))  # the model flags the tool prints
            label = f"converted to MoH {shared} + top-{top_k} of {4 - shared}, query-norm router"
            rows.append(measured_row(f"converted-{model_id}", label + ", as converted", seed,
                                     f"trained {updates} updates, converted", run, "", 0.0, converted, data_bin))
            jobs.append((f"converted-{model_id}", label + ", trained on", converted,
                         [*flags, "--criterion", "moa_cross_entropy"]))
        for model_id, label, start, model_args in jobs:
            save = os.path.join(workdir, f"continued-{model_id}-seed{seed}")
            started = time.time()
            log = train(data_bin, model_args, save, continue_updates, ["--finetune-from-model", start], seed)
            rows.append(measured_row(f"continued-{model_id}", label, seed, budget, run, log, time.time() - started,
                                     os.path.join(save, "checkpoint_last.pt"), data_bin))
    return rows


def _main(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lm_wikitext2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=300, help="updates per model and the schedule's length")
    parser.add_argument("--minutes", type=float, help="equal training wall time per model instead")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--convert", action="store_true", help="the conversion study (see above) instead")
    parser.add_argument("--continue-updates", type=int, default=150, help="updates after conversion (--convert)")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "benchmarks", "work-lm"))
    parser.add_argument("--out", default=os.path.join(RESULTS, "lm-wikitext2"), help="folder of the result files")
    args = parser.parse_args(argv)
    if not os.path.exists(SOURCE):
        raise ToolError(f"{SOURCE} is missing: this benchmark reads the shared WikiText-2 file "
                        "(set MOA_SHARED_DATA to the folder that holds wikitext-2/)")
    data_bin = prepare(args.workdir)
    run = provenance("lm_wikitext2", argv)
    if args.convert:
        rows = convert_and_continue(data_bin, args.workdir, args.seeds, args.updates, args.continue_updates, run)
        write_report(rows, os.path.join(args.out, "convert-lm"), run, TITLE)
        return
    budget = (f"equal training time, {args.minutes:g} min per model, schedule of {args.updates} updates"
              if args.minutes else f"equal updates, {args.updates} per model")
    extra = ["--stop-time-hours", str(args.minutes / 60)] if args.minutes else []
    rows = []
    for seed in args.seeds:
        for model_id in args.models:
            label, model_args = MODELS[model_id]
            save = os.path.join(args.workdir, f"{model_id}-seed{seed}" + ("-timed" if args.minutes else ""))
            started = time.time()
            log = train(data_bin, model_args, save, args.updates, extra, seed)
            rows.append(measured_row(model_id, label, seed, budget, run, log, time.time() - started,
                                     os.path.join(save, "checkpoint_last.pt"), data_bin))
    write_report(rows, os.path.join(args.out, "lm-wikitext2"), run, TITLE)


def main(argv=None) -> int:
    return run_tool("benchmarks.lm_wikitext2", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
