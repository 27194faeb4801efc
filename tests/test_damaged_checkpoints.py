"""A damaged checkpoint never loads: fairseq's loader (resume, generate, validate) and the tools
refuse it by name and point at the newest complete checkpoint beside it."""

import os

import pytest
import torch
from fairseq import checkpoint_utils

from moa.fairseq_fixes.checkpoint_safety import DamagedCheckpointError
from moa_tools import ToolError
from moa_tools.checkpoints import load_checkpoint


@pytest.fixture
def folder(tmp_path):
    state = {"model": {"w": torch.arange(50_000, dtype=torch.float32)}, "args": None}
    torch.save(state, tmp_path / "checkpoint_1_100.pt")
    os.utime(tmp_path / "checkpoint_1_100.pt", (1, 1))  # the older one
    torch.save(state, tmp_path / "checkpoint_1_200.pt")
    return tmp_path, (tmp_path / "checkpoint_1_200.pt").read_bytes()


@pytest.mark.parametrize("damage", ["cut 10%", "cut 50%", "cut the last byte", "flip a byte of a weight"])
def test_a_damaged_checkpoint_is_refused_by_fairseqs_loader_and_the_tools(folder, damage):
    tmp_path, data = folder
    if damage == "flip a byte of a weight":
        data = bytearray(data)
        data[len(data) // 2] ^= 0xFF  # torch.load alone would return a wrong weight here
        data = bytes(data)
        reason = "fails its CRC-32 check"
    else:
        keep = {"cut 10%": len(data) // 10, "cut 50%": len(data) // 2, "cut the last byte": len(data) - 1}[damage]
        data = data[:keep]
        reason = "no zip central directory"
    damaged = tmp_path / "checkpoint_last.pt"
    damaged.write_bytes(data)
    with pytest.raises(DamagedCheckpointError) as error:
        checkpoint_utils.load_checkpoint_to_cpu(str(damaged))
    message = str(error.value)
    assert message.startswith(f"{damaged} is truncated or corrupt") and reason in message
    assert f"--restore-file {tmp_path / 'checkpoint_1_100.pt'}" not in message  # the newest complete one is named
    assert f"--restore-file {tmp_path / 'checkpoint_1_200.pt'} to resume training" in message
    with pytest.raises(ToolError, match="is truncated or corrupt"):
        load_checkpoint(str(damaged))


def test_a_complete_checkpoint_loads_and_a_lone_damaged_one_says_there_is_none(folder):
    tmp_path, data = folder
    assert torch.equal(load_checkpoint(str(tmp_path / "checkpoint_1_200.pt"))["model"]["w"],
                       torch.arange(50_000, dtype=torch.float32))
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "checkpoint_last.pt").write_bytes(data[:1000])
    with pytest.raises(DamagedCheckpointError, match="holds no other complete checkpoint"):
        checkpoint_utils.load_checkpoint_to_cpu(str(alone / "checkpoint_last.pt"))


def test_a_checkpoint_is_read_from_disk_once_and_loaded_from_the_checked_bytes(folder, monkeypatch):
    """fairseq's loader opens the file once: the checksums are computed on the mapped bytes that
    torch.load then reads (fairseq's own open of the path is served from them)."""
    import builtins

    tmp_path, _ = folder
    path = str(tmp_path / "checkpoint_1_200.pt")
    torch.save({"model": {"w": torch.arange(50_000, dtype=torch.float32)}, "args": None, "cfg": None,
                "optimizer_history": [{"criterion_name": "c", "optimizer_name": "o", "lr_scheduler_state": {"best": 1.0},
                                       "num_updates": 200}],
                "extra_state": {"epoch": 1, "train_iterator": {"epoch": 1}}}, path)  # as fairseq-train saves
    opened, original = [], builtins.open
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: opened.append(str(file)) or original(file, *a, **k))
    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    assert torch.equal(state["model"]["w"], torch.arange(50_000, dtype=torch.float32))
    assert opened.count(path) == 1
    assert "open" not in vars(checkpoint_utils)  # fairseq's module is as it was


def test_the_fallback_takes_only_the_checkpoints_of_the_same_run_and_shard(tmp_path):
    from moa.fairseq_fixes.checkpoint_safety import run_checkpoints

    names = ["checkpoint_last.pt", "checkpoint_best.pt", "checkpoint3.pt", "checkpoint_2_200.pt",
             "checkpoint.best_loss_4.21.pt", "checkpoint_last-shard1.pt", "checkpoint_2_200-shard1.pt",
             "checkpoint_last-big.pt", "average.pt", "model.pt", "checkpoint_2_200.pt.tmp"]
    for age, name in enumerate(names):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1000 - age, 1000 - age))  # the first listed is the newest
    assert [os.path.basename(p) for p in run_checkpoints(str(tmp_path))] == names[:5]
    assert [os.path.basename(p) for p in run_checkpoints(str(tmp_path), "-shard1")] == names[5:7]
    assert [os.path.basename(p) for p in run_checkpoints(str(tmp_path), "-big")] == ["checkpoint_last-big.pt"]
