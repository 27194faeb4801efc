"""What fairseq's last-batch rule did to the converged study's validation NLL (benchmarks/multi30k/README.md).

    .venv/bin/python -m benchmarks.multi30k.last_batch [--models transformer moa] [--epochs 3] [--workdir DIR]
    .venv/bin/python -m benchmarks.multi30k.last_batch --smoke --workdir DIR --out DIR/last-batch   # 1 epoch, 3,000 lines

fairseq leaves out the last batch of an evaluated split when it holds no multiple of
``--required-batch-size-multiple`` (8) sentences; the converged study's rows were validated that way
(``valid_rule``). This counts, on the study's validation set and token budgets, the sentences and target
tokens left out, then trains each model with the study's recipe (seed 1) for a few epochs and validates
every epoch checkpoint by both rules (fairseq's, and every sentence): the difference is what the recorded
NLLs leave out. The recorded runs' own checkpoints are not kept, so they are not validated again here.
"""

import contextlib
import os
import re

from benchmarks.harness.corpora import multi30k_models as models, prepare_multi30k
from benchmarks.harness.results import provenance, provenance_line, study_parser, study_results, write_result
from benchmarks.multi30k import converged
from moa.fairseq_fixes.every_sentence import fairseq_evaluation_batches
from moa_tools import USER_DIR, ToolError, fairseq_command, run_logged, run_tool

_VALID = re.compile(r"valid on 'valid' subset \| loss ([\d.]+) \| nll_loss ([\d.]+).*\| bsz ([\d.]+)")


def left_out(data_bin, max_tokens):
    """(sentences, left out, target tokens, left out, mean target length of those left out, of all) of the
    validation split under fairseq's rule at ``max_tokens`` per batch."""
    from fairseq.data import Dictionary, data_utils
    from fairseq.tasks.translation import load_langpair_dataset

    src, tgt = converged.PAIR.split("-")
    dicts = [Dictionary.load(os.path.join(data_bin, f"dict.{lang}.txt")) for lang in (src, tgt)]
    dataset = load_langpair_dataset(data_bin, "valid", src, dicts[0], tgt, dicts[1], combine=False, dataset_impl=None,
                                    upsample_primary=1, left_pad_source=True, left_pad_target=False,
                                    max_source_positions=1024, max_target_positions=1024)
    order = dataset.ordered_indices()
    batches = data_utils.batch_by_size(order, dataset.num_tokens, dataset.num_tokens_vec(order).astype("int64"),
                                       max_tokens, None, 8)  # fairseq's own function: its rule
    tail = order[sum(len(b) for b in batches):]
    sizes = dataset.tgt_sizes
    return (len(order), len(tail), int(sizes.sum()), int(sizes[tail].sum()),
            float(sizes[tail].mean()) if len(tail) else 0.0, float(sizes.mean()))


def validate(checkpoint, data_bin):
    """{rule: (loss, NLL, sentences)} of ``checkpoint`` on the validation split, by fairseq's rule and by
    the plugin's (every sentence), at the study's 2,048 tokens per batch."""
    figures = {}
    for rule in ("fairseq", "every sentence"):
        command = [fairseq_command("fairseq-validate"), data_bin, "--user-dir", USER_DIR, "--task", "translation",
                   "--path", checkpoint, "--valid-subset", "valid", "--max-tokens", "2048", "--cpu"]
        with fairseq_evaluation_batches() if rule == "fairseq" else contextlib.nullcontext():
            output = run_logged(command)
        match = _VALID.search(output)
        if not match:
            raise ToolError(f"fairseq-validate printed no loss for {checkpoint}:\n{output[-2000:]}")
        figures[rule] = tuple(float(v) for v in match.groups())
    return figures


def _main(argv):
    parser = study_parser("multi30k.last_batch", __doc__)
    parser.add_argument("--models", nargs="+", default=["transformer", "moa"], choices=list(models()))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workdir", default="runs")
    parser.add_argument("--out", default=study_results("multi30k", "converged", "last-batch"))
    parser.add_argument("--smoke", action="store_true", help="the first 3,000 training lines, 1 epoch, the Transformer")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.epochs = ["transformer"], 1
    run = provenance("multi30k.last_batch", argv)
    data_dir = prepare_multi30k(converged.PAIR, args.workdir, args.smoke, once=True)
    data_bin = os.path.join(data_dir, "data-bin")
    counts = {tokens: left_out(data_bin, tokens) for tokens in (2048, 4096)}
    rows = []
    for model_id in args.models:
        label, model_args = models()[model_id]
        save_dir = os.path.join(args.workdir, "last-batch", model_id)
        converged.train(model_args, converged.RECIPE, 1, args.epochs, save_dir, data_dir, run["commit"])
        for epoch in range(1, args.epochs + 1):
            figures = validate(os.path.join(save_dir, f"checkpoint{epoch}.pt"), data_bin)
            rows.append({"model_id": model_id, "model": label, "epoch": epoch,
                         **{f"{k}_{rule.replace(' ', '_')}": v for rule, f in figures.items()
                            for k, v in zip(("loss", "nll", "sentences"), f)}})
            print(rows[-1], flush=True)
    lines = ["# The last validation batch and the converged study's NLL", "", provenance_line(run), "",
             "| tokens per batch | validation sentences | left out by fairseq's rule | target tokens | left out | "
             "mean target length left out / all |", "|---|---|---|---|---|---|"]
    for tokens, (n, out, t, t_out, mean_out, mean_all) in counts.items():
        lines.append(f"| {tokens:,} | {n:,} | {out} | {t:,} | {t_out} ({t_out / t:.2%}) | {mean_out:.1f} / {mean_all:.1f} |")
    lines += ["", "The study's recipe, seed 1, validated at each epoch by both rules (NLL in bits):", "",
              "| model | epoch | fairseq's rule | every sentence | difference |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['epoch']} | {r['nll_fairseq']:.3f} ({r['sentences_fairseq']:.0f} sentences) "
                     f"| {r['nll_every_sentence']:.3f} ({r['sentences_every_sentence']:.0f}) "
                     f"| {r['nll_every_sentence'] - r['nll_fairseq']:+.3f} |")
    write_result(args.out, {"left_out": {str(k): v for k, v in counts.items()}, "rows": rows, "run": run},
                 "\n".join(lines) + "\n")
    return 0


def main(argv=None) -> int:
    return run_tool("python -m benchmarks.multi30k.last_batch", _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
