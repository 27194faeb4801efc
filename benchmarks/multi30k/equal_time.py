"""Multi30k at equal training time (or equal updates): small MoA and MoH models against a same-shape Transformer.

    .venv/bin/python -m benchmarks.multi30k.equal_time [--pairs en-de en-fr] [--minutes 11 | --updates N]
    .venv/bin/python -m benchmarks.multi30k.equal_time --models moa-self transformer --seeds 2 3
    .venv/bin/python -m benchmarks.multi30k.equal_time --combine A.json B.json --out ALL   # tables over both
    .venv/bin/python -m benchmarks.multi30k.equal_time --smoke      # minutes (the slow tests run it)

The models, data, budget and what is reported: benchmarks/multi30k/README.md.
"""

import json
import os
import re
import sys
import time
from collections import Counter

import torch

from benchmarks.harness.corpora import DEFAULT_MOA, SHAPE, SHORT_TRAINING as TRAINING, multi30k_models, prepare_multi30k
from benchmarks.harness.fairseq_runs import fairseq_train, log_figures, translate_and_score
from benchmarks.harness.macs import macs_per_target_token
from benchmarks.harness.results import (ROOT, provenance, provenance_line, study_parser, study_results, table,
                                        write_result)
from moa_tools import ToolError, run_tool

MODELS = multi30k_models()
DEFAULT_MODELS = ["moa", "moa-self", "moh", "transformer"]


def train_and_score(model_id, moa_config, label, model_args, pair, seed, data_dir, work, budget, run):
    """Train one model from scratch within ``budget`` (fairseq-train flags), then translate and score the test set."""
    src, tgt = pair.split("-")
    save = os.path.join(work, pair, f"seed{seed}", model_id)
    started = time.time()
    log = fairseq_train(os.path.join(data_dir, "data-bin"), [*SHAPE, *model_args, *TRAINING, *budget, "--seed", str(seed)],
                        save)
    figures = log_figures(log)
    checkpoint = os.path.join(save, "checkpoint_best.pt")
    return {"pair": pair, "model_id": model_id, "moa_config": moa_config if model_id.startswith("moa") else None,
            "model": label, "seed": seed, "date": time.strftime("%Y-%m-%d"), "run": run,
            "parameters": figures["parameters"],
            "macs_per_target_token": macs_per_target_token(data_dir, src, tgt, checkpoint),
            "updates": figures["updates"], "train_wall_s": time.time() - started,
            "train_words_per_s": sum(figures["wps"]) / len(figures["wps"]) if figures["wps"] else float("nan"),
            "best_valid_loss": min(figures["valid_loss"], default=float("nan")),
            "best_valid_nll": min(figures["valid_nll_by_updates"].values(), default=float("nan")),
            "valid_nll_by_updates": figures["valid_nll_by_updates"],
            **translate_and_score(checkpoint, data_dir, tgt, os.path.join(save, "generate.log"))}


def markdown(rows, budget_text):
    lines = [f"Multi30k, {os.cpu_count()} CPUs, torch {torch.__version__}, budget: {budget_text}.",
             "Test: test_2016_flickr, beam 4, length penalty 0.6, checkpoint_best. MACs: forward, per target token.",
             "Differences are to the Transformer of the same pair, seed and date: an equal-time budget buys as many "
             "updates as the machine's speed that day allows.", ""]
    lines += table(["pair", "seed", "date", "model", "parameters", "MACs/token", "train words/s", "train s", "updates",
                    "valid loss", "valid NLL", "sacreBLEU", "tok. BLEU"],
                   [[r["pair"], r["seed"], r["date"], r["model"], f"{r['parameters']:,}",
                     f"{r['macs_per_target_token'] / 1e6:.2f}M", f"{r['train_words_per_s']:.0f}", f"{r['train_wall_s']:.0f}",
                     r["updates"], f"{r['best_valid_loss']:.3f}", f"{r.get('best_valid_nll', float('nan')):.3f}",
                     f"{r['sacrebleu']:.2f}", f"{r['tokenized_bleu']:.2f}"] for r in rows])
    curves = [(r, {int(u): n for u, n in r.get("valid_nll_by_updates", {}).items()}) for r in rows]
    counts = Counter(u for _, curve in curves for u in curve)
    # the epoch ends, which most models reach; the validation at the time limit is at each model's own count
    points = sorted(u for u, n in counts.items() if n > len(rows) / 2)
    if points:
        lines += ["", "Validation NLL (bits) at equal updates, from the same runs (the schedule does not depend on "
                  "the budget):", ""]
        lines += table(["pair", "seed", "model"] + [f"{u} updates" for u in points],
                       [[r["pair"], r["seed"], r["model"]] + [f"{curve[u]:.3f}" if u in curve else "-" for u in points]
                        for r, curve in curves])
    differences, cells = {}, []  # (pair, model id, MoA configuration, label) -> one sacreBLEU difference per seed
    for t in [r for r in rows if r["model_id"] == "transformer"]:
        for m in [r for r in rows if r is not t and (r["pair"], r["seed"], r["date"]) == (t["pair"], t["seed"], t["date"])]:
            differences.setdefault((t["pair"], m["model_id"], m["moa_config"], m["model"]), []).append(
                m["sacrebleu"] - t["sacrebleu"])
            cells.append([t["pair"], t["seed"], t["date"], m["model"], f"{m['sacrebleu'] - t['sacrebleu']:+.2f}",
                          f"{m['train_words_per_s'] / t['train_words_per_s']:.2f}x",
                          f"{m['macs_per_target_token'] / t['macs_per_target_token']:.2f}x",
                          f"{m['parameters'] / t['parameters']:.2f}x"])
    lines += [""] + table(["pair", "seed", "date", "model", "BLEU difference to the Transformer", "words/s ratio",
                           "MACs ratio", "parameters ratio"], cells)
    if any(len(d) > 1 for d in differences.values()):
        lines += [""] + table(["pair", "model", "seeds", "mean BLEU difference to the Transformer", "per seed"],
                              [[pair, model, len(d), f"{sum(d) / len(d):+.2f}", ", ".join(f"{x:+.2f}" for x in d)]
                               for (pair, _, _, model), d in differences.items()])
    lines.append(f"\nsacreBLEU signature: {rows[0]['signature']}")
    return "\n".join(lines)


def combined(paths):
    """Rows and budget text of earlier result files, for one set of tables over all of them."""
    rows, budgets = [], []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
        # rows written before --seeds have no seed: --seed N put it in the budget text, else it was 1
        named = re.search(r", seed (\d+)$", report["budget"])
        for row in report["rows"]:
            row.setdefault("seed", int(named.group(1)) if named else 1)
            rows.append((path, row))
        budgets.append(re.sub(r", seeds? [\d, ]+$", "", report["budget"]))
    if len(set(budgets)) != 1:
        raise ToolError(f"--combine: these runs had different budgets ({'; '.join(sorted(set(budgets)))}); "
                        "their BLEU is not comparable")
    undated = sorted({path for path, row in rows if not {"date", "model_id", "moa_config"} <= set(row)})
    if undated:
        raise ToolError(f"--combine: the rows of {', '.join(undated)} carry no date, model id or MoA configuration; "
                        "add the day each was measured and the --models id and --moa-config that trained it")
    rows = sorted((row for _, row in rows), key=lambda r: (r["pair"], r["seed"], r["date"]))
    return rows, f"{budgets[0]}, seeds {', '.join(map(str, sorted({r['seed'] for r in rows})))}"


def _main(argv):
    parser = study_parser("multi30k.equal_time", __doc__)
    parser.add_argument("--pairs", nargs="+", default=["en-de", "en-fr"], choices=["en-de", "en-fr"])
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="equal training wall time per model (default 11)")
    budget.add_argument("--updates", type=int, help="equal updates per model instead (--smoke: 20)")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS),
                        help=f"which models to train (default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1], help="fairseq's --seed, one run each (default: 1)")
    parser.add_argument("--combine", nargs="+", metavar="JSON",
                        help="train nothing: write the tables over these result files (same budget) to --out")
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens per batch (default 2048)")
    parser.add_argument("--warmup-updates", type=int, default=200,
                        help="inverse_sqrt warmup to lr 1e-3 (default 200); both are named in the budget text, "
                             "so --combine keeps runs with other settings apart")
    parser.add_argument("--moa-config", default=DEFAULT_MOA, metavar="kKeEdD",
                        help="MoA experts of the moa models (default 4K8E64D, moa_small's); 4K4E128D has the "
                             "paper's Base proportions")
    parser.add_argument("--smoke", action="store_true", help="first 3000/200/100 lines, 2,000 pieces, 20 updates")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "benchmarks", "work-multi30k"))
    parser.add_argument("--out", default=study_results("multi30k", "equal-time", "translation-multi30k"),
                        help="output prefix for .json and .md")
    args = parser.parse_args(argv)
    try:
        chosen = multi30k_models(args.moa_config)
    except ValueError as error:
        parser.error(str(error))
    run = provenance("multi30k.equal_time", argv)
    if args.combine:
        return write_report(*combined(args.combine), args.out, run)
    if not args.updates and not args.smoke:
        args.minutes = args.minutes or 11.0
    if args.minutes:
        budget = ["--stop-time-hours", str(args.minutes / 60), "--max-epoch", "1000"]
        budget_text = f"equal training time, {args.minutes:g} min per model"
    else:
        budget, budget_text = ["--max-update", str(args.updates or 20)], f"equal updates, {args.updates or 20} per model"
    budget += ["--max-tokens", str(args.max_tokens), "--warmup-updates", str(args.warmup_updates)]
    budget_text += (f", batches of up to {args.max_tokens} tokens, {args.warmup_updates} warmup updates, "
                    f"seed{'s' if len(args.seeds) > 1 else ''} {', '.join(map(str, args.seeds))}")
    rows = []
    for pair in args.pairs:
        data_dir = prepare_multi30k(pair, args.workdir, args.smoke)
        for seed in args.seeds:
            for model_id in args.models:
                rows.append(train_and_score(model_id, args.moa_config, *chosen[model_id], pair, seed, data_dir,
                                            args.workdir, budget, run))
                print(json.dumps(rows[-1]), flush=True)
    write_report(rows, budget_text, args.out, run)


def write_report(rows, budget_text, out, run):
    """``out``.json (the rows, each with the run that measured it, and the run that wrote the file) and
    ``out``.md (the tables, and the command, commit and versions that wrote them)."""
    write_result(out, {"budget": budget_text, "rows": rows, "run": run},
                 markdown(rows, budget_text) + "\n\n" + provenance_line(run))


def main(argv=None) -> int:
    return run_tool("benchmarks.multi30k.equal_time", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
