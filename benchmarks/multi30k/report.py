"""The tables, verdicts and picture of the converged Multi30k study, from the rows its runs recorded.

    .venv/bin/python -m benchmarks.multi30k.converged --report

Reads ``sweep/*.json``, ``runs/*.json`` and ``reproduced/*.json`` of the study's folder and writes
``converged.md`` (the sweep, every run, each model's difference to the Transformer of the same seed, the
verdicts, the reproductions),
``valid-nll.png`` (validation NLL in bits against updates, every model and seed) and
``sweep-valid-nll.png`` (the same for the sweep's recipes).
"""

import glob
import json
import math
import os
import re
import statistics

from benchmarks.harness.corpora import SWITCHHEAD_EQUAL_COST, SWITCHHEAD_PARAMETERS
from benchmarks.harness.results import command_note, provenance, provenance_line, table, write_atomically

NLL_TIE = 0.02  # bits of validation NLL: smaller in every seed is a tie, not a finding
# (question, model id, MoA configuration or None, the model it is compared with, of the same seed and recipe)
QUESTIONS = [("MoA 4K8E64D against the Transformer", "moa", "4K8E64D", "transformer"),
             ("MoH 75% against the Transformer", "moh", None, "transformer"),
             ("MoA 4K8E64D against the Transformer of its cost (FFN 768)", "moa", "4K8E64D", "transformer-narrow"),
             ("MoA 4K4E64D (every expert on every token) against the Transformer of its cost", "moa", "4K4E64D",
              "transformer-narrow"),
             ("MoA 4K8E64D (4 of 8 experts chosen per token) against MoA 4K4E64D (no choice, the same cost)", "moa",
              "4K8E64D", "moa 4K4E64D"),
             ("MoA 4K16E64D against the Transformer", "moa", "4K16E64D", "transformer"),
             ("MoA 4K32E64D against the Transformer", "moa", "4K32E64D", "transformer"),
             ("MoA 4K4E128D (the paper base's proportions) against the Transformer", "moa", "4K4E128D", "transformer"),
             ("MoA in self-attention only against the Transformer", "moa-self", "4K8E64D", "transformer"),
             (f"SwitchHead {SWITCHHEAD_EQUAL_COST} (MoA 4K8E64D's cost) against the Transformer", "switchhead", None,
              "transformer"),
             (f"SwitchHead {SWITCHHEAD_EQUAL_COST} against the Transformer of its cost (FFN 768)", "switchhead", None,
              "transformer-narrow"),
             (f"SwitchHead {SWITCHHEAD_EQUAL_COST} against MoA 4K8E64D at equal cost", "switchhead", None,
              "moa 4K8E64D"),
             (f"SwitchHead {SWITCHHEAD_EQUAL_COST} against MoA 4K4E64D at equal cost", "switchhead", None,
              "moa 4K4E64D"),
             (f"SwitchHead {SWITCHHEAD_PARAMETERS} (the Transformer's parameters) against the Transformer",
              "switchhead-params", None, "transformer"),
             (f"SwitchHead {SWITCHHEAD_PARAMETERS} against the Transformer of MoA's cost (FFN 768)", "switchhead-params",
              None, "transformer-narrow")]


def rows_in(folder):
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path, encoding="utf-8") as f:
            rows.append(json.load(f))
    return rows


def sweep_table(sweep, recipes):
    best = min(sweep, key=lambda r: r["best_valid_nll"]) if sweep else None
    cells = []
    for r in sorted(sweep, key=lambda r: r["best_valid_nll"]):
        flags = dict(zip(r["recipe_flags"][::2], r["recipe_flags"][1::2]))
        mark = (" (lowest)" if len(sweep) == recipes else " (lowest so far)") if r is best else ""
        cells.append([r["recipe"] + mark, flags["--lr"], flags["--warmup-updates"], flags["--max-tokens"],
                      flags["--dropout"], r["epochs"], r["updates"], f"{r['best_valid_nll']:.3f}", r["best_epoch"],
                      f"{r['train_wall_s'] / 60:.0f}" if "train_wall_s" in r else "in the study run"])
    return table(["recipe", "peak lr", "warmup updates", "tokens per batch", "dropout", "epochs", "updates",
                  "best valid NLL (bits)", "at epoch", "training min"], cells)


def runs_table(runs):
    return table(["model", "seed", "parameters", "MACs/token", "epochs (stopped by)", "best epoch (updates)",
                  "best valid NLL", "words/s", "training min", "sacreBLEU, average", "tok. BLEU, average",
                  "sacreBLEU, best", "tok. BLEU, best"],
                 [[r["model"], r["seed"], f"{r['parameters']:,}", f"{r['macs_per_target_token'] / 1e6:.2f}M",
                   f"{r['epochs']} ({r['stopped_by']})", f"{r['best_epoch']} ({r['best_updates']})",
                   f"{r['best_valid_nll']:.3f}", f"{r['train_words_per_s']:.0f}", f"{r['train_wall_s'] / 60:.0f}",
                   f"{r['averaged']['sacrebleu']:.2f}", f"{r['averaged']['tokenized_bleu']:.2f}",
                   f"{r['best']['sacrebleu']:.2f}", f"{r['best']['tokenized_bleu']:.2f}"] for r in runs])


def reproduced_table(comparisons):
    return table(["run", "epochs trained afresh", "largest difference in valid NLL (bits)", "within tolerance", "calls",
                  "recorded at commit", "reproduced at commit", "threads (recorded, reproduced)"],
                 [[os.path.basename(c["recorded_row"])[:-5], c["epochs"], f"{c['largest_difference_bits']:.3f}",
                   f"{'yes' if c['within_tolerance'] else 'no'} ({c['tolerance_bits']})", c["segments"],
                   c["recorded_run"]["commit"][:7], c["run"]["commit"][:7],
                   f"{c['recorded_run'].get('threads', 'default')}, {c['run'].get('threads', 'default')}"] for c in comparisons])


def differences(runs, model_id, moa_config, baseline="transformer"):
    """[(seed, valid NLL difference, averaged sacreBLEU difference, best-checkpoint sacreBLEU difference,
    MACs ratio)] of one model to the ``baseline`` model of the same seed and recipe (``baseline``: a model id,
    or a model id and a MoA configuration, e.g. ``moa 4K4E64D``)."""
    baseline_id, _, baseline_config = baseline.partition(" ")
    baselines = {(r["seed"], r["recipe"]): r for r in runs
                 if r["model_id"] == baseline_id and (not baseline_config or r["moa_config"] == baseline_config)}
    out = []
    for r in runs:
        if r["model_id"] != model_id or r["moa_config"] != moa_config or (r["seed"], r["recipe"]) not in baselines:
            continue
        t = baselines[(r["seed"], r["recipe"])]
        out.append((r["seed"], r["best_valid_nll"] - t["best_valid_nll"],
                    r["averaged"]["sacrebleu"] - t["averaged"]["sacrebleu"], r["best"]["sacrebleu"] - t["best"]["sacrebleu"],
                    r["macs_per_target_token"] / t["macs_per_target_token"]))
    return sorted(out)


def verdict(diffs, baseline="transformer"):
    """One sentence from the per-seed differences: which way, and whether the sign holds in every seed."""
    if not diffs:
        return "not measured yet"
    bleu = [d[2] for d in diffs]
    nll = [d[1] for d in diffs]
    if len(diffs) < 2:
        return (f"one seed only ({bleu[0]:+.2f} sacreBLEU, {nll[0]:+.3f} bits valid NLL): no verdict before a "
                "second seed")
    same_bleu = all(b > 0 for b in bleu) or all(b < 0 for b in bleu)
    same_nll = all(n > 0 for n in nll) or all(n < 0 for n in nll)
    seeds = f"{len(diffs)} seeds ({', '.join(f'{b:+.2f}' for b in bleu)})"
    nll_words = (f"validation NLL {statistics.mean(nll):+.3f} bits"
                 f" ({'same sign in every seed' if same_nll else 'sign differs between seeds'})")
    ties = [d[0] for d in diffs if abs(d[1]) < NLL_TIE]
    if len(ties) == len(diffs):
        nll_words += f", a tie (under {NLL_TIE} bits in every seed)"
    elif ties:
        nll_words += f", under {NLL_TIE} bits in seed {', '.join(map(str, ties))} only, so not a tie"
    if not same_bleu:
        return (f"no consistent difference: {statistics.mean(bleu):+.2f} sacreBLEU on average over {seeds}, "
                f"the sign differs between seeds; {nll_words}")
    word = "better" if bleu[0] > 0 else "worse"
    return (f"{word} in every seed: by {abs(statistics.mean(bleu)):.2f} sacreBLEU on average over {seeds}; "
            f"{nll_words}; at {statistics.mean(d[4] for d in diffs):.2f}x the MACs of {baseline}")


def resumed_across_commits(rows):
    """A line for each row whose fairseq-train calls (a run resumed across sessions) trained at different
    commits, naming each call's commit in order."""
    return [f"- {r['model']}, seed {r['seed']}, {r['recipe']}: resumed across commits, its fairseq-train calls at "
            f"{', '.join(c[:7] if c else 'unrecorded' for c in r['segment_commits'])}"
            for r in rows if len(set(r.get("segment_commits") or [])) > 1]


def experts_slope(runs, baseline="transformer"):
    """One sentence on MoA kK{E}E64D against the number of experts E: the least-squares slope of validation NLL
    (mean over seeds) per doubling of E, each seed's slope, and where the most experts stand against ``baseline``."""
    by_experts = {}
    for r in runs:
        shape = r["model_id"] == "moa" and re.fullmatch(r"4K(\d+)E64D", r["moa_config"] or "")
        if shape:
            by_experts.setdefault(int(shape.group(1)), {})[r["seed"]] = r["best_valid_nll"]
    seeds = sorted(set.intersection(*(set(v) for v in by_experts.values()))) if by_experts else []
    if len(by_experts) < 3 or not seeds:
        return f"not measured yet ({', '.join(f'{e} experts' for e in sorted(by_experts)) or 'no run'} recorded)"

    def slope(points):
        xs, ys = [math.log2(e) for e, _ in points], [y for _, y in points]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)

    experts = sorted(by_experts)
    means = [(e, statistics.mean(by_experts[e][s] for s in seeds)) for e in experts]
    per_seed = [slope([(e, by_experts[e][s]) for e in experts]) for s in seeds]
    most = differences(runs, "moa", f"4K{experts[-1]}E64D", baseline)
    reach = (f"4K{experts[-1]}E64D against {baseline}: {', '.join(f'{d[1]:+.3f}' for d in most)} bits by seed"
             if most else f"4K{experts[-1]}E64D has no {baseline} of its seeds")
    return (f"{slope(means):+.3f} bits of validation NLL per doubling of E over {experts} experts (mean of seeds "
            f"{', '.join(map(str, seeds))}; per seed {', '.join(f'{x:+.3f}' for x in per_seed)}); {reach}")


def plotting():
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(figure, path, rect=None):
    figure.tight_layout(rect=rect)
    tmp = path + ".tmp.png"
    figure.savefig(tmp, dpi=110)
    figure.clf()
    os.replace(tmp, path)


def frontier(runs, path, x_key, x_label):
    """Two panels, validation NLL and averaged sacreBLEU against ``x_key`` (MACs per target token or
    parameters): every run a point (circles seed 1, squares seed 2), the two Transformers (the full and the
    narrow one) joined through their seed means as the dense frontier."""
    plt = plotting()
    figure, panels = plt.subplots(1, 2, figsize=(12, 7.5))
    colours = {}
    for axes, (y_label, y) in zip(panels, (("validation NLL (bits per token)", lambda r: r["best_valid_nll"]),
                                           ("sacreBLEU, last 5 epochs averaged", lambda r: r["averaged"]["sacrebleu"]))):
        labelled = set()
        for r in runs:
            colour = colours.setdefault(r["model"], f"C{len(colours)}")
            axes.scatter(r[x_key] / 1e6, y(r), color=colour, marker="o" if r["seed"] == 1 else "s",
                         label=None if r["model"] in labelled else r["model"])
            labelled.add(r["model"])
        dense = {}
        for r in runs:
            if r["model_id"] in ("transformer", "transformer-narrow"):
                dense.setdefault(r[x_key] / 1e6, []).append(y(r))
        if len(dense) > 1:
            axes.plot(sorted(dense), [statistics.mean(dense[x]) for x in sorted(dense)], color="grey",
                      linestyle=":", label="Transformers (seed mean)")
        axes.set_xlabel(x_label)
        axes.set_ylabel(y_label)
        axes.grid(alpha=0.3)
    figure.legend(*panels[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)  # below: no point hidden
    figure.suptitle("Multi30k En-De, trained to convergence: every run (circles seed 1, squares seed 2)")
    save(figure, path, rect=(0, 0.22, 1, 1))


def picture(runs, path, title, label, colour_by, dashed):
    """Validation NLL against updates, one line per row: ``label(row)`` in the legend, one colour per
    ``colour_by(row)``, dashed where ``dashed(row)``."""
    plt = plotting()
    figure, axes = plt.subplots(figsize=(8, 5))
    colours = {}
    for r in runs:
        colour = colours.setdefault(colour_by(r), f"C{len(colours)}")
        curve = sorted((v["updates"], v["nll"]) for v in r["valid_nll_by_epoch"].values())
        axes.plot(*zip(*curve), color=colour, linestyle="--" if dashed(r) else "-", marker=".", label=label(r))
    axes.set_xlabel("updates")
    axes.set_ylabel("validation NLL (bits per token)")
    axes.set_title(title)
    low = min((v["nll"] for r in runs for v in r["valid_nll_by_epoch"].values()), default=2.0)
    axes.set_ylim(low - 0.1, low + 1.5)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    save(figure, path)


def write_report(out, recipe, recipes):
    """converged.md and the pictures in ``out`` from its rows; ``recipe``: the study's recipe, of ``recipes`` swept."""
    made_by = provenance_line(provenance("multi30k.converged", ["--report"]))  # before the pictures change the tree
    sweep, runs = rows_in(os.path.join(out, "sweep")), rows_in(os.path.join(out, "runs"))
    runs.sort(key=lambda r: (r["seed"], r["model_id"] != "transformer", r["model_id"], r["moa_config"] or ""))
    lines = ["# Converged Multi30k En-De", ""]
    for model in dict.fromkeys(r["model"] for r in sorted(sweep, key=lambda r: r["model_id"] != "transformer")):
        rows = [r for r in sweep if r["model"] == model]
        lines += [f"## The recipe sweep: {model}, seed 1, validation only", "", *sweep_table(rows, recipes), ""]
        chosen = [r for r in rows if r["recipe"] == recipe]
        if chosen and len(rows) == recipes:
            low = min(rows, key=lambda r: r["best_valid_nll"])
            margin = chosen[0]["best_valid_nll"] - low["best_valid_nll"]
            lines += [f"The study's recipe ({recipe}) is this model's lowest.", ""] if low is chosen[0] else \
                [f"The study's recipe ({recipe}) is {margin:.3f} bits above this model's lowest ({low['recipe']}): "
                 f"{'another recipe wins' if margin > NLL_TIE else 'a tie'} (the bar: {NLL_TIE} bits).", ""]
    lines += ["## Every run", "",
             "Test: test_2016_flickr, beam 4, length penalty 0.6; *average*: the last epoch checkpoints averaged; "
             "*best*: checkpoint_best (lowest validation loss). MACs: forward, per target token, counted with the "
             "experts' grouped GEMM and the fused attention (moa.flops). Valid NLL in bits.",
             "", *runs_table(runs), "", "## Differences to the model compared with, of the same seed", "",
             "| model | against | seed | valid NLL | sacreBLEU, average | sacreBLEU, best | MACs ratio |",
             "|---|---|---|---|---|---|---|"]
    for _, model_id, config, baseline in QUESTIONS:
        for seed, nll, avg, best, macs in differences(runs, model_id, config, baseline):
            label = next(r["model"] for r in runs if r["model_id"] == model_id and r["moa_config"] == config)
            lines.append(f"| {label} | {baseline} | {seed} | {nll:+.3f} | {avg:+.2f} | {best:+.2f} | {macs:.2f}x |")
    lines += ["", "## Verdicts", ""]
    lines += [f"- **{question}**: {verdict(differences(runs, model_id, config, baseline), baseline)}."
              for question, model_id, config, baseline in QUESTIONS]
    lines.append(f"- **MoA 4K{{4,8,16,32}}E64D, validation NLL against the number of experts**: {experts_slope(runs)}.")
    reproduced = rows_in(os.path.join(out, "reproduced"))
    if reproduced:
        lines += ["", "## Reproduced from a clean start (`--reproduce`)", "", *reproduced_table(reproduced)]
    if runs:
        lines += ["", f"sacreBLEU signature: {runs[0]['averaged']['signature']}"]
        picture(runs, os.path.join(out, "valid-nll.png"), "Multi30k En-De, validation NLL at each epoch's end",
                label=lambda r: f"{r['model']}, seed {r['seed']}", colour_by=lambda r: r["model"],
                dashed=lambda r: r["seed"] != 1)
        frontier(runs, os.path.join(out, "frontier-macs.png"), "macs_per_target_token", "MACs per target token (M)")
        frontier(runs, os.path.join(out, "frontier-parameters.png"), "parameters", "parameters (M)")
    if sweep:
        picture(sweep, os.path.join(out, "sweep-valid-nll.png"),
                "The recipe sweeps, seed 1 (one colour per recipe; dashed: routed models)",
                label=lambda r: f"{r['model']}, {r['recipe']}", colour_by=lambda r: r["recipe"],
                dashed=lambda r: r["model_id"] != "transformer")
    made = sorted({(run["command"], run["commit"], run["torch"], run["machine"])
                   for r in sweep + runs + reproduced for run in (r["run"], r.get("macs_run")) if run})
    lines += ["", "The rows were trained (and their MACs counted) by:", ""] + \
        [f"- `{c}`{command_note(c)} at commit {commit} (torch {t}, {m})" for c, commit, t, m in made]
    lines += resumed_across_commits(sweep + runs)
    lines += ["", made_by]
    text = "\n".join(lines) + "\n"
    write_atomically(os.path.join(out, "converged.md"), text)
    print(text)
