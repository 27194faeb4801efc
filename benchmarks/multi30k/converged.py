"""Multi30k En-De trained until validation stops improving, one recipe for every model, two seeds.

    .venv/bin/python -m benchmarks.multi30k.converged --sweep            # choose the recipe on the Transformer
    .venv/bin/python -m benchmarks.multi30k.converged --sweep --models moa   # the same sweep for MoA 4K8E64D
    .venv/bin/python -m benchmarks.multi30k.converged                    # the study: every model, seeds 1 and 2
    .venv/bin/python -m benchmarks.multi30k.converged --models moa --moa-config 4K32E64D --seeds 1 --commit
    .venv/bin/python -m benchmarks.multi30k.converged --report           # tables and pictures from the rows
    .venv/bin/python -m benchmarks.multi30k.converged --recount-macs     # the rows' MACs counted again
    .venv/bin/python -m benchmarks.multi30k.converged --models transformer --seeds 1 --reproduce \
        --workdir /tmp/fresh [--epochs 3]     # train recorded runs afresh and compare every epoch's valid NLL

A run trains until the validation loss has not improved for PATIENCE epochs or to EPOCHS epochs, keeps its
checkpoints in --workdir (an interrupted run resumes from them; a recorded run is skipped), averages the
last AVERAGE epoch checkpoints and scores the average and checkpoint_best on the test set. Each finished
run writes its row to results/converged/runs/ (sweep runs to sweep/); ``--commit`` commits it at once.
The recipe, the sweep and the rules: benchmarks/multi30k/README.md.
"""

import datetime
import glob
import json
import os
import re
import statistics
import subprocess
import sys

from benchmarks.harness.corpora import COMMON_TRAINING, DEFAULT_MOA, SHAPE, multi30k_models as models, prepare_multi30k
from benchmarks.harness.fairseq_runs import epoch_stats as log_epoch_stats, fairseq_train, log_figures, translate_and_score
from benchmarks.harness.macs import macs_per_target_token
from benchmarks.harness.results import ROOT, provenance, study_parser, study_results, write_atomically
from benchmarks.multi30k.report import write_report
from moa.fairseq_fixes.every_sentence import FAIRSEQ_RULE, fairseq_evaluation_batches
from moa_tools import ToolError, fairseq_command, run_logged, run_tool

PAIR = "en-de"
EPOCHS = 20          # about an hour of the Transformer on 2 cores
PATIENCE = 5         # epochs without a better validation loss before a run stops
AVERAGE = 5          # last epoch checkpoints averaged
SWEEP_EPOCHS = 10
TOLERANCE = 0.01     # bits of validation NLL within which --reproduce must meet a recorded run
# The validation rule of every recorded row: fairseq's, which leaves out the last batch of the length order
# when it holds no multiple of 8 sentences (what that leaves out: README, "Validation and the last batch").
# The study keeps it, so that its rows stay comparable and --reproduce meets them; a row says so in "valid_rule".
VALID_RULE = FAIRSEQ_RULE
# recipe name -> learning rate (inverse_sqrt peak), warmup updates, tokens per batch, dropout
SWEEP = {
    "lr1e-3-warmup200-tokens2048": ("1e-3", 200, 2048, "0.3"),
    "lr2e-3-warmup1000-tokens2048": ("2e-3", 1000, 2048, "0.3"),
    "lr2e-3-warmup1000-tokens4096": ("2e-3", 1000, 4096, "0.3"),
    "lr5e-3-warmup2000-tokens4096": ("5e-3", 2000, 4096, "0.3"),
}
RECIPE = "lr2e-3-warmup1000-tokens2048"  # the sweep's lowest validation NLL (its rows: OUT/sweep/)
REQUIRED_MODELS = ["transformer", "moa", "moh"]
OUT = study_results("multi30k", "converged")


def recipe_flags(name):
    lr, warmup, tokens, dropout = SWEEP[name]
    return ["--lr", lr, "--warmup-updates", str(warmup), "--max-tokens", str(tokens), "--dropout", dropout]


def run_name(model_id, moa_config, seed, recipe):
    """The folder and row name of one run; a run of the sweep and of the study with the same model, seed
    and recipe are one run (the study continues it)."""
    config = f"-{moa_config}" if model_id.startswith("moa") else ""
    return f"{model_id}{config}-seed{seed}-{recipe}"


def train_logs(save_dir):
    """The fairseq-train logs of a run, one per call (train-1.log, train-2.log, ...), in order."""
    return sorted(glob.glob(os.path.join(save_dir, "train-*.log")), key=lambda p: int(re.findall(r"\d+", p)[-1]))


def epoch_stats(save_dir):
    """Per-epoch figures from every fairseq-train log of a run, later logs (a resume) overriding:
    ({epoch: train stats}, {epoch: valid stats}, stopped early by patience?)."""
    train, valid, early = {}, {}, False
    for path in train_logs(save_dir):
        with open(path, encoding="utf-8", errors="replace") as f:
            more_train, more_valid, stopped = log_epoch_stats(f.read())
        train.update(more_train)
        valid.update(more_valid)
        early |= stopped
    return train, valid, early


def train(model_args, recipe, seed, epochs, save_dir, data_dir, commit):
    """fairseq-train to ``epochs`` (or patience), resuming from ``save_dir``'s checkpoints; each call
    logs to the next train-N.log and writes the ``commit`` it trains at beside it (train-N.commit)."""
    segment = len(train_logs(save_dir)) + 1
    write_atomically(os.path.join(save_dir, f"train-{segment}.commit"), commit + "\n")
    with fairseq_evaluation_batches():  # VALID_RULE
        fairseq_train(os.path.join(data_dir, "data-bin"), [*SHAPE, *model_args, *COMMON_TRAINING,
                                                           *recipe_flags(recipe), "--seed", str(seed),
                                                           "--max-epoch", str(epochs), "--patience", str(PATIENCE),
                                                           "--keep-last-epochs", str(AVERAGE)],
                      save_dir, f"train-{segment}.log", fresh=False)


def segment_commits(save_dir):
    """The commit each fairseq-train call of a run trained at, in order (None where a call predates
    train-N.commit)."""
    commits = []
    for log in train_logs(save_dir):
        path = log[:-len(".log")] + ".commit"
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                commits.append(f.read().strip())
        else:
            commits.append(None)
    return commits


def elapsed_seconds(save_dir):
    """Wall time of a run: from the first to the last timestamped line of each of its logs, summed, so
    that a call killed part-way (the session ended) counts too."""
    total = 0.0
    for log in train_logs(save_dir):
        with open(log, encoding="utf-8", errors="replace") as f:
            stamps = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \|", f.read(), re.M)
        if stamps:
            first, last = (datetime.datetime.strptime(t, "%Y-%m-%d %H:%M:%S") for t in (stamps[0], stamps[-1]))
            total += (last - first).total_seconds()
    return total


def finished_row(path, epochs):
    """The recorded row at ``path`` if it covers a run to ``epochs`` (or one stopped by patience)."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        row = json.load(f)
    return row if row["stopped_by"] == "patience" or row["epoch_cap"] >= epochs else None


def run_one(model_id, moa_config, seed, recipe, epochs, data_dir, workdir, row_path, score, run):
    """Train (or resume) one run and return its row; ``score``: translate the test set too."""
    label, model_args = models(moa_config)[model_id]
    name = run_name(model_id, moa_config, seed, recipe)
    save_dir = os.path.join(workdir, "converged", name)
    _, _, early = epoch_stats(save_dir) if os.path.isdir(save_dir) else ({}, {}, False)
    if not early:  # a run stopped by patience is finished whatever the cap: resuming it would train on
        train(model_args, recipe, seed, epochs, save_dir, data_dir, run["commit"])
    train_stats, valid, early = epoch_stats(save_dir)
    if not valid:
        raise ToolError(f"{save_dir}: fairseq-train logged no validation; see its train-*.log")
    best_epoch = min(valid, key=lambda e: (valid[e]["loss"], e))  # fairseq's checkpoint_best: the lowest loss
    with open(os.path.join(save_dir, "train-1.log"), encoding="utf-8") as f:
        params = log_figures(f.read())["parameters"]
    row = {"pair": PAIR, "model_id": model_id, "moa_config": moa_config if model_id.startswith("moa") else None,
           "model": label, "seed": seed, "recipe": recipe, "recipe_flags": recipe_flags(recipe),
           "epoch_cap": epochs, "patience": PATIENCE, "stopped_by": "patience" if early else "epoch cap",
           "epochs": max(valid), "updates": int(valid[max(valid)]["num_updates"]),
           "best_epoch": best_epoch, "best_updates": int(valid[best_epoch]["num_updates"]),
           "best_valid_loss": valid[best_epoch]["loss"], "best_valid_nll": valid[best_epoch]["nll_loss"],
           "valid_rule": VALID_RULE,
           "valid_nll_by_epoch": {e: {"updates": int(v["num_updates"]), "loss": v["loss"], "nll": v["nll_loss"]}
                                  for e, v in sorted(valid.items())},
           "train_wall_s": sum(s.get("train_wall", 0.0) for s in train_stats.values()),
           "elapsed_s": elapsed_seconds(save_dir), "segments": len(train_logs(save_dir)),
           "segment_commits": segment_commits(save_dir),
           "train_words_per_s": statistics.median(s["wps"] for s in train_stats.values()),
           "parameters": params, "run": run}
    if score:
        best = os.path.join(save_dir, "checkpoint_best.pt")
        average = min(AVERAGE, row["epochs"])
        averaged = os.path.join(save_dir, f"averaged-last{average}.pt")
        run_logged([fairseq_command("moa-average-checkpoints"), "--inputs", save_dir,
                    "--num-epoch-checkpoints", str(average), "--output", averaged])
        src, tgt = PAIR.split("-")
        row["macs_per_target_token"] = macs_per_target_token(data_dir, src, tgt, best)
        row["averaged"] = translate_and_score(averaged, data_dir, tgt, os.path.join(save_dir, "generate-averaged.log"))
        row["best"] = translate_and_score(best, data_dir, tgt, os.path.join(save_dir, "generate-best.log"))
    write_atomically(row_path, json.dumps(row, indent=1) + "\n")
    print(json.dumps({k: row[k] for k in ("model_id", "seed", "recipe", "epochs", "best_valid_nll", "stopped_by")}),
          flush=True)
    return row


def reproduce(plan, args, data_dir, run):
    """Train each recorded run of ``plan`` afresh in ``args.workdir`` (to ``args.epochs`` or the recorded
    epochs), compare its validation NLL at every epoch with the row's and write the comparison to
    OUT/reproduced/; ToolError beyond TOLERANCE. A reproduction stopped part-way resumes from its own
    checkpoints when the command runs again (its folders carry a REPRODUCING mark); a folder without the
    mark holds a run it did not start, and is refused. Returns the comparisons' paths."""
    worst, written = 0.0, []
    for model_id, seed, name, _, row_path, _ in plan:
        if not os.path.exists(row_path):
            raise ToolError(f"--reproduce: {row_path} is not recorded; there is nothing to compare with")
        with open(row_path, encoding="utf-8") as f:
            recorded = json.load(f)
        run_dir = run_name(model_id, args.moa_config, seed, name)
        save_dir = os.path.join(args.workdir, "converged", run_dir)
        mark = os.path.join(save_dir, "REPRODUCING")
        if os.path.exists(save_dir) and not os.path.exists(mark):
            raise ToolError(f"--reproduce trains afresh, but {save_dir} holds a run it did not start: "
                            "name an empty --workdir")
        os.makedirs(save_dir, exist_ok=True)
        open(mark, "a").close()
        epochs = min(args.epochs or recorded["epochs"], recorded["epochs"])
        fresh_path = os.path.join(save_dir, "row.json")
        fresh = finished_row(fresh_path, epochs) or run_one(model_id, args.moa_config, seed, name, epochs, data_dir,
                                                            args.workdir, fresh_path, False, run)
        by_epoch = {}
        for epoch, figures in sorted(fresh["valid_nll_by_epoch"].items(), key=lambda item: int(item[0])):
            before = recorded["valid_nll_by_epoch"][str(epoch)]["nll"]
            by_epoch[str(epoch)] = {"fresh": figures["nll"], "recorded": before}
            print(f"{run_dir} epoch {epoch}: valid NLL {figures['nll']:.3f} bits, recorded {before:.3f} "
                  f"({figures['nll'] - before:+.3f})", flush=True)
        largest = max(abs(e["fresh"] - e["recorded"]) for e in by_epoch.values())
        worst = max(worst, largest)
        path = os.path.join(args.out, "reproduced", f"{run_dir}.json")
        write_atomically(path, json.dumps({
            "recorded_row": os.path.relpath(row_path, ROOT), "recorded_run": recorded["run"], "epochs": epochs,
            "valid_nll_by_epoch": by_epoch, "largest_difference_bits": largest, "tolerance_bits": TOLERANCE,
            "within_tolerance": largest <= TOLERANCE, "segments": fresh["segments"],
            "elapsed_s": fresh["elapsed_s"], "run": run}, indent=1) + "\n")
        written.append(path)
        if args.commit:
            commit(path, f"multi30k-converged: {run_dir} reproduced from a clean start over {epochs} epochs "
                         f"(largest difference {largest:.3f} bits)")
    print(f"largest difference: {worst:.3f} bits (tolerance {TOLERANCE})")
    if worst > TOLERANCE:
        raise ToolError(f"--reproduce: a validation NLL differs from its recorded value by {worst:.3f} bits, "
                        f"more than {TOLERANCE}")
    return written


def sweep_row_from_study(study_path, sweep_path):
    """The sweep's row for the study's own recipe, from the study's recorded seed-1 run: its first
    SWEEP_EPOCHS epochs are that sweep run (the schedule does not depend on the cap), so it is not trained
    twice. Nothing is written when the study has no such row."""
    if not os.path.exists(study_path):
        return
    with open(study_path, encoding="utf-8") as f:
        row = json.load(f)
    valid = {e: v for e, v in row["valid_nll_by_epoch"].items() if int(e) <= SWEEP_EPOCHS}
    best = min(valid, key=lambda e: (valid[e]["loss"], int(e)))
    row.update(epoch_cap=SWEEP_EPOCHS, epochs=max(int(e) for e in valid), updates=valid[max(valid, key=int)]["updates"],
               best_epoch=int(best), best_updates=valid[best]["updates"], best_valid_loss=valid[best]["loss"],
               best_valid_nll=valid[best]["nll"], valid_nll_by_epoch=valid, stopped_by="epoch cap",
               taken_from=os.path.relpath(study_path, ROOT))
    for key in ("averaged", "best", "train_wall_s", "elapsed_s", "train_words_per_s", "macs_per_target_token",
                "macs_run", "segments"):
        row.pop(key, None)  # figures of the whole run, not of its first epochs
    write_atomically(sweep_path, json.dumps(row, indent=1) + "\n")


def recount_macs(out, data_dir, run):
    """Count every recorded row's MACs per target token again, from a model built from its flags (the count
    does not depend on the trained weights, but for MoH's attention over its packed queries, a little), as
    :func:`~benchmarks.harness.macs.macs_per_target_token` counts now, and write them into the rows
    with the run that counted them (``macs_run``)."""
    for path in sorted(glob.glob(os.path.join(out, "runs", "*.json"))):
        with open(path, encoding="utf-8") as f:
            row = json.load(f)
        _, model_args = models(row["moa_config"] or DEFAULT_MOA)[row["model_id"]]
        before = row["macs_per_target_token"]
        row["macs_per_target_token"] = macs_per_target_token(data_dir, *PAIR.split("-"),
                                                             flags=[*SHAPE, *model_args, *COMMON_TRAINING])
        row["macs_run"] = run
        write_atomically(path, json.dumps(row, indent=1) + "\n")
        print(f"{os.path.basename(path)}: {before / 1e6:.2f}M -> {row['macs_per_target_token'] / 1e6:.2f}M MACs per "
              "target token", flush=True)


def commit(path, message):
    """Commit the one file ``path`` in the repository that holds it; a failure is reported, not raised
    (the row stays written)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        subprocess.run(["git", "-C", folder, "add", path], check=True, capture_output=True, text=True)
        subprocess.run(["git", "-C", folder, "commit", "-q", "-m", message, "--", path], check=True,
                       capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as error:
        print(f"could not commit {path}: {getattr(error, 'stderr', '') or error}", file=sys.stderr, flush=True)


def _main(argv):
    parser = study_parser("multi30k.converged", __doc__)
    parser.add_argument("--sweep", action="store_true",
                        help="train --models (default the Transformer), seed 1, with every recipe of the sweep")
    parser.add_argument("--report", action="store_true", help="train nothing: write the tables and the picture")
    parser.add_argument("--models", nargs="+", choices=list(models()),
                        help=f"default: {' '.join(REQUIRED_MODELS)}; with --sweep, transformer")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--moa-config", default=DEFAULT_MOA, metavar="kKeEdD",
                        help="MoA experts of the moa and moa-self models (default 4K8E64D)")
    parser.add_argument("--recipe", choices=list(SWEEP), help="train with this recipe instead of the sweep's choice")
    parser.add_argument("--commit", action="store_true",
                        help="git-commit each run's row (or reproduction) as it is written")
    parser.add_argument("--reproduce", action="store_true",
                        help="train the recorded runs afresh in --workdir (an empty folder, or one this option "
                             "started: it resumes) and compare their validation NLL at every epoch, written to "
                             f"OUT/reproduced/; exit 1 beyond {TOLERANCE} bits")
    parser.add_argument("--recount-macs", action="store_true",
                        help="train nothing: count every recorded row's MACs again from its model's flags")
    parser.add_argument("--epochs", type=int, help="with --reproduce: compare the first N epochs only")
    parser.add_argument("--smoke", action="store_true", help="the first 3,000 training lines, 2 epochs, rows to a "
                                                             "scratch --out: the whole path in minutes")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "benchmarks", "work-multi30k"))
    parser.add_argument("--out", default=OUT, help="folder of the rows, tables and picture")
    args = parser.parse_args(argv)
    try:
        models(args.moa_config)
    except ValueError as error:
        parser.error(str(error))
    if args.report:
        write_report(args.out, RECIPE, len(SWEEP))
        return
    recipe = args.recipe or RECIPE
    if not args.sweep and recipe is None:
        raise ToolError("no recipe is chosen yet: run --sweep first, or name one with --recipe")
    run = provenance("multi30k.converged", argv)
    if args.smoke and os.path.abspath(args.out) == OUT:
        parser.error("--smoke writes rows that are not the study's: name a scratch folder with --out")
    data_dir = prepare_multi30k(PAIR, args.workdir, args.smoke, once=True)
    if args.recount_macs:
        recount_macs(args.out, data_dir, run)
        return
    if args.sweep:
        plan = [(model_id, 1, name, SWEEP_EPOCHS,
                 os.path.join(args.out, "sweep", run_name(model_id, args.moa_config, 1, name) + ".json"), False)
                for model_id in args.models or ["transformer"] for name in SWEEP]
        for model_id, _, name, _, row_path, _ in plan:
            if name == RECIPE and not os.path.exists(row_path):
                sweep_row_from_study(os.path.join(args.out, "runs", os.path.basename(row_path)), row_path)
                if args.commit and os.path.exists(row_path):
                    commit(row_path, f"multi30k-converged: {os.path.basename(row_path)[:-5]} sweep row taken from "
                                     f"the study run's first {SWEEP_EPOCHS} epochs")
    else:
        args.models = args.models or REQUIRED_MODELS
        plan = [(model_id, seed, recipe, 2 if args.smoke else EPOCHS,
                 os.path.join(args.out, "runs", run_name(model_id, args.moa_config, seed, recipe) + ".json"), True)
                for seed in args.seeds for model_id in args.models]
    if args.reproduce:
        reproduce(plan, args, data_dir, run)
        return
    for model_id, seed, name, epochs, row_path, score in plan:
        if finished_row(row_path, epochs):
            print(f"recorded already, skipped: {row_path}", flush=True)
            continue
        row = run_one(model_id, args.moa_config, seed, name, epochs, data_dir, args.workdir, row_path, score, run)
        if args.commit:
            commit(row_path, f"multi30k-converged: {os.path.basename(row_path)[:-5]} finished "
                             f"(best valid NLL {row['best_valid_nll']:.3f} bits at epoch {row['best_epoch']})")


def main(argv=None) -> int:
    return run_tool("benchmarks.multi30k.converged", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
