"""fairseq-train and fairseq-generate as the studies run them, and what their logs say."""

import os
import re
import shutil
import time

from moa_tools import USER_DIR, fairseq_command, run_logged


def fairseq_train(data_bin, flags, save_dir, log_name="train.log", fresh=True):
    """``fairseq-train DATA_BIN --user-dir moa FLAGS --save-dir SAVE_DIR``, logged to SAVE_DIR/LOG_NAME; its log.
    ``fresh``: empty SAVE_DIR first (fairseq would resume a checkpoint left there); else resume from it."""
    if fresh:
        shutil.rmtree(save_dir, ignore_errors=True)
    os.makedirs(save_dir, exist_ok=True)
    return run_logged([fairseq_command("fairseq-train"), data_bin, "--user-dir", USER_DIR, *flags,
                       "--save-dir", save_dir], os.path.join(save_dir, log_name))


def epoch_stats(log):
    """Per-epoch figures of a fairseq-train log (``--log-format simple``): ({epoch: train stats}, {epoch: valid
    stats}, stopped early by patience?), each stats the {name: value} of that epoch's summary line."""
    train, valid = {}, {}
    for line in log.splitlines():
        match = re.search(r"\| (train|valid) \| epoch (\d+) \|", line)
        if match:
            stats = {k: float(v) for k, v in re.findall(r"\| (\w+) ([-\d.]+)(?= \||$)", line.strip())}
            (train if match.group(1) == "train" else valid)[int(match.group(2))] = stats
    return train, valid, "early stop since valid performance hasn't improved" in log


def log_figures(log):
    """What a fairseq-train log says: the epochs' words/s (``wps``), the last update, the parameters, the
    validation losses and {updates: validation NLL (bits)}."""
    train, valid, _ = epoch_stats(log)
    params = re.search(r"num\. shared model params: ([\d,]+)", log)
    return {"wps": [s["wps"] for s in train.values() if "wps" in s],
            "updates": int(max((s.get("num_updates", 0) for s in [*train.values(), *valid.values()]), default=0)),
            "parameters": int(params.group(1).replace(",", "")) if params else None,
            "valid_loss": [s["loss"] for s in valid.values() if "loss" in s],
            "valid_nll_by_updates": {int(s["num_updates"]): s["nll_loss"] for s in valid.values() if "nll_loss" in s}}


def inner_wps(log):
    """fairseq's words/s of every ``train_inner`` line after the first (which carries the warm-up)."""
    return [float(w) for w in re.findall(r"train_inner \|.*?wps=([\d.]+)", log)][1:]


def translate_and_score(checkpoint, data_dir, tgt, generate_log, extra=()):
    """Translate every test sentence of a prepared Multi30k folder (beam 4, length penalty 0.6, batches of
    128; ``extra``: more fairseq-generate flags) and score them: sacreBLEU, its signature, tokenised BLEU,
    wall time and fairseq's own decoding time."""
    from moa_tools.scoring import bleu_report, ordered_hypotheses, read_hypotheses
    from moa_tools.textio import read_lines

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
