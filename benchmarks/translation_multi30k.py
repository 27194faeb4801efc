"""Translation on real data, CPU: small MoA and MoH models against a same-shape Transformer on Multi30k.

    .venv/bin/python -m benchmarks.translation_multi30k [--pairs en-de en-fr] [--minutes 11 | --updates N]
    .venv/bin/python -m benchmarks.translation_multi30k --smoke     # a few minutes (the slow tests run it)
    .venv/bin/python -m benchmarks.translation_multi30k --models moa-self transformer --seeds 2 3
    .venv/bin/python -m benchmarks.translation_multi30k --combine A.json B.json --out ALL   # tables over both
    .venv/bin/python -m benchmarks.translation_multi30k --moa-config 4K4E128D   # other MoA experts

For each pair, ../shared/data/multi30k goes through examples/translation/prepare-multi30k.sh
(offline, --mirror; 8,000 joint sentencepiece pieces). Then every model trains with the same
d_model 256, FFN 1024, 3+3 layers, batch (--max-tokens), warmup (--warmup-updates), optimiser,
schedule and budget: the same training wall time (--minutes, default 11; fairseq's
--stop-time-hours), or the same number of updates (--updates). Keep the machine otherwise idle:
another process on the same cores slows one model and not the other.

The models (--models, by id; result rows carry the id as ``model_id``):

* ``moa``: ``moa_small`` (4K8E64D: 4 of 8 experts of width 64, one shared key/value head) in all
  three attention types, as in the paper, with the arch's defaults;
* ``moa-self``: the same MoA in encoder and decoder self-attention, with fairseq's 4x64 multi-head
  attention for encoder-decoder attention (``--moa-attention-types encoder-self,decoder-self``);
* ``moh``: ``moh_small``, the Transformer's 4 heads of 64 as MoH, 2 shared + top-1 of 2 routed
  in all three attention types, with the paper's gates; ``moh-unit``: the released code's scaling;
* ``transformer``: fairseq's ``transformer`` with 4 heads of 64;
* one choice each, not in the default set: ``moa-normal-router`` and ``moa-self-normal-router``
  (``--moa-router-init normal``), ``moa-aux-per-batch`` (``--moa-aux-loss-scale per-batch``),
  ``moa-raw-gates`` (``--moa-gate-weights raw``), ``moa-released`` (``--moa-released-code``).

``--moa-config kKeEdD`` gives the MoA models other experts: 4K4E128D has the proportions of the
paper's MoA Base against Transformer base (k = the Transformer's head count, D = twice its head width).

All translate every test_2016_flickr sentence (beam 4, length penalty 0.6, checkpoint_best) and
are scored with sacreBLEU against the raw references (see moa_tools.scoring).

Reported per model: parameters; forward MACs per target token, counted by torch.utils.flop_counter
(with moa.flops' formulas for the grouped GEMM and the CPU's fused attention) on the first 200 validation pairs, teacher-forced, one pair at a time; training words/s (fairseq's
wps) and wall time; best validation loss and NLL, and the validation NLL at every epoch end (equal
updates across models of one seed); sacreBLEU and the paper's tokenised BLEU. ``--seeds`` trains
every model once per seed (fairseq's --seed: the same batch order for every model of a seed), and
the tables give each seed's difference to the Transformer of the same pair, seed and date, and their
mean. Writes benchmarks/results/multi30k/translation-multi30k.{json,md}, with the command, commit
and versions that made them.
"""

import argparse
import json
import os
import re
import shutil
import sys
import time
from collections import Counter

import torch
from torch.utils.flop_counter import FlopCounterMode

import moa  # noqa: F401  (registers the plugin and the checkpoint allow-list)
from benchmarks.common import RESULTS, ROOT, moa_expert_flags, provenance, provenance_line, shared_data, write_atomically
from moa_tools import USER_DIR, ToolError, fairseq_command, run_logged, run_tool
from moa_tools.scoring import bleu_report, ordered_hypotheses, read_hypotheses
from moa_tools.textio import read_lines

MULTI30K = shared_data("multi30k")
SHAPE = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
         "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024",
         "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
MOA = ["--arch", "moa_small", "--criterion", "moa_label_smoothed_cross_entropy", "--moa-alpha", "0.01", "--moa-beta", "0.001"]
MOH = ["--arch", "moh_small", "--criterion", "moa_label_smoothed_cross_entropy", "--moh-beta", "0.01"]
DEFAULT_MOA = "4K8E64D"
TRANSFORMER = ["--arch", "transformer", "--criterion", "label_smoothed_cross_entropy"]
NARROW_FFN = 768  # the FFN width at which the Transformer costs what MoA 4K8E64D does (within 3%)


def models(moa_config=DEFAULT_MOA):
    """--models id -> (label in the tables, fairseq-train arguments), MoA as ``moa_config`` (kKeEdD).
    Result rows carry the id (``model_id``); the label is only what the tables print."""
    moa_args = MOA + moa_expert_flags(moa_config)
    self_only = ["--moa-attention-types", "encoder-self,decoder-self"]
    return {
        "moa": (f"MoA {moa_config} (moa_small)", moa_args),
        "moa-self": (f"MoA {moa_config} self-attn, MHA cross (moa_small)", moa_args + self_only),
        "moa-normal-router": (f"MoA {moa_config}, normal-initialised router", moa_args + ["--moa-router-init", "normal"]),
        "moa-self-normal-router": (f"MoA {moa_config} self-attn, MHA cross, normal-initialised router",
                                   moa_args + self_only + ["--moa-router-init", "normal"]),
        "moa-aux-per-batch": (f"MoA {moa_config}, aux loss per batch", moa_args + ["--moa-aux-loss-scale", "per-batch"]),
        "moa-raw-gates": (f"MoA {moa_config}, raw gate weights", moa_args + ["--moa-gate-weights", "raw"]),
        "moa-released": (f"MoA {moa_config}, the released code's choices", moa_args + ["--moa-released-code"]),
        "moh": ("MoH 2+1of2, paper gates (moh_small)", MOH + ["--moh-gate-scale", "softmax"]),
        "moh-unit": ("MoH 2+1of2, unit gates (moh_small)", MOH + ["--moh-gate-scale", "unit"]),
        "transformer": ("Transformer 4x64 (transformer)", TRANSFORMER),
        "transformer-narrow": (f"Transformer 4x64, FFN {NARROW_FFN} (transformer)",
                               TRANSFORMER + [f"--{side}-ffn-embed-dim={NARROW_FFN}" for side in ("encoder", "decoder")]),
    }


MODELS = models()
DEFAULT_MODELS = ["moa", "moa-self", "moh", "transformer"]
# what every Multi30k study trains with; learning rate, warmup, dropout, batch and checkpoints are each study's own
COMMON_TRAINING = ["--task", "translation", "--share-all-embeddings", "--label-smoothing", "0.1",
                   "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0",
                   "--lr-scheduler", "inverse_sqrt", "--attention-dropout", "0.1", "--weight-decay", "0.0001",
                   "--cpu", "--num-workers", "0", "--log-format", "simple", "--log-interval", "50"]
TRAINING = COMMON_TRAINING + ["--lr", "1e-3", "--dropout", "0.3", "--no-epoch-checkpoints"]


def make_mirror(work, smoke):
    """The shared Multi30k folder, or for --smoke a folder with its first lines only."""
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


def prepare(pair, workdir, mirror, smoke):
    """prepare-multi30k.sh for ``pair`` into WORKDIR/multi30k-PAIR (8,000 pieces; --smoke 2,000)."""
    data_dir = os.path.join(workdir, f"multi30k-{pair}")
    run_logged(["bash", os.path.join(ROOT, "examples", "translation", "prepare-multi30k.sh"), "--pair", pair,
                "--out", data_dir, "--mirror", mirror, "--vocab-size", "2000" if smoke else "8000", "--workers", "2"])
    return data_dir


def macs_per_target_token(checkpoint, data_dir, src, tgt, pairs=200, overrides=None, model_args=None):
    """Forward MACs per target token over the first ``pairs`` validation pairs, teacher-forced, one pair at a
    time, counted by torch's FLOP counter (which ``import moa`` teaches the grouped GEMM and the CPU's fused
    attention, :mod:`moa.flops`), in float32. MoA and MoH run their routed paths (only the selected experts'
    or heads' projections). The model: ``checkpoint`` (``overrides``: model arguments to change, as
    fairseq-generate's --model-overrides), or, with ``checkpoint`` None, a model built untrained from
    ``model_args`` (its fairseq-train arch flags; MoA's count does not depend on the weights, MoH's
    attention over its packed queries does, a little)."""
    from fairseq import checkpoint_utils, options, tasks

    from moa.moa_attention import MixtureOfAttentionHeads
    from moa.moh_attention import MixtureOfHeadsAttention

    data_bin = os.path.join(data_dir, "data-bin")
    if checkpoint is None:
        torch.manual_seed(1)
        args = options.parse_args_and_arch(options.get_training_parser(),
                                           [data_bin, "--user-dir", USER_DIR, *SHAPE, *model_args, *COMMON_TRAINING])
        task = tasks.setup_task(args)
        model = task.build_model(args)
    else:
        models, _, task = checkpoint_utils.load_model_ensemble_and_task(
            [checkpoint], arg_overrides={"data": data_bin, **(overrides or {})})
        model = models[0]
    model = model.float().eval()
    for module in model.modules():
        if isinstance(module, MixtureOfAttentionHeads):
            module.path = "routed"
        if isinstance(module, MixtureOfHeadsAttention):
            module.path = "packed"
    d = task.source_dictionary
    src_lines = list(read_lines(os.path.join(data_dir, "spm", f"val.{src}")))[:pairs]
    tgt_lines = list(read_lines(os.path.join(data_dir, "spm", f"val.{tgt}")))[:pairs]
    flops, tokens = 0, 0
    with torch.no_grad():
        for s, t in zip(src_lines, tgt_lines):
            source = d.encode_line(s, add_if_not_exist=False).long().unsqueeze(0)
            target = d.encode_line(t, add_if_not_exist=False).long().unsqueeze(0)
            prev = torch.cat([target.new_full((1, 1), d.eos()), target[:, :-1]], dim=1)
            with FlopCounterMode(display=False) as counter:
                model(source, torch.tensor([source.size(1)]), prev)
            flops += counter.get_total_flops()
            tokens += target.size(1)
    return flops / 2 / tokens


def train_and_score(model_id, moa_config, name, model_args, pair, seed, data_dir, work, budget, run):
    src, tgt = pair.split("-")
    save = os.path.join(work, pair, f"seed{seed}", model_id)
    # A checkpoint left by an earlier run would be resumed: fairseq would reach the budget at once
    # and the tables would report the old model with a wall time of seconds.
    shutil.rmtree(save, ignore_errors=True)
    os.makedirs(save)
    started = time.time()
    log = run_logged([fairseq_command("fairseq-train"), os.path.join(data_dir, "data-bin"), "--user-dir", USER_DIR,
                      *SHAPE, *model_args, *TRAINING, *budget, "--seed", str(seed), "--save-dir", save],
                     os.path.join(save, "train.log"))
    train_wall = time.time() - started
    wps = [float(x) for line in log.splitlines() if "| train |" in line for x in re.findall(r"\| wps ([\d.]+)", line)]
    updates = [int(x) for x in re.findall(r"\| num_updates (\d+)", log)]
    valid = [float(x) for line in log.splitlines() if "| valid |" in line for x in re.findall(r"\| loss ([\d.]+)", line)]
    valid_nll = valid_nll_by_updates(log)
    params = int(re.search(r"num\. shared model params: ([\d,]+)", log).group(1).replace(",", ""))

    checkpoint = os.path.join(save, "checkpoint_best.pt")
    scores = translate_and_score(checkpoint, data_dir, tgt, os.path.join(save, "generate.log"))
    return {"pair": pair, "model_id": model_id, "moa_config": moa_config if model_id.startswith("moa") else None,
            "model": name, "seed": seed, "date": time.strftime("%Y-%m-%d"),
            "run": run, "parameters": params,
            "macs_per_target_token": macs_per_target_token(checkpoint, data_dir, src, tgt),
            "updates": max(updates) if updates else 0, "train_wall_s": train_wall,
            "train_words_per_s": sum(wps) / len(wps) if wps else float("nan"),
            "best_valid_loss": min(valid) if valid else float("nan"),
            "best_valid_nll": min(valid_nll.values()) if valid_nll else float("nan"),
            "valid_nll_by_updates": valid_nll, **scores}


def valid_nll_by_updates(log):
    """{updates: validation NLL (bits)} at every validation of a fairseq-train log: at each epoch's end,
    so models of one seed share the points (255, 510, ... updates) that equal-update comparisons need."""
    return {int(u): float(n) for line in log.splitlines() if "| valid |" in line
            for n, u in re.findall(r"\| nll_loss ([\d.]+) \|.*\| num_updates (\d+)", line)}


def translate_and_score(checkpoint, data_dir, tgt, generate_log, extra=()):
    """Translate every test sentence (beam 4, length penalty 0.6, batches of 128; ``extra``:
    more fairseq-generate flags) and score them: sacreBLEU, its signature, tokenised BLEU, wall
    time and fairseq's own decoding time."""
    started = time.time()
    gen = run_logged([fairseq_command("fairseq-generate"), os.path.join(data_dir, "data-bin"), "--user-dir", USER_DIR,
                      "--cpu", "--gen-subset", "test", "--path", checkpoint, "--beam", "4", "--lenpen", "0.6",
                      "--batch-size", "128", "--required-batch-size-multiple", "1", "--post-process", "sentencepiece",
                      "--num-workers", "0", *extra], generate_log)
    generate_wall = time.time() - started
    refs = list(read_lines(os.path.join(data_dir, "raw", f"test_2016_flickr.{tgt}")))
    report = bleu_report(ordered_hypotheses(read_hypotheses(generate_log), len(refs)), refs, tgt)
    translated = re.search(r"Translated ([\d,]+) sentences \([\d,]+ tokens\) in ([\d.]+)s", gen)
    return {"test_sentences": len(refs), "translated": int(translated.group(1).replace(",", "")),
            "generate_wall_s": generate_wall, "decode_s": float(translated.group(2)),
            "sacrebleu": report.sacrebleu, "signature": report.signature, "tokenized_bleu": report.tokenized_bleu}


def markdown(rows, budget_text):
    lines = [f"Multi30k, {os.cpu_count()} CPUs, torch {torch.__version__}, budget: {budget_text}.",
             "Test: test_2016_flickr, beam 4, length penalty 0.6, checkpoint_best. MACs: forward, per target token.",
             "Differences are to the Transformer of the same pair, seed and date: an equal-time budget buys as many "
             "updates as the machine's speed that day allows.", "",
             "| pair | seed | date | model | parameters | MACs/token | train words/s | train s | updates | valid loss | "
             "valid NLL | sacreBLEU | tok. BLEU |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['pair']} | {r['seed']} | {r['date']} | {r['model']} | {r['parameters']:,} | "
                     f"{r['macs_per_target_token'] / 1e6:.2f}M | "
                     f"{r['train_words_per_s']:.0f} | {r['train_wall_s']:.0f} | {r['updates']} | {r['best_valid_loss']:.3f} | "
                     f"{r.get('best_valid_nll', float('nan')):.3f} | {r['sacrebleu']:.2f} | {r['tokenized_bleu']:.2f} |")
    curves = [(r, {int(u): n for u, n in r.get("valid_nll_by_updates", {}).items()}) for r in rows]
    counts = Counter(u for _, curve in curves for u in curve)
    # the epoch ends, which most models reach; the validation at the time limit is at each model's own count
    points = sorted(u for u, n in counts.items() if n > len(rows) / 2)
    if points:
        lines += ["", "Validation NLL (bits) at equal updates, from the same runs (the schedule does not depend on "
                  "the budget):", "", "| pair | seed | model | " + " | ".join(f"{u} updates" for u in points) + " |",
                  "|---|---|---|" + "---|" * len(points)]
        for r, curve in curves:
            cells = [f"{curve[u]:.3f}" if u in curve else "-" for u in points]
            lines.append(f"| {r['pair']} | {r['seed']} | {r['model']} | " + " | ".join(cells) + " |")
    lines += ["", "| pair | seed | date | model | BLEU difference to the Transformer | words/s ratio | MACs ratio | "
              "parameters ratio |", "|---|---|---|---|---|---|---|---|"]
    differences = {}  # (pair, model id, MoA configuration, label) -> one sacreBLEU difference per seed
    for t in [r for r in rows if r["model_id"] == "transformer"]:
        same_run = [r for r in rows if r is not t and (r["pair"], r["seed"], r["date"]) == (t["pair"], t["seed"], t["date"])]
        for m in same_run:
            key = (t["pair"], m["model_id"], m["moa_config"], m["model"])
            differences.setdefault(key, []).append(m["sacrebleu"] - t["sacrebleu"])
            lines.append(f"| {t['pair']} | {t['seed']} | {t['date']} | {m['model']} | {m['sacrebleu'] - t['sacrebleu']:+.2f} | "
                         f"{m['train_words_per_s'] / t['train_words_per_s']:.2f}x | "
                         f"{m['macs_per_target_token'] / t['macs_per_target_token']:.2f}x | "
                         f"{m['parameters'] / t['parameters']:.2f}x |")
    if any(len(d) > 1 for d in differences.values()):
        lines += ["", "| pair | model | seeds | mean BLEU difference to the Transformer | per seed |", "|---|---|---|---|---|"]
        for (pair, _, _, model), d in differences.items():
            lines.append(f"| {pair} | {model} | {len(d)} | {sum(d) / len(d):+.2f} | {', '.join(f'{x:+.2f}' for x in d)} |")
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
    rows = [row for _, row in rows]
    seeds = sorted({r["seed"] for r in rows})
    rows.sort(key=lambda r: (r["pair"], r["seed"], r["date"]))
    return rows, f"{budgets[0]}, seeds {', '.join(map(str, seeds))}"


def _main(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.translation_multi30k", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", default=["en-de", "en-fr"], choices=["en-de", "en-fr"])
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="equal training wall time per model (default 11)")
    budget.add_argument("--updates", type=int, help="equal updates per model instead (--smoke: 20)")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS),
                        help=f"which models to train (default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1],
                        help="train every model once per seed (fairseq's --seed; default: 1)")
    parser.add_argument("--combine", nargs="+", metavar="JSON",
                        help="train nothing: write the tables over these result files (same budget) to --out")
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens per batch (default 2048)")
    parser.add_argument("--warmup-updates", type=int, default=200,
                        help="inverse_sqrt warmup to lr 1e-3 (default 200); both are named in the budget text, "
                             "so --combine keeps runs with other settings apart")
    parser.add_argument("--moa-config", default=DEFAULT_MOA, metavar="kKeEdD",
                        help="MoA experts of the moa and moa-self models (default 4K8E64D, moa_small's); "
                             "4K4E128D has the paper's Base proportions: k = the Transformer's heads, D = twice their width")
    parser.add_argument("--smoke", action="store_true", help="first 3000/200/100 lines, 2,000 pieces, 20 updates")
    parser.add_argument("--workdir", default=os.path.join(ROOT, "benchmarks", "work-multi30k"))
    parser.add_argument("--out", default=os.path.join(RESULTS, "multi30k", "translation-multi30k"),
                        help="output prefix for .json and .md")
    args = parser.parse_args(argv)
    try:
        chosen = models(args.moa_config)
    except ValueError as error:
        parser.error(str(error))
    run = provenance("translation_multi30k", argv)
    if args.combine:
        rows, budget_text = combined(args.combine)
        write_report(rows, budget_text, args.out, run)
        return
    if not os.path.isdir(MULTI30K):
        raise ToolError(f"{MULTI30K} is missing: this benchmark reads the shared Multi30k folder "
                        "(set MOA_SHARED_DATA to the folder that holds multi30k/)")
    if not args.updates and not args.smoke:
        args.minutes = args.minutes or 11.0
    if args.minutes:
        budget, budget_text = ["--stop-time-hours", str(args.minutes / 60), "--max-epoch", "1000"], \
            f"equal training time, {args.minutes:g} min per model"
    else:
        updates = args.updates or 20
        budget, budget_text = ["--max-update", str(updates)], f"equal updates, {updates} per model"
    budget += ["--max-tokens", str(args.max_tokens), "--warmup-updates", str(args.warmup_updates)]
    # result files of the first runs (4096 and 400) do not name these: --combine keeps them apart
    budget_text += f", batches of up to {args.max_tokens} tokens, {args.warmup_updates} warmup updates"
    budget_text += f", seed{'s' if len(args.seeds) > 1 else ''} {', '.join(map(str, args.seeds))}"
    mirror = make_mirror(args.workdir, args.smoke)
    rows = []
    for pair in args.pairs:
        data_dir = prepare(pair, args.workdir, mirror, args.smoke)
        for seed in args.seeds:
            for model_id in args.models:
                name, model_args = chosen[model_id]
                row = train_and_score(model_id, args.moa_config, name, model_args, pair, seed, data_dir, args.workdir,
                                      budget, run)
                rows.append(row)
                print(json.dumps(row), flush=True)
    write_report(rows, budget_text, args.out, run)


def write_report(rows, budget_text, out, run):
    """``out``.json (the rows, each with the run that measured it, and the run that wrote the file) and
    ``out``.md (the tables, and the command, commit and versions that wrote them)."""
    text = markdown(rows, budget_text) + "\n\n" + provenance_line(run)
    print("\n" + text)
    write_atomically(out + ".json", json.dumps({"budget": budget_text, "rows": rows, "run": run}, indent=1))
    write_atomically(out + ".md", text + "\n")


def main(argv=None) -> int:
    return run_tool("benchmarks.translation_multi30k", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
