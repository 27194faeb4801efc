"""``moa-demo``: prepare -> train -> generate -> score an MoA translation model, offline.

Runs the stock fairseq CLIs (``fairseq-preprocess``, ``fairseq-train``,
``fairseq-generate``) in subprocesses on the generated English->German corpus of
:mod:`moa_tools.number_phrases`, showing training progress as it goes, scores the
detokenised output against the plain-text references with sacreBLEU, and ends with
``moa-analyze`` on the trained model. Every step writes into ``--workdir``.

The BLEU it prints is the same from run to run on one machine, but moves between CPUs: the
floating-point kernels of the CPU and its BLAS differ, and 400 updates of training carry the
difference into the model.
"""

import argparse
import os
import re
import shutil
import sys
import time

from moa_tools import USER_DIR, fairseq_command, run_logged, run_tool
from moa_tools.number_phrases import generate_splits
from moa_tools.scoring import bleu_report, ordered_hypotheses, read_hypotheses
from moa_tools.textio import read_lines, write_lines_atomically


def write_corpus(folder: str, sizes: dict, seed: int) -> None:
    """Write {split}.en/.de (tokens) and {split}.ref.de (plain text) into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    for split, pairs in generate_splits(sizes, seed).items():
        for suffix, column in (("en", 0), ("de", 1), ("ref.de", 3)):
            write_lines_atomically(os.path.join(folder, f"{split}.{suffix}"), (pair[column] for pair in pairs))


def _step(cmd, log_path: str, on_line=None) -> None:
    print("+ " + " ".join(cmd), flush=True)
    run_logged(cmd, log_path, on_line)


def training_progress(max_update: int, started: float):
    """An ``on_line`` for fairseq-train's simple log: one line per logged interval and validation."""
    def show(line: str) -> None:
        figures = dict(re.findall(r"(\w+)[= ]([-\d.]+)", line.split(" | ", 3)[-1]))
        if "| train_inner |" in line and "num_updates" in figures:
            print(f"  update {int(figures['num_updates']):>5}/{max_update}: loss {figures['loss']} bits, "
                  f"{float(figures['wps']):,.0f} target words/s, {time.time() - started:.0f} s", flush=True)
        elif "| valid |" in line and "loss" in figures:
            print(f"  validation after epoch {figures.get('epoch', '?')}: loss {figures['loss']} bits", flush=True)
    return show


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _main(argv):
    parser = argparse.ArgumentParser(prog="moa-demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="moa-demo-run", help="folder for data, checkpoints and logs")
    parser.add_argument("--arch", default="moa_small")
    parser.add_argument("--train-size", type=int, default=40000)
    parser.add_argument("--test-size", type=int, default=500)
    parser.add_argument("--max-update", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fresh", action="store_true", help="delete --workdir first")
    parser.add_argument("--train-args", default="", help="extra fairseq-train arguments, e.g. '--moa-top-k 2'")
    args = parser.parse_args(argv)

    if args.fresh and os.path.isdir(args.workdir):
        shutil.rmtree(args.workdir)
    raw, data_bin, ckpt = (os.path.join(args.workdir, d) for d in ("raw", "data-bin", "checkpoints"))
    os.makedirs(args.workdir, exist_ok=True)
    device = [] if _cuda_available() else ["--cpu"]
    started = time.time()

    print(f"[1/5] corpus: {args.train_size} generated en-de training pairs -> {raw}", flush=True)
    write_corpus(raw, {"train": args.train_size, "valid": 300, "test": args.test_size}, args.seed)
    if os.path.isdir(data_bin):
        shutil.rmtree(data_bin)
    _step([fairseq_command("fairseq-preprocess"), "--source-lang", "en", "--target-lang", "de",
           "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test",
           "--destdir", data_bin, "--joined-dictionary", "--workers", "2"],
          os.path.join(args.workdir, "preprocess.log"))

    print(f"[2/5] train {args.arch} for {args.max_update} updates (log: {args.workdir}/train.log)", flush=True)
    if os.path.isdir(ckpt):
        shutil.rmtree(ckpt)
    _step([fairseq_command("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", args.arch, *device,
           "--task", "translation", "--share-all-embeddings",
           "--criterion", "moa_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
           "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0",
           "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "300",
           "--dropout", "0.1", "--max-tokens", str(args.max_tokens), "--max-update", str(args.max_update),
           "--seed", str(args.seed), "--save-dir", ckpt, "--no-epoch-checkpoints", "--log-format", "simple",
           "--log-interval", "50", "--num-workers", "0", *args.train_args.split()],
          os.path.join(args.workdir, "train.log"), training_progress(args.max_update, time.time()))

    print("[3/5] translate the test set with beam 4", flush=True)
    generate_log = os.path.join(args.workdir, "generate.log")
    _step([fairseq_command("fairseq-generate"), data_bin, "--user-dir", USER_DIR, *device, "--gen-subset", "test",
           "--path", os.path.join(ckpt, "checkpoint_last.pt"), "--beam", "4", "--lenpen", "0.6",
           "--batch-size", "128", "--required-batch-size-multiple", "1", "--post-process", "subword_nmt",
           "--num-workers", "0"], generate_log)

    refs = list(read_lines(os.path.join(raw, "test.ref.de")))
    hyps = ordered_hypotheses(read_hypotheses(generate_log), len(refs))
    report = bleu_report(hyps, refs, "de")
    print(f"[4/5] sacreBLEU on {len(hyps)} test sentences ({time.time() - started:.0f} s so far)")
    for hyp, ref in list(zip(hyps, refs))[:3]:
        print(f"  REF {ref}\n  HYP {hyp}")
    print(f"BLEU = {report.sacrebleu:.2f}  ({report.signature})", flush=True)

    print("[5/5] what the routers learned: moa-analyze on the test set", flush=True)
    import logging

    from moa_tools.commands import analyze

    logging.getLogger("fairseq").setLevel(logging.WARNING)  # in-process: fairseq's loading chatter
    analysis = os.path.join(args.workdir, "analysis")
    if analyze.main([os.path.join(ckpt, "checkpoint_last.pt"), data_bin, "--subset", "test", "--out", analysis,
                     "--labels", args.arch, "--no-progress"]):
        return 1
    print(f"done in {time.time() - started:.0f} s; BLEU = {report.sacrebleu:.2f}")
    return 0


def main(argv=None) -> int:
    return run_tool("moa-demo", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
