"""Language models on WikiText-2 text: the small MoA, MoH and SwitchHead LMs against ``transformer_lm_small``, and a
trained ``transformer_lm_small`` converted to MoH and trained on, against the original trained on.

    .venv/bin/python -m benchmarks.wikitext.lm --seeds 1 2 3                 # equal updates (300)
    .venv/bin/python -m benchmarks.wikitext.lm --seeds 1 2 --minutes 2.5     # equal training time
    .venv/bin/python -m benchmarks.wikitext.lm --convert --seeds 1 2 3       # conversion (needs the first run)
    .venv/bin/python -m benchmarks.wikitext.lm --smoke [--convert]           # seconds of training

The data, models, budgets and tables: benchmarks/wikitext/README.md.
"""

import os
import re
import sys
import time

from benchmarks.harness.corpora import prepare_wikitext
from benchmarks.harness.fairseq_runs import fairseq_train
from benchmarks.harness.results import ROOT, provenance, study_parser, study_results
from benchmarks.wikitext.mlm import measured_row, write_report
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
    "switchhead": ("SwitchHead 2H2K4E56D (switchhead_lm_small)", ["--arch", "switchhead_lm_small", "--criterion",
                                                                  "moa_cross_entropy"]),
}
CONVERSIONS = {"moh-75": (2, 1), "moh-50": (1, 1)}  # id: (shared heads, top-k) of the 4 heads
TITLE = ("Language models on WikiText-2 text, {cpus} CPUs, 8 blocks of 128 sentencepiece tokens per update; "
         "fairseq-eval-lm perplexity (context window 64) on held-out lines; validation NLL in bits.")


def train(data_bin, model_args, save, updates, extra=(), seed=1):
    """The LM recipe: 8 blocks of 128 tokens per update, Adam, lr 1e-3 with a polynomial decay over
    ``updates`` (a tenth warmup), dropout 0.1, into a fresh ``save``; its log."""
    return fairseq_train(data_bin, ["--task", "language_modeling", *model_args, "--tokens-per-sample", "128",
                                    "--sample-break-mode", "none", "--batch-size", "8", "--optimizer", "adam",
                                    "--adam-betas", "(0.9, 0.98)", "--lr", "1e-3", "--clip-norm", "1.0",
                                    "--lr-scheduler", "polynomial_decay", "--warmup-updates", str(max(updates // 10, 1)),
                                    "--total-num-update", str(updates), "--max-update", str(updates), "--dropout", "0.1",
                                    "--no-epoch-checkpoints", "--cpu", "--num-workers", "0", "--seed", str(seed),
                                    "--log-format", "simple", "--log-interval", "50", "--disable-validation", *extra],
                         save)


def perplexities(checkpoint, data_bin) -> dict:
    """fairseq-eval-lm's perplexity of ``checkpoint`` on the valid and test lines."""
    result = {}
    for subset in ("valid", "test"):
        out = run_logged([fairseq_command("fairseq-eval-lm"), data_bin, "--user-dir", USER_DIR, "--path", checkpoint,
                          "--task", "language_modeling", "--gen-subset", subset, "--tokens-per-sample", "128",
                          "--context-window", "64", "--batch-size", "16", "--cpu", "--num-workers", "0"])
        result[subset] = float(re.search(r"Perplexity: ([\d.]+)", out).group(1))
    return result


def scored(model_id, label, seed, budget, run, log, wall, checkpoint, data_bin, parameters=None):
    return measured_row(model_id, None, label, seed, budget, run, log, wall, perplexities(checkpoint, data_bin),
                        parameters)


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
            state = load_checkpoint(converted)
            # not trained here: its weights counted, a tied one once (fairseq's buffers left out: its device
            # marker and its version number, both float tensors)
            weights = {t.data_ptr(): t for name, t in state["model"].items()
                       if t.is_floating_point() and not name.endswith(("_float_tensor", ".version"))}
            label = f"converted to MoH {shared} + top-{top_k} of {4 - shared}, query-norm router"
            rows.append(scored(f"converted-{model_id}", label + ", as converted", seed, f"trained {updates} updates, "
                               "converted", run, "", 0.0, converted, data_bin, sum(t.numel() for t in weights.values())))
            jobs.append((f"converted-{model_id}", label + ", trained on", converted,
                         [*continue_flags(state), "--criterion", "moa_cross_entropy"]))  # the flags the tool prints
        for model_id, label, start, model_args in jobs:
            save = os.path.join(workdir, f"continued-{model_id}-seed{seed}")
            started = time.time()
            log = train(data_bin, model_args, save, continue_updates, ["--finetune-from-model", start], seed)
            rows.append(scored(f"continued-{model_id}", label, seed, budget, run, log, time.time() - started,
                               os.path.join(save, "checkpoint_last.pt"), data_bin))
    return rows


def _main(argv):
    parser = study_parser("wikitext.lm", __doc__)
    parser.add_argument("--updates", type=int, default=300, help="updates per model and the schedule's length")
    parser.add_argument("--minutes", type=float, help="equal training wall time per model instead")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--convert", action="store_true", help="the conversion study instead")
    parser.add_argument("--continue-updates", type=int, default=150, help="updates after conversion (--convert)")
    parser.add_argument("--smoke", action="store_true", help="10 updates (5 after conversion): a smoke run")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "benchmarks", "work-lm"))
    parser.add_argument("--out", default=study_results("wikitext", "lm"), help="folder of the result files")
    args = parser.parse_args(argv)
    if args.smoke:
        args.updates, args.continue_updates = 10, 5
    data_bin = prepare_wikitext(args.workdir)
    run = provenance("wikitext.lm", argv)
    if args.convert:
        rows = convert_and_continue(data_bin, args.workdir, args.seeds, args.updates, args.continue_updates, run)
        return write_report(rows, os.path.join(args.out, "convert-lm"), run, TITLE)
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
            rows.append(scored(model_id, label, seed, budget, run, log, time.time() - started,
                               os.path.join(save, "checkpoint_last.pt"), data_bin))
    write_report(rows, os.path.join(args.out, "lm-wikitext2"), run, TITLE)


def main(argv=None) -> int:
    return run_tool("benchmarks.wikitext.lm", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
