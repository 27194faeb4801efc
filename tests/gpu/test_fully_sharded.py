"""Fully sharded data parallelism (fairseq's ``--ddp-backend fully_sharded``, through fairscale) on
CUDA: a few updates of MoA and MoH train and resume. fairscale's FSDP gathers parameters on CUDA
streams, so this runs only where CUDA and fairscale (``pip install -e .[fsdp]``) are; without CUDA
the same flag is refused with a message naming the CPU backends (tests/test_bad_input.py)."""

import importlib.util

import pytest
import torch

from helpers import run_cli
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="fully sharded training needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("fairscale") is None,
                                 reason="fairscale is not installed (pip install -e .[fsdp])")]

SHAPE = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim",
         "128", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--share-all-embeddings"]
ARCHS = {"moa": ["--arch", "moa_small", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "16"],
         "moh": ["--arch", "moh_small", "--moh-shared-heads", "1", "--moh-top-k", "2"]}


@pytest.mark.parametrize("arch", ARCHS)
def test_fully_sharded_training_runs_and_resumes(arch, tmp_path):
    raw, data_bin = str(tmp_path / "raw"), str(tmp_path / "bin")
    write_corpus(raw, {"train": 300, "valid": 20}, seed=3)
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--destdir", data_bin, "--joined-dictionary", "--workers", "1")
    train = ["fairseq-train", data_bin, "--user-dir", USER_DIR, *ARCHS[arch], *SHAPE, "--ddp-backend",
             "fully_sharded", "--criterion", "moa_label_smoothed_cross_entropy", "--optimizer", "adam", "--lr",
             "1e-3", "--max-tokens", "1000", "--num-workers", "0", "--log-format", "simple", "--log-interval", "1",
             "--save-dir", str(tmp_path / "checkpoints")]
    first = run_cli(*train, "--max-update", "4")
    assert "num_updates=4" in first.stdout + first.stderr
    resumed = run_cli(*train, "--max-update", "6")
    assert "@ 4 updates" in resumed.stdout + resumed.stderr and "num_updates=6" in resumed.stdout + resumed.stderr
