"""Masked LM on WikiText-2 text: small MoA and MoH RoBERTas against a same-shape Transformer RoBERTa.

    .venv/bin/python -m benchmarks.wikitext.mlm [--updates 600] [--workdir DIR]
    .venv/bin/python -m benchmarks.wikitext.mlm --models moa --moa-config 4K32E64D --seeds 1 2
    .venv/bin/python -m benchmarks.wikitext.mlm --minutes 6 ...   # equal training time instead
    .venv/bin/python -m benchmarks.wikitext.mlm --smoke           # seconds of training (the slow tests run it)

The data, models, budgets and tables: benchmarks/wikitext/README.md. Rows already in --out for other
models, seeds or budgets stay, so runs made one at a time build one table.
"""

import json
import math
import os
import re
import statistics
import sys
import time

from benchmarks.harness.corpora import DEFAULT_MOA, MLM_SHAPE, mlm_models, mlm_perplexities, mlm_train, prepare_wikitext
from benchmarks.harness.fairseq_runs import log_figures
from benchmarks.harness.results import (ROOT, provenance, provenance_line, study_parser, study_results, table,
                                        write_result)
from moa_tools import run_tool

DEFAULT_MODELS = ["moa", "moh", "transformer"]
TITLE = ("MLM on WikiText-2 text, {cpus} CPUs, batches of 16 x 256-token samples, masked-token perplexity "
         "exp(NLL) on held-out lines; validation NLL in bits (log2 of the perplexity).")


def _main(argv):
    parser = study_parser("wikitext.mlm", __doc__)
    parser.add_argument("--updates", type=int, default=600,
                        help="updates per model, and the length of the learning-rate schedule (default 600)")
    parser.add_argument("--minutes", type=float,
                        help="equal training wall time per model instead (the schedule stays that of --updates)")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(mlm_models()),
                        help=f"which models to train (default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--moa-config", default=DEFAULT_MOA, metavar="kKeEdD",
                        help="experts of the MoA models (default 4K8E64D, moa_roberta_small's)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1], help="fairseq's --seed, one run each (default: 1)")
    parser.add_argument("--smoke", action="store_true", help="10 updates: a smoke run")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "benchmarks", "work-mlm"))
    parser.add_argument("--out", default=study_results("wikitext", "mlm", "mlm-wikitext2"),
                        help="output prefix for .json and .md; the rows already there for other models, seeds or "
                             "budgets are kept")
    args = parser.parse_args(argv)
    try:
        chosen = mlm_models(args.moa_config)
    except ValueError as error:
        parser.error(str(error))
    updates = 10 if args.smoke else args.updates
    budget = (f"equal training time, {args.minutes:g} min per model, schedule of {updates} updates"
              if args.minutes else f"equal updates, {updates} per model")
    extra = ["--stop-time-hours", str(args.minutes / 60)] if args.minutes else []
    data_bin = prepare_wikitext(args.workdir)
    run = provenance("wikitext.mlm", argv)
    rows = []
    for seed in args.seeds:
        for model_id in args.models:
            label, model_args = chosen[model_id]
            save = os.path.join(args.workdir, f"{model_id}-{args.moa_config}-seed{seed}")
            started = time.time()
            log = mlm_train(data_bin, [*model_args, *MLM_SHAPE], save, updates, extra, seed)
            rows.append(measured_row(model_id, args.moa_config if model_id.startswith("moa") else None, label, seed,
                                     budget, run, log, time.time() - started,
                                     mlm_perplexities(os.path.join(save, "checkpoint_last.pt"), data_bin)))
    write_report(rows, args.out, run)


def measured_row(model_id, moa_config, label, seed, budget, run, log, wall, perplexities, parameters=None):
    """One row of the tables: the model, its training (from its fairseq-train ``log``) and its perplexities."""
    figures = log_figures(log)
    row = {"model_id": model_id, "moa_config": moa_config, "model": label, "seed": seed, "budget": budget,
           "date": time.strftime("%Y-%m-%d"), "run": run, "parameters": parameters or figures["parameters"],
           "updates": figures["updates"], "train_wall_s": wall,
           "train_words_per_s": sum(figures["wps"]) / len(figures["wps"]) if figures["wps"] else math.nan,
           "valid_ppl": perplexities.get("valid"), "test_ppl": perplexities.get("test")}
    print(json.dumps({k: v for k, v in row.items() if k != "run"}), flush=True)
    return row


def natural_order(text):
    """A sort key that puts 4K8E64D before 4K16E64D."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def write_report(rows, out, run, title=TITLE):
    """Add ``rows`` to the rows of ``out``.json (replacing those of the same model, seed and budget; each
    row keeps the run that measured it); write both files, headed by ``title`` ({cpus}: the CPU count)."""
    key = lambda r: (r["model_id"], r["moa_config"], r["seed"], r["budget"])  # noqa: E731  (what a row measures)
    if os.path.exists(out + ".json"):
        with open(out + ".json", encoding="utf-8") as f:
            new = {key(r) for r in rows}
            rows = [r for r in json.load(f)["rows"] if key(r) not in new] + rows
    rows.sort(key=lambda r: (r["budget"], natural_order(r["model"]), r["seed"]))
    lines = [title.format(cpus=os.cpu_count()), ""]
    lines += table(["budget", "model", "seed", "date", "parameters", "updates", "train words/s", "wall s", "valid ppl",
                    "valid NLL", "test ppl"],
                   [[r["budget"], r["model"], r["seed"], r["date"], f"{r['parameters']:,}", r["updates"],
                     f"{r['train_words_per_s']:.0f}", f"{r['train_wall_s']:.0f}", f"{r['valid_ppl']:.2f}",
                     f"{math.log2(r['valid_ppl']):.3f}", f"{r['test_ppl']:.2f}"] for r in rows])
    groups = {}
    for r in rows:
        groups.setdefault((r["budget"], r["model_id"], r["moa_config"]), []).append(r)
    cells = []
    for group in groups.values():
        nll = [math.log2(r["valid_ppl"]) for r in group]
        cells.append([group[0]["budget"], group[0]["model"], ", ".join(str(r["seed"]) for r in group),
                      f"{statistics.mean(nll):.3f}", f"{max(nll) - min(nll):.3f}",
                      f"{statistics.mean(r['test_ppl'] for r in group):.2f}",
                      f"{statistics.mean(r['updates'] for r in group):.0f}"])
    lines += [""] + table(["budget", "model", "seeds", "mean valid NLL", "spread (max - min)", "mean test ppl",
                           "mean updates"], cells)
    commands = list(dict.fromkeys(provenance_line(r["run"]) for r in rows))
    write_result(out, {"rows": rows, "run": run},
                 "\n".join(lines + ["", "Rows measured by:", ""] + [f"- {line}" for line in commands]))


def main(argv=None) -> int:
    return run_tool("benchmarks.wikitext.mlm", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
