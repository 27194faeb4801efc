"""fairseq-train as fairseq runs it, with the plugin loaded: ``fairseq_cli.train.main`` called twice on
one save folder returns both times (the second finds the run finished: no update, nothing written), and
a fine-tuning run whose checkpoint_last.pt is damaged resumes from its newest complete checkpoint, and
--patience counts on across a resume."""

import os
import re
import subprocess
import sys

import pytest

from helpers import run_cli
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus

pytestmark = pytest.mark.slow
SHAPE = ["--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
         "--share-all-embeddings", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "512", "--cpu",
         "--num-workers", "0", "--seed", "1", "--log-format", "simple", "--no-epoch-checkpoints"]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    work = tmp_path_factory.mktemp("main")
    write_corpus(str(work / "raw"), {"train": 300, "valid": 20}, seed=2)
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", str(work / "raw" / "train"),
            "--validpref", str(work / "raw" / "valid"), "--destdir", str(work / "bin"), "--joined-dictionary",
            "--workers", "1")
    return str(work / "bin")


MAIN_TWICE = """
import os, sys
from fairseq import options
from fairseq_cli import train
argv = sys.argv[1:]
for call in (1, 2):
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    before = {n: os.stat(os.path.join(args.save_dir, n)).st_mtime_ns for n in os.listdir(args.save_dir)} \\
        if os.path.isdir(args.save_dir) else {}
    result = train.main(args)
    after = {n: os.stat(os.path.join(args.save_dir, n)).st_mtime_ns for n in os.listdir(args.save_dir)}
    print(f"call {call} returned {result!r}; files changed: {sorted(n for n in after if after[n] != before.get(n))}",
          flush=True)
print("the process went on")
"""


def test_main_called_twice_on_one_save_folder_returns_both_times(data_bin, tmp_path):
    save = str(tmp_path / "checkpoints")
    proc = subprocess.run([sys.executable, "-c", MAIN_TWICE, data_bin, "--user-dir", USER_DIR, *SHAPE,
                           "--max-update", "6", "--save-dir", save], capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    first = re.search(r"call 1 returned None; files changed: (.*)", out).group(1)
    assert "checkpoint_last.pt" in first
    assert "call 2 returned None; files changed: []" in out and "the process went on" in out
    assert "training is complete: the checkpoint has 6 updates, --max-update is 6" in out
    assert len(re.findall(r"num_updates[ =]7\b", out)) == 0


def test_a_fine_tune_with_a_damaged_checkpoint_last_resumes_from_its_newest_complete_checkpoint(data_bin, tmp_path):
    pretrained = tmp_path / "pretrained"
    run_cli("fairseq-train", data_bin, "--user-dir", USER_DIR, *SHAPE, "--max-update", "4", "--save-dir", str(pretrained))
    finetune = [data_bin, "--user-dir", USER_DIR, *SHAPE, "--finetune-from-model", str(pretrained / "checkpoint_last.pt"),
                "--save-dir", str(tmp_path / "finetuned"), "--save-interval-updates", "3"]
    run_cli("fairseq-train", *finetune, "--max-update", "7")
    last = tmp_path / "finetuned" / "checkpoint_last.pt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    resumed = run_cli("fairseq-train", *finetune, "--max-update", "9", check=False)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert re.search(r"checkpoint_last\.pt is truncated or corrupt.*continuing from \S*checkpoint_(\d_6|best)\.pt", out)
    assert re.search(r"Loaded checkpoint \S*checkpoint_(1_6|best)\.pt \(epoch 1 @ [67] updates\)", out)
    assert re.search(r"num_updates[ =]9\b", out)
    assert os.path.getsize(last) > len(data) // 2  # saved whole again


def test_patience_counts_on_across_a_resume_and_a_stopped_run_stays_stopped(data_bin, tmp_path):
    """fairseq kept --patience's count only in memory: a run resumed after a validation without
    improvement counted from zero and trained on past the epoch where the straight run stopped."""
    straight = tmp_path / "straight"
    command = [data_bin, "--user-dir", USER_DIR, *[a for a in SHAPE if a != "--no-epoch-checkpoints"],
               "--lr", "1e-2", "--max-epoch", "60", "--patience", "2"]
    proc = run_cli("fairseq-train", *command, "--save-dir", str(straight))
    out = proc.stdout + proc.stderr
    assert "early stop since valid performance hasn't improved for last 2 runs" in out
    stopped = max(int(e) for e in re.findall(r"\| valid \| epoch (\d+) \|", out))
    assert stopped < 60
    # resume from the epoch before the stop: one validation without improvement is counted already
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "checkpoint_last.pt").write_bytes((straight / f"checkpoint{stopped - 1}.pt").read_bytes())
    proc = run_cli("fairseq-train", *command, "--save-dir", str(resumed))
    out = proc.stdout + proc.stderr
    assert re.findall(r"\| valid \| epoch (\d+) \|", out) == [f"{stopped:03d}"]
    assert "early stop since valid performance hasn't improved for last 2 runs" in out
    # the stopped run, rerun: nothing trained or written
    before = {p.name: p.stat().st_mtime_ns for p in straight.iterdir()}
    proc = run_cli("fairseq-train", *command, "--save-dir", str(straight))
    out = proc.stdout + proc.stderr
    assert "training is complete: the validation loss has not improved for the checkpoint's last 2 validations, " \
           "--patience is 2" in out
    assert {p.name: p.stat().st_mtime_ns for p in straight.iterdir()} == before
