"""Wrong inputs, everywhere a user gives them, through the real CLIs: the table README summarises.

Each row runs one command on one wrong input and checks that it exits non-zero before any work,
that its message names the problem (and the fix, where the message is the plugin's), and that it
leaves no output behind. ``{data}``, ``{ckpt}`` and the other fields are filled from the fixture.
"""

import os
import shutil

import pytest

from helpers import run_cli
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus

pytestmark = pytest.mark.slow

SHAPE = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim",
         "64", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
TRAIN = ["fairseq-train", "{data}", "--user-dir", USER_DIR, *SHAPE, "--share-all-embeddings", "--criterion",
         "moa_label_smoothed_cross_entropy", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu",
         "--num-workers", "0", "--max-update", "2", "--save-dir", "{out}/checkpoints"]
MOA = ["--arch", "moa_small", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8"]
MOH = ["--arch", "moh_small", "--moh-shared-heads", "1", "--moh-top-k", "2"]
GENERATE = ["fairseq-generate", "{data}", "--user-dir", USER_DIR, "--cpu", "--gen-subset", "valid",
            "--required-batch-size-multiple", "1"]

# (id, command, what the message must contain)
BAD_INPUTS = [
    ("moa top-k above the experts", [*TRAIN, *MOA, "--moa-top-k", "5"], "--moa-top-k 5 with --moa-experts 4"),
    ("moa head dim not positive", [*TRAIN, *MOA, "--moa-head-dim", "0"], "--moa-head-dim 0: each expert's head"),
    ("moh shared + top-k above the heads", [*TRAIN, *MOH, "--moh-shared-heads", "2", "--moh-top-k", "3"],
     "--moh-shared-heads 2 --moh-top-k 3 do not fit the 4 heads"),
    ("moa flag on a non-moa arch", [*TRAIN, "--arch", "transformer", "--moa-experts", "8"],
     "unrecognized arguments: --moa-experts 8"),
    ("data parallelism on CPU without torchrun", [*TRAIN, *MOA, "--distributed-world-size", "2"],
     "launch one process per rank with torchrun"),
    ("fully sharded training without CUDA", [*TRAIN, *MOA, "--ddp-backend", "fully_sharded"],
     "--ddp-backend fully_sharded needs CUDA GPUs"),
    ("resume from another arch's checkpoint", [*TRAIN, *MOA, "--restore-file", "{moh_ckpt}"],
     "please ensure that the architectures match"),
    ("checkpoint of another dictionary size", [*GENERATE[:1], "{other_data}", *GENERATE[2:], "--path", "{ckpt}"],
     "the checkpoint's source dictionary has"),
    ("data-bin without dictionaries", [*TRAIN[:1], "{out}/empty", *TRAIN[2:], *MOA, "--source-lang", "en",
                                       "--target-lang", "de"], "dict.en.txt"),
    ("masked-LM arch on a translation data-bin", ["fairseq-train", "{data}", "--user-dir", USER_DIR, "--task",
                                                  "masked_lm", "--arch", "moa_roberta_small", "--criterion",
                                                  "moa_masked_lm", "--optimizer", "adam", "--lr", "1e-3", "--cpu",
                                                  "--batch-size", "4", "--save-dir", "{out}/checkpoints"],
     "dict.txt"),
    ("resume from a truncated checkpoint_last and nothing beside it", [*TRAIN[:-1], "{lonely_dir}", *MOA],
     "holds no other complete checkpoint"),
    ("generate with a truncated checkpoint", [*GENERATE, "--path", "{truncated}"], "is truncated or corrupt"),
    ("average a truncated checkpoint", ["moa-average-checkpoints", "--inputs", "{ckpt}", "{truncated}",
                                        "--output", "{out}/averaged.pt"], "is truncated or corrupt"),
    ("convert a truncated checkpoint", ["moa-convert-moh", "{truncated}", "--shared-heads", "1", "--top-k", "1", "--router", "learned",
                                        "--out", "{out}/converted.pt"], "is truncated or corrupt"),
    ("analyse a truncated checkpoint", ["moa-analyze", "{truncated}", "{data}", "--subset", "valid",
                                        "--out", "{out}/analysis"], "is truncated or corrupt"),
    ("mismatched parallel files", ["moa-corpus", "filter", "{raw}/train.en", "{raw}/valid.de", "{out}/f.en",
                                   "{out}/f.de"], "mismatched parallel corpora"),
    ("empty parallel files", ["moa-corpus", "filter", "{out}/empty.en", "{out}/empty.de", "{out}/f.en",
                              "{out}/f.de"], "are empty"),
    ("non-UTF-8 text", ["moa-corpus", "normalize", "--lang", "en", "{out}/normalized.en", "{out}/latin1.en"],
     "line 2 is not UTF-8"),
    ("non-UTF-8 reference", ["moa-score", "{out}/latin1.en", "{out}/latin1.en", "--lang", "en"],
     "is not UTF-8"),
    ("generate on a missing subset", [*GENERATE[:6], "test", *GENERATE[7:], "--path", "{ckpt}"],
     "Dataset not found: test"),
    ("perplexity on a missing subset", ["moa-eval-ppl", "{ckpt}", "{data}", "test"],
     "holds no 'test' subset; choose the SUBSET arguments from: train, valid"),
    ("analysis on a missing subset", ["moa-analyze", "{ckpt}", "{data}", "--subset", "test", "--out",
                                      "{out}/analysis"], "holds no 'test' subset; choose --subset from"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    work = tmp_path_factory.mktemp("bad-input")
    raw = str(work / "raw")
    write_corpus(raw, {"train": 300, "valid": 20}, seed=5)
    write_corpus(str(work / "raw-other"), {"train": 60, "valid": 10}, seed=6)
    fields = {"raw": raw, "data": str(work / "bin"), "other_data": str(work / "bin-other")}
    for prefix, dest in ((raw, fields["data"]), (str(work / "raw-other"), fields["other_data"])):
        run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{prefix}/train",
                "--validpref", f"{prefix}/valid", "--destdir", dest, "--joined-dictionary", "--workers", "1")
    for kind, arch in (("moa", MOA), ("moh", MOH)):
        save = work / kind
        run_cli(*[arg.format(data=fields["data"], out=str(work)) for arg in TRAIN[:-1]], str(save), *arch,
                "--no-epoch-checkpoints")
        fields[f"{kind}_ckpt"] = str(save / "checkpoint_last.pt")
    fields["ckpt"] = fields["moa_ckpt"]
    damaged = work / "damaged"
    damaged.mkdir()
    shutil.copy(fields["ckpt"], damaged / "checkpoint_1_2.pt")
    data = open(fields["ckpt"], "rb").read()
    (damaged / "checkpoint_last.pt").write_bytes(data[: len(data) // 2])
    fields["truncated_dir"], fields["truncated"] = str(damaged), str(damaged / "checkpoint_last.pt")
    lonely = work / "lonely"  # a truncated checkpoint_last.pt alone (with one beside it, training continues)
    lonely.mkdir()
    (lonely / "checkpoint_last.pt").write_bytes(data[: len(data) // 2])
    fields["lonely_dir"] = str(lonely)
    return work, fields


def _files(folder):
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, names in os.walk(folder) for name in names)


@pytest.mark.parametrize("command, message", [row[1:] for row in BAD_INPUTS], ids=[row[0] for row in BAD_INPUTS])
def test_a_wrong_input_stops_early_with_a_message_and_leaves_nothing(inputs, command, message, tmp_path):
    work, fields = inputs
    out = tmp_path / "out"
    (out / "empty").mkdir(parents=True)
    (out / "empty.en").write_text("")
    (out / "empty.de").write_text("")
    (out / "latin1.en").write_bytes("a good line\nan accented caf\u00e9\n".encode("latin-1"))
    before = _files(out)
    damaged_before = _files(fields["truncated_dir"]), _files(fields["lonely_dir"])
    proc = run_cli(*[arg.format(out=out, **fields) for arg in command], check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert _files(out) == before  # no checkpoint, output, .tmp or folder written
    assert (_files(fields["truncated_dir"]), _files(fields["lonely_dir"])) == damaged_before
    if "is truncated or corrupt" in message and "moa-" not in command[0]:
        # the fix: the complete checkpoint beside the damaged one
        assert f"--restore-file {fields['truncated_dir']}/checkpoint_1_2.pt" in proc.stderr
