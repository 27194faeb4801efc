"""moa-analyze and the live training figures through the real CLIs: a small MoA model and a
Transformer trained by fairseq-train, analysed side by side; TensorBoard event files read back."""

import glob
import json
import math
import os
import struct

import pytest

from helpers import run_cli
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus

pytestmark = pytest.mark.slow

COMMON = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim",
          "128", "--share-all-embeddings", "--label-smoothing", "0.1", "--optimizer", "adam", "--lr", "1e-3",
          "--max-tokens", "2048", "--cpu", "--num-workers", "0", "--log-format", "simple", "--log-interval", "5",
          "--no-epoch-checkpoints", "--seed", "2"]
MOA = ["--arch", "moa_small", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "16",
       "--criterion", "moa_label_smoothed_cross_entropy"]
MOH = ["--arch", "moh_small", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
       "--moh-shared-heads", "1", "--moh-top-k", "1", "--criterion", "moa_label_smoothed_cross_entropy"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("analyze")
    raw, data_bin = str(work / "raw"), str(work / "data-bin")
    write_corpus(raw, {"train": 1500, "valid": 30, "test": 40}, seed=5)
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", data_bin,
            "--joined-dictionary", "--workers", "1")
    run_cli("fairseq-train", data_bin, "--user-dir", USER_DIR, *MOA, *COMMON, "--save-dir", str(work / "moa"),
            "--max-update", "20", "--log-routing-by-module", "--tensorboard-logdir", str(work / "tb"))
    run_cli("fairseq-train", data_bin, "--arch", "transformer", "--criterion", "label_smoothed_cross_entropy",
            "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", *COMMON,
            "--save-dir", str(work / "transformer"), "--max-update", "10")
    run_cli("fairseq-train", data_bin, "--user-dir", USER_DIR, *MOH, *COMMON, "--save-dir", str(work / "moh"),
            "--max-update", "10")
    return {"work": work, "data_bin": data_bin, "moa": str(work / "moa" / "checkpoint_last.pt"),
            "transformer": str(work / "transformer" / "checkpoint_last.pt"),
            "moh": str(work / "moh" / "checkpoint_last.pt")}


def test_analysis_of_moa_beside_a_transformer(trained):
    out = trained["work"] / "analysis"
    proc = run_cli("moa-analyze", trained["moa"], trained["transformer"], trained["data_bin"], "--subset", "test",
                   "--out", str(out), "--labels", "MoA", "Transformer", "--min-count", "2")
    assert "Transformer: does not apply: load, router entropy" in proc.stderr
    report = json.loads((out / "routing.json").read_text())
    moa, transformer = report["checkpoints"]
    assert (moa["family"], transformer["family"]) == ("MoA", "Transformer") and transformer["modules"] == []
    assert len(moa["modules"]) == 6 and len(moa["similarity"]) == len(transformer["similarity"]) == 6
    for module in moa["modules"]:
        assert sum(module["load"]) == pytest.approx(1.0) and len(module["load"]) == 4
        assert 0 < module["router_entropy"] <= math.log(4) + 1e-9 and 0.5 <= module["top_gate_weight"] <= 1.0
        assert (module["top_choice_change"] is None) == (module["layer"] == 0)
    assert moa["modules"][0]["tokens"] > 40  # every non-padding source token of the 40 test sentences
    for measure in moa["similarity"] + transformer["similarity"]:
        assert 0 <= measure["attention_similarity"] <= 1 and -1 <= measure["output_cosine"] <= 1
    table = (out / "specialisation.md").read_text()
    assert "## MoA (moa_small)" in table and "Layer 1, 4 experts, top-2" in table
    assert "specialisation does not apply" in table
    for png in ("load_heatmap.png", "router_entropy.png", "head_similarity.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analysis_of_moh(trained):
    out = trained["work"] / "analysis-moh"
    run_cli("moa-analyze", trained["moh"], trained["data_bin"], "--subset", "test", "--out", str(out),
            "--min-count", "2")
    (moh,) = json.loads((out / "routing.json").read_text())["checkpoints"]
    assert moh["family"] == "MoH" and len(moh["modules"]) == 6 and len(moh["similarity"]) == 6
    for module in moh["modules"]:  # 1 shared + top-1 of 3 routed heads
        assert (module["experts"], module["top_k"]) == (3, 1) and module["active_fraction"] == pytest.approx(0.5)
        assert sum(module["load"]) == pytest.approx(1.0) and 0 < module["router_entropy"] <= math.log(3) + 1e-9
        assert 0 < module["alpha1"] < 1 and module["alpha1"] + module["alpha2"] == pytest.approx(1.0)
    assert all(measure["heads"] == 4 for measure in moh["similarity"])
    assert "Layer 1, 3 routed heads, top-1" in (out / "specialisation.md").read_text()


def test_a_missing_subset_is_named_before_any_work(trained):
    out = trained["work"] / "nothing"
    proc = run_cli("moa-analyze", trained["moa"], trained["data_bin"], "--subset", "test2", "--out", str(out),
                   check=False)
    assert proc.returncode == 1 and "holds no 'test2' subset; choose --subset from: test, train, valid" in proc.stderr
    assert not out.exists()


def _scalar_tags(folder):
    """The scalar tags in TensorBoard event files (TFRecord framing, read without TensorFlow)."""
    from tensorboardX.proto.event_pb2 import Event

    tags = set()
    for path in glob.glob(os.path.join(folder, "**", "events.out.tfevents.*"), recursive=True):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            tags.update(value.tag for value in event.summary.value)
    return tags


def test_training_writes_routing_health_by_module_to_tensorboard(trained):
    tags = _scalar_tags(str(trained["work"] / "tb"))
    for site in ("encoder-self.0", "encoder-self.1", "decoder-self.1", "decoder-cross.0"):
        assert {f"routing/{site}/load_cv", f"routing/{site}/la", f"routing/{site}/lz"} <= tags
    assert {"moa_la", "moa_load_cv", "loss"} <= tags
