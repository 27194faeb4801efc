"""Masked LM on WikiText-2 text: small MoA and MoH RoBERTas against a same-shape Transformer RoBERTa.

    .venv/bin/python -m benchmarks.mlm_wikitext2 [--updates 600] [--workdir DIR]
    .venv/bin/python -m benchmarks.mlm_wikitext2 --models moa --moa-config 4K32E64D --seeds 1 2
    .venv/bin/python -m benchmarks.mlm_wikitext2 --minutes 6 ...   # equal training time instead

Uses wikitext-2/wiki.valid.tokens of the shared data folder (the only WikiText split kept on
this machine): the first 90% of its lines train, the next 5% validate, the last
5% test. The text goes through examples/mlm/prepare-wikitext-103.sh (offline, via
--mirror, 8,000 sentencepiece pieces), then the models train with the same
shape (d_model 256, FFN 1024, 4 layers), batch, learning-rate schedule (polynomial decay over
--updates, a tenth of them warmup) and budget, and are scored by moa-eval-ppl on the held-out
lines. The budget is the same number of updates (--updates, default 600), or the same training
wall time (--minutes; fairseq's --stop-time-hours, the schedule still that of --updates, so a
faster model gets further along it). The models (--models, by id; result rows carry the id as ``model_id``):

* ``moa``: ``moa_roberta_small``, MoA 4K8E64D (or --moa-config kKeEdD: top-k of e experts of
  width d), the arch's defaults; ``moa-normal-router``: the same with --moa-router-init normal;
* ``moh``: ``moh_roberta_small``, 2 shared + top-1 of 2 of the 4 heads of 64;
* ``transformer``: fairseq's ``roberta`` with 4 heads of 64.

Every model trains once per seed (--seeds, fairseq's --seed). The rows go to --out (default
benchmarks/results/mlm-wikitext2/mlm-wikitext2.{json,md}); rows already there for other models, seeds or
budgets stay, so runs made one at a time build one table; each row keeps the command, commit and
versions that measured it. The tables give each row and, per model, the mean and spread over its seeds.
"""

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
import zipfile

from benchmarks.common import RESULTS, ROOT, moa_expert_flags, provenance, provenance_line, shared_data, write_atomically
from moa_tools import USER_DIR, ToolError, fairseq_command, run_logged, run_tool

SOURCE = shared_data("wikitext-2", "wiki.valid.tokens")
SHAPE = ["--encoder-layers", "4", "--encoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024",
         "--encoder-attention-heads", "4"]
DEFAULT_MOA = "4K8E64D"


def models(moa_config=DEFAULT_MOA):
    """--models id -> (label in the tables, fairseq-train arguments), MoA as ``moa_config`` (kKeEdD).
    Result rows carry the id (``model_id``); the label is only what the tables print."""
    moa = ["--arch", "moa_roberta_small", "--criterion", "moa_masked_lm", *moa_expert_flags(moa_config)]
    return {"moa": (f"MoA {moa_config} (moa_roberta_small)", moa),
            "moa-normal-router": (f"MoA {moa_config}, normal-initialised router", moa + ["--moa-router-init", "normal"]),
            "moh": ("MoH 2+1of2, 75% active (moh_roberta_small)", ["--arch", "moh_roberta_small", "--criterion", "moa_masked_lm"]),
            "transformer": ("Transformer 4x64 (roberta)", ["--arch", "roberta", "--criterion", "masked_lm"])}


DEFAULT_MODELS = ["moa", "moh", "transformer"]


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


def train(data_bin, model_args, save, updates, extra=(), seed=1):
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
                       "--save-dir", save, "--no-epoch-checkpoints", "--cpu", "--num-workers", "0", "--seed", str(seed),
                       "--log-format", "simple", "--log-interval", "50", "--skip-invalid-size-inputs-valid-test",
                       *extra], os.path.join(save, "train.log"))


def perplexities(checkpoint, data_bin) -> dict:
    """moa-eval-ppl's masked-token perplexity of ``checkpoint`` on the valid and test lines."""
    out = run_logged([fairseq_command("moa-eval-ppl"), checkpoint, data_bin, "valid", "test", "--",
                      "--skip-invalid-size-inputs-valid-test"])
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+): .*exp\(NLL\) = ([\d.]+)", out, re.M)}


def _main(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mlm_wikitext2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=600,
                        help="updates per model, and the length of the learning-rate schedule (default 600)")
    parser.add_argument("--minutes", type=float,
                        help="equal training wall time per model instead (the schedule stays that of --updates)")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(models()),
                        help=f"which models to train (default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--moa-config", default=DEFAULT_MOA, metavar="kKeEdD",
                        help="experts of the MoA models (default 4K8E64D, moa_roberta_small's)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1], help="fairseq's --seed, one run each (default: 1)")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "benchmarks", "work-mlm"))
    parser.add_argument("--out", default=os.path.join(RESULTS, "mlm-wikitext2", "mlm-wikitext2"),
                        help="output prefix for .json and .md; the rows already there for other models, seeds or "
                             "budgets are kept")
    args = parser.parse_args(argv)
    try:
        chosen = models(args.moa_config)
    except ValueError as error:
        parser.error(str(error))
    if not os.path.exists(SOURCE):
        raise ToolError(f"{SOURCE} is missing: this benchmark reads the shared WikiText-2 file "
                        "(set MOA_SHARED_DATA to the folder that holds wikitext-2/)")
    budget = (f"equal training time, {args.minutes:g} min per model, schedule of {args.updates} updates"
              if args.minutes else f"equal updates, {args.updates} per model")
    extra = ["--stop-time-hours", str(args.minutes / 60)] if args.minutes else []
    data_bin = prepare(args.workdir)
    run = provenance("mlm_wikitext2", argv)
    rows = []
    for seed in args.seeds:
        for model_id in args.models:
            label, model_args = chosen[model_id]
            save = os.path.join(args.workdir, f"{model_id}-{args.moa_config}-seed{seed}")
            started = time.time()
            log = train(data_bin, [*model_args, *SHAPE], save, args.updates, extra, seed)
            wall = time.time() - started
            train_lines = [line for line in log.splitlines() if "| train |" in line]
            wps = [float(x) for line in train_lines for x in re.findall(r"\| wps ([\d.]+)", line)]
            updates = [int(x) for line in train_lines for x in re.findall(r"\| num_updates (\d+)", line)]
            ppl = perplexities(os.path.join(save, "checkpoint_last.pt"), data_bin)
            params = re.search(r"num\. shared model params: ([\d,]+)", log)
            row = {"model_id": model_id, "moa_config": args.moa_config if model_id.startswith("moa") else None,
                   "model": label, "seed": seed, "budget": budget,
                   "date": time.strftime("%Y-%m-%d"), "run": run,
                   "parameters": int(params.group(1).replace(",", "")) if params else None,
                   "updates": updates[-1] if updates else None, "train_wall_s": wall,
                   "train_words_per_s": sum(wps) / len(wps) if wps else math.nan,
                   "valid_ppl": ppl.get("valid"), "test_ppl": ppl.get("test")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_report(rows, args.out, run)


def row_key(row):
    """What one row measures: the model (by id and MoA configuration), the seed and the budget."""
    return row["model_id"], row["moa_config"], row["seed"], row["budget"]


def natural_order(text):
    """A sort key that puts 4K8E64D before 4K16E64D."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


MLM_TITLE = ("MLM on WikiText-2 text, {cpus} CPUs, batches of 16 x 256-token samples, masked-token perplexity "
             "exp(NLL) on held-out lines; validation NLL in bits (log2 of the perplexity).")


def write_report(rows, out, run, title=MLM_TITLE):
    """Add ``rows`` to the rows of ``out``.json (replacing those of the same model, seed and budget; each
    row keeps the run that measured it); write both files, headed by ``title`` ({cpus}: the CPU count)."""
    if os.path.exists(out + ".json"):
        with open(out + ".json", encoding="utf-8") as f:
            kept = json.load(f)["rows"]
        new = {row_key(r) for r in rows}
        rows = [r for r in kept if row_key(r) not in new] + rows
    rows.sort(key=lambda r: (r["budget"], natural_order(r["model"]), r["seed"]))
    lines = [title.format(cpus=os.cpu_count()), "",
             "| budget | model | seed | date | parameters | updates | train words/s | wall s | valid ppl | valid NLL | "
             "test ppl |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget']} | {r['model']} | {r['seed']} | {r['date']} | {r['parameters']:,} | {r['updates']} | "
                     f"{r['train_words_per_s']:.0f} | {r['train_wall_s']:.0f} | {r['valid_ppl']:.2f} | "
                     f"{math.log2(r['valid_ppl']):.3f} | {r['test_ppl']:.2f} |")
    groups = {}
    for r in rows:
        groups.setdefault((r["budget"], r["model_id"], r["moa_config"]), []).append(r)
    lines += ["", "| budget | model | seeds | mean valid NLL | spread (max - min) | mean test ppl | mean updates |",
              "|---|---|---|---|---|---|---|"]
    for (budget, _, _), group in groups.items():
        budget, model = group[0]["budget"], group[0]["model"]
        nll = [math.log2(r["valid_ppl"]) for r in group]
        lines.append(f"| {budget} | {model} | {', '.join(str(r['seed']) for r in group)} | {statistics.mean(nll):.3f} | "
                     f"{max(nll) - min(nll):.3f} | {statistics.mean(r['test_ppl'] for r in group):.2f} | "
                     f"{statistics.mean(r['updates'] for r in group):.0f} |")
    commands = list(dict.fromkeys(provenance_line(r["run"]) for r in rows))
    text = "\n".join(lines + ["", "Rows measured by:", ""] + [f"- {line}" for line in commands])
    print("\n" + text)
    write_atomically(out + ".json", json.dumps({"rows": rows, "run": run}, indent=1))
    write_atomically(out + ".md", text + "\n")


def main(argv=None) -> int:
    return run_tool("benchmarks.mlm_wikitext2", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
