"""Converting trained Transformers to MoH: moa-convert-moh and continued training, measured.

    .venv/bin/python -m benchmarks.convert_moh [--original CKPT] [--updates 300] [--mlm-updates 200]
    .venv/bin/python -m benchmarks.convert_moh --smoke          # minutes; the slow tests run it
    .venv/bin/python -m benchmarks.convert_moh --remeasure      # re-time decoding, re-score perplexity

What is converted, how it continues and what is reported: benchmarks/convert_moh/README.md.
"""

import json
import os
import re
import statistics
import sys
import time

import torch

from benchmarks.harness.corpora import (MLM_SHAPE, SHAPE, SHORT_TRAINING, TRANSFORMER as TRANSFORMER_ARGS,
                                        mlm_perplexities, mlm_train, prepare_multi30k, prepare_wikitext)
from benchmarks.harness.fairseq_runs import fairseq_train, log_figures, translate_and_score
from benchmarks.harness.results import ROOT, provenance, provenance_line, study_parser, study_results, write_result
from moa_tools import ToolError, run_tool
from moa_tools.checkpoints import load_checkpoint, save_atomically
from moa_tools.moh_conversion import continue_flags, convert

CONVERSIONS = [("75%", 2, 1), ("50%", 1, 1)]  # (label, shared heads, top-k) of 4 heads
ROUTERS = ["query-norm", "learned"]
TRANSFORMER = [*TRANSFORMER_ARGS, *SHAPE]
MOH_CRITERION = ["--criterion", "moa_label_smoothed_cross_entropy", "--moh-beta", "0.01"]
CONTINUE = ["--lr", "5e-4", "--warmup-updates", "50", "--max-tokens", "2048", "--seed", "1"]


def finetune(data_dir, model_flags, start, save, updates):
    """``updates`` more updates of ``start`` (fresh optimiser) into a fresh ``save``; its log."""
    return fairseq_train(os.path.join(data_dir, "data-bin"), [*model_flags, *SHORT_TRAINING, *CONTINUE, "--max-update",
                                                              str(updates), "--finetune-from-model", start], save)


def last_valid_nll(log):
    """The last validation NLL (bits, without label smoothing or auxiliary terms) of a training log."""
    return ([float("nan")] + list(log_figures(log)["valid_nll_by_updates"].values()))[-1]


def convert_to(original, original_state, shared, top_k, router, out):
    """``original`` (its loaded ``original_state``, which conversion leaves as it is) converted into ``out``."""
    state, summary = convert(original_state, shared, top_k, router, original)
    save_atomically(state, out)
    return state, summary


def trained_on(checkpoint):
    """The prepared data folder (the parent of the data-bin) ``checkpoint`` was trained on."""
    return os.path.dirname(load_checkpoint(checkpoint)["cfg"]["task"]["data"].rstrip("/"))


def translation(args, work):
    pair, tgt = "en-de", "de"
    original = args.original
    if original:  # its own prepared data: the dictionary must be the one it was trained on
        data_dir = trained_on(original)
        if not os.path.isfile(os.path.join(data_dir, "raw", f"test_2016_flickr.{tgt}")):
            raise ToolError(f"--original {original} was trained on {data_dir}, which holds no prepared Multi30k")
    else:
        data_dir = prepare_multi30k(pair, work, args.smoke)
        budget = ["--stop-time-hours", str(args.minutes / 60), "--max-epoch", "1000"] if not args.smoke else \
            ["--max-update", "20"]
        save = os.path.join(work, pair, "seed1", "original")  # the original as benchmarks.multi30k.equal_time trains it
        fairseq_train(os.path.join(data_dir, "data-bin"), [*TRANSFORMER, *SHORT_TRAINING, *budget, "--max-tokens", "2048",
                                                           "--warmup-updates", "200", "--seed", "1"], save)
        original = os.path.join(save, "checkpoint_best.pt")
    runs = []  # (label, shared, top_k, router, converted checkpoint or None, model flags)
    runs.append(("Transformer 4x64 (the original)", 4, 0, "-", original, TRANSFORMER))
    original_state = load_checkpoint(original)
    for label, shared, top_k in [c for c in CONVERSIONS if c[0] in args.conversions]:
        for router in ROUTERS:
            name = f"MoH {label} ({shared} shared + top-{top_k} of {4 - shared}), {router}"
            out = os.path.join(work, "converted", re.sub(r"\W+", "-", name).strip("-") + ".pt")
            os.makedirs(os.path.dirname(out), exist_ok=True)
            state, summary = convert_to(original, original_state, shared, top_k, router, out)
            print(summary, flush=True)
            runs.append((name, shared, top_k, router, out, continue_flags(state) + MOH_CRITERION))
    rows, tuned = [], {}
    for name, shared, top_k, router, start, flags in runs:
        save = os.path.dirname(tuned_checkpoint(work, name))
        before = translate_and_score(start, data_dir, tgt, os.path.join(os.path.dirname(start), "generate-"
                                        + os.path.basename(start) + ".log"))
        started = time.time()
        log = finetune(data_dir, flags, start, save, args.updates)
        wall = time.time() - started
        tuned[name] = tuned_checkpoint(work, name)
        after = translate_and_score(tuned[name], data_dir, tgt, os.path.join(save, "generate.log"))
        rows.append({"task": "translation", "model": name, "active_heads": (shared + top_k) / 4 if top_k else 1.0,
                     "router": router, "date": time.strftime("%Y-%m-%d"), "updates": args.updates,
                     "continue_wall_s": wall, "valid_nll_after": last_valid_nll(log),
                     "sacrebleu_before": before["sacrebleu"], "sacrebleu_after": after["sacrebleu"],
                     "decode_s": [after["decode_s"]], "signature": after["signature"]})
        print(json.dumps(rows[-1]), flush=True)
    for _ in range(args.speed_repeats - 1):  # more decoding times, taken in turn
        for row in rows:
            row["decode_s"].append(translate_and_score(tuned[row["model"]], data_dir, tgt,
                                                          tuned[row["model"]] + ".speed.log")["decode_s"])
    return decoding_ratios(rows), original


def tuned_checkpoint(work, name):
    return os.path.join(work, "continued", re.sub(r"\W+", "-", name).strip("-"), "checkpoint_last.pt")


def decoding_ratios(rows):
    base = rows[0]
    for row in rows:
        row["decode_s_median"] = statistics.median(row["decode_s"])
        row["decode_speed_vs_original"] = statistics.median(base["decode_s"]) / row["decode_s_median"]
        row["sacrebleu_vs_original_continued"] = row["sacrebleu_after"] - base["sacrebleu_after"]
    return rows


def retime_decoding(args, report):
    """Decoding times of the tuned models of an earlier run, taken again in turn (the code as it is now)."""
    rows = report["translation"]
    data_dir = trained_on(report["original"])
    for row in rows:
        row.setdefault("earlier_decode_s", []).append({"date": row["date"], "decode_s": row["decode_s"]})
        row["decode_s"], row["decode_date"] = [], time.strftime("%Y-%m-%d")
    for _ in range(args.speed_repeats):
        for row in rows:
            path = tuned_checkpoint(args.workdir, row["model"])
            row["decode_s"].append(translate_and_score(path, data_dir, "de", path + ".speed.log")["decode_s"])
    return decoding_ratios(rows)


def masked_lm(args, work):
    data_bin = prepare_wikitext(os.path.join(work, "mlm"))
    updates = 20 if args.smoke else args.mlm_original_updates
    original_dir = os.path.join(work, "mlm", "original")
    mlm_train(data_bin, ["--arch", "roberta", "--criterion", "masked_lm", *MLM_SHAPE], original_dir, updates)
    original = mlm_start(work, "-")
    runs = [("RoBERTa 4x64 (the original)", 4, 0, "-", original,
             ["--arch", "roberta", "--criterion", "masked_lm", *MLM_SHAPE])]
    label, shared, top_k = CONVERSIONS[0]
    original_state = load_checkpoint(original)
    for router in ROUTERS:
        name = f"MoH {label} ({shared} shared + top-{top_k} of {4 - shared}), {router}"
        out = mlm_start(work, router)
        state, summary = convert_to(original, original_state, shared, top_k, router, out)
        print(summary, flush=True)
        runs.append((name, shared, top_k, router, out, continue_flags(state) + ["--criterion", "moa_masked_lm"]))
    rows = []
    for name, shared, top_k, router, start, flags in runs:
        save = os.path.dirname(mlm_tuned(work, name))
        before = mlm_perplexities(start, data_bin)
        mlm_train(data_bin, flags, save, args.mlm_updates, ["--finetune-from-model", start])
        after = mlm_perplexities(mlm_tuned(work, name), data_bin)
        rows.append({"task": "masked LM", "model": name, "active_heads": (shared + top_k) / 4 if top_k else 1.0,
                     "router": router, "date": time.strftime("%Y-%m-%d"), "updates": args.mlm_updates,
                     "original_updates": updates, "test_ppl_before": before.get("test"),
                     "test_ppl_after": after.get("test"), "valid_ppl_after": after.get("valid")})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def mlm_start(work, router):
    """The original RoBERTa (router "-") or its conversion with ``router``."""
    return os.path.join(work, "mlm", "original", "checkpoint_last.pt") if router == "-" else \
        os.path.join(work, "mlm", f"converted-{router}.pt")


def mlm_tuned(work, name):
    return os.path.join(work, "mlm", "continued-" + re.sub(r"\W+", "-", name).strip("-"), "checkpoint_last.pt")


def rescore_perplexity(args, rows):
    """The perplexities of an earlier run's masked-LM checkpoints, evaluated again."""
    data_bin = os.path.join(args.workdir, "mlm", "wt2", "data-bin")
    for row in rows:
        before = mlm_perplexities(mlm_start(args.workdir, row["router"]), data_bin)
        after = mlm_perplexities(mlm_tuned(args.workdir, row["model"]), data_bin)
        row.update(test_ppl_before=before["test"], test_ppl_after=after["test"], valid_ppl_after=after["valid"],
                   ppl_date=time.strftime("%Y-%m-%d"))
    return rows


def markdown(translation_rows, mlm_rows, original):
    day = translation_rows[0]["date"] if translation_rows else mlm_rows[0]["date"]
    lines = [f"Conversion to MoH, {day}, {os.cpu_count()} CPUs, torch {torch.__version__}.", ""]
    if translation_rows:
        t = translation_rows[0]
        lines += [f"Multi30k En-De, test_2016_flickr, beam 4, length penalty 0.6. The original: {original}. "
                  f"Every row continues {t['updates']} updates from its start, fresh optimiser, lr 5e-4 after 50 "
                  f"warmup updates, batches of 2,048 tokens; checkpoint_last. Decoding: fairseq's time for the "
                  f"test set, median of {len(t['decode_s'])} runs taken in turn"
                  + (f", re-timed on {t['decode_date']} (earlier figures in the JSON)" if "decode_date" in t else "")
                  + ".", "",
                  "| model | heads active | sacreBLEU as converted | after the updates | vs the original continued | "
                  "valid NLL after | decode s | decoding speed vs the original |", "|---|---|---|---|---|---|---|---|"]
        for r in translation_rows:
            lines.append(f"| {r['model']} | {r['active_heads']:.0%} | {r['sacrebleu_before']:.2f} | "
                         f"{r['sacrebleu_after']:.2f} | {r['sacrebleu_vs_original_continued']:+.2f} | "
                         f"{r['valid_nll_after']:.3f} | {r['decode_s_median']:.1f} | "
                         f"{r['decode_speed_vs_original']:.2f}x |")
        lines += ["", f"sacreBLEU signature: {t['signature']}"]
    if mlm_rows:
        m = mlm_rows[0]
        lines += ["", f"Masked LM, WikiText-2 text (the MLM benchmark's data and settings): the original RoBERTa "
                  f"trained {m['original_updates']} updates; every row continues {m['updates']} updates "
                  "(fresh optimiser, the benchmark's schedule over those updates); masked-token test perplexity.", "",
                  "| model | heads active | test ppl as converted | after the updates | vs the original continued |",
                  "|---|---|---|---|---|"]
        for r in mlm_rows:
            lines.append(f"| {r['model']} | {r['active_heads']:.0%} | {r['test_ppl_before']:.2f} | "
                         f"{r['test_ppl_after']:.2f} | {r['test_ppl_after'] - m['test_ppl_after']:+.2f} |")
    return "\n".join(lines)


def _main(argv):
    parser = study_parser("convert_moh", __doc__)
    parser.add_argument("--original", help="a trained Multi30k En-De transformer checkpoint, read with the data it "
                                           "was trained on (default: train one)")
    parser.add_argument("--minutes", type=float, default=11.0, help="training time of the original (default 11)")
    parser.add_argument("--updates", type=int, default=300, help="continued updates, translation (default 300)")
    parser.add_argument("--speed-repeats", type=int, default=3, help="decoding-time runs per model (default 3)")
    parser.add_argument("--mlm-original-updates", type=int, default=600, help="updates of the original RoBERTa")
    parser.add_argument("--mlm-updates", type=int, default=200, help="continued updates, masked LM (default 200)")
    parser.add_argument("--tasks", nargs="+", choices=["translation", "mlm"], default=["translation", "mlm"])
    parser.add_argument("--conversions", nargs="+", choices=[c[0] for c in CONVERSIONS],
                        default=[c[0] for c in CONVERSIONS], help="active-head fractions to convert to (translation)")
    parser.add_argument("--smoke", action="store_true", help="small data, 20-update original, few updates")
    parser.add_argument("--remeasure", action="store_true",
                        help="train nothing: re-time decoding and re-score perplexity of the checkpoints of the run "
                             "that wrote --out, with the code as it is now")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "benchmarks", "work-convert-moh"))
    parser.add_argument("--out", default=study_results("convert_moh", "convert-moh"),
                        help="output prefix for .json and .md")
    args = parser.parse_args(argv)
    if args.smoke:
        args.updates, args.mlm_updates, args.speed_repeats = 4, 4, 1
    if args.original and not os.path.isfile(args.original):
        raise ToolError(f"--original {args.original} does not exist")
    os.makedirs(args.workdir, exist_ok=True)
    if args.remeasure:
        with open(args.out + ".json", encoding="utf-8") as f:
            report = json.load(f)
        translation_rows, original = retime_decoding(args, report), report["original"]
        mlm_rows = rescore_perplexity(args, report["mlm"])
    else:
        translation_rows, original = translation(args, args.workdir) if "translation" in args.tasks else ([], None)
        mlm_rows = masked_lm(args, args.workdir) if "mlm" in args.tasks else []
    run = provenance("convert_moh", argv)
    write_result(args.out, {"original": original, "translation": translation_rows, "mlm": mlm_rows, "run": run},
                 markdown(translation_rows, mlm_rows, original) + "\n\n" + provenance_line(run))


def main(argv=None) -> int:
    return run_tool("benchmarks.convert_moh", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
