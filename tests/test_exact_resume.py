"""A resumed run is the run one would have had: MoA and MoH, translation and masked LM; SwitchHead
translation (with expert dropout, whose draws must resume too).

fairseq-train runs 8 updates with dropout on, saving a mid-epoch checkpoint at update 4
(``--save-interval-updates 4``, an epoch being longer than 8 updates); a second run starts from
that checkpoint and trains to 8. Both end with identical parameters: fairseq restores the
optimizer, the learning-rate schedule and the position in the epoch, and reseeds dropout from the
update count, and nothing in the routers depends on anything else. The same run with
``--checkpoint-activations`` ends identically too.
"""

import re
import shutil

import pytest
import torch

from helpers import run_cli
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus

pytestmark = pytest.mark.slow

SMALL = ["--encoder-layers", "1", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
         "--encoder-attention-heads", "4", "--dropout", "0.1", "--attention-dropout", "0.1"]
RUN = ["--optimizer", "adam", "--lr", "1e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "3", "--cpu",
       "--num-workers", "0", "--log-format", "simple", "--log-interval", "1", "--no-epoch-checkpoints",
       "--seed", "3", "--max-update", "8", "--save-interval-updates", "4", "--disable-validation"]
TRANSLATION = [*SMALL, "--decoder-layers", "1", "--decoder-attention-heads", "4", "--share-all-embeddings",
               "--criterion", "moa_label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "400"]
MLM = [*SMALL, "--task", "masked_lm", "--criterion", "moa_masked_lm", "--sample-break-mode", "complete",
       "--tokens-per-sample", "64", "--batch-size", "4"]
CASES = {
    "moa-translation": ("translation", ["--arch", "moa_small", "--moa-experts", "4", "--moa-top-k", "2",
                                        "--moa-head-dim", "16", *TRANSLATION]),
    "moh-translation": ("translation", ["--arch", "moh_small", "--moh-shared-heads", "1", "--moh-top-k", "2",
                                        *TRANSLATION]),
    "switchhead-translation": ("translation", ["--arch", "switchhead_small", "--switchhead-experts", "4",
                                               "--switchhead-top-k", "2", "--switchhead-head-dim", "16",
                                               "--switchhead-expert-dropout", "0.2", *TRANSLATION]),
    "moa-mlm": ("mlm", ["--arch", "moa_roberta_small", "--moa-experts", "4", "--moa-top-k", "2",
                        "--moa-head-dim", "16", *MLM]),
    "moh-mlm": ("mlm", ["--arch", "moh_roberta_small", "--moh-shared-heads", "1", "--moh-top-k", "2", *MLM]),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    work = tmp_path_factory.mktemp("resume")
    raw = str(work / "raw")
    write_corpus(raw, {"train": 400, "valid": 20}, seed=11)
    bins = {"translation": str(work / "bin"), "mlm": str(work / "mlm-bin")}
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--destdir", bins["translation"], "--joined-dictionary", "--workers", "1")
    run_cli("fairseq-preprocess", "--only-source", "--trainpref", f"{raw}/train.en", "--validpref", f"{raw}/valid.en",
            "--destdir", bins["mlm"], "--workers", "1")
    return bins


def train(data_bin, flags, save_dir, extra=()):
    proc = run_cli("fairseq-train", data_bin, "--user-dir", USER_DIR, *flags, *RUN, "--save-dir", str(save_dir), *extra)
    return proc.stdout + proc.stderr


def model_state(path):
    return torch.load(path, map_location="cpu")["model"]


def epoch_position(path):
    """(epoch, batches done in it) where a checkpoint's training iterator stands."""
    iterator = torch.load(path, map_location="cpu")["extra_state"]["train_iterator"]
    return iterator["epoch"], iterator["iterations_in_epoch"]


def assert_identical(a, b):
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.mark.parametrize("case", CASES)
def test_resuming_mid_epoch_ends_where_the_straight_run_does(data, case, tmp_path):
    task, flags = CASES[case]
    straight = tmp_path / "straight"
    log = train(data[task], flags, straight)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    assert epoch_position(straight / "checkpoint_1_4.pt") == (1, 4)  # mid-epoch
    assert epoch_position(straight / "checkpoint_last.pt") == (1, 8)  # still epoch 1 at the end
    shutil.copy(straight / "checkpoint_1_4.pt", resumed / "checkpoint_last.pt")
    log = train(data[task], flags, resumed)
    assert re.search(r"Loaded checkpoint \S+ \(epoch 1 @ 4 updates\)", log), log[-2000:]
    final = model_state(straight / "checkpoint_last.pt")
    assert_identical(model_state(resumed / "checkpoint_last.pt"), final)
    halfway = model_state(straight / "checkpoint_1_4.pt")
    assert not all(torch.equal(halfway[name], final[name]) for name in final)  # updates 5-8 changed the model
    if case in ("moa-translation", "moh-mlm"):
        checkpointed = tmp_path / "checkpointed"
        train(data[task], flags, checkpointed, extra=["--checkpoint-activations"])
        assert_identical(model_state(checkpointed / "checkpoint_last.pt"), final)
