"""A training killed with SIGKILL at any moment, and rerun with the same command, ends where an
uninterrupted run does: MoA, MoH and fairseq's Transformer, across epoch ends, validations and saves.

Each run trains 30 updates (three epochs of 12 batches, validated at each epoch end) and saves at
every update; the killed runs write their files slowly (``slow_saves.py``), so that kills land
inside saves too. Half the kills come the moment fairseq says it is
preparing a save, the others at a random moment after a random update; a kill that left a ``.tmp``
file behind landed inside a write. After every kill the same command runs again. The final
parameters must equal the uninterrupted run's exactly, ``checkpoint_last.pt`` must always be a
complete checkpoint, and rerunning the finished command must train nothing and change nothing.
"""

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import run_cli
from moa_tools import USER_DIR, fairseq_command
from moa_tools.commands.demo import write_corpus

pytestmark = pytest.mark.slow

SHAPE = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
         "--decoder-attention-heads", "4", "--share-all-embeddings", "--dropout", "0.1"]
ARCHS = {
    "transformer": ["--arch", "transformer", "--criterion", "label_smoothed_cross_entropy"],
    "moa": ["--arch", "moa_small", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8",
            "--moa-router-init", "normal", "--attention-dropout", "0.1",
            "--criterion", "moa_label_smoothed_cross_entropy"],
    "moh": ["--arch", "moh_small", "--moh-shared-heads", "1", "--moh-top-k", "2", "--attention-dropout", "0.1",
            "--criterion", "moa_label_smoothed_cross_entropy"],
}
RUN = ["--label-smoothing", "0.1", "--optimizer", "adam", "--lr", "1e-3", "--lr-scheduler", "inverse_sqrt",
       "--warmup-updates", "5", "--max-tokens", "400", "--max-update", "30", "--save-interval-updates", "1",
       "--keep-interval-updates", "2", "--seed", "7", "--cpu", "--num-workers", "0", "--log-format", "simple",
       "--log-interval", "1"]
KILLS = 8
SLOW = [sys.executable, os.path.join(os.path.dirname(__file__), "slow_saves.py")]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    work = tmp_path_factory.mktemp("killed")
    raw = str(work / "raw")
    write_corpus(raw, {"train": 300, "valid": 20}, seed=11)
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--destdir", str(work / "bin"), "--joined-dictionary", "--workers", "1")
    return str(work / "bin")


def command(data_bin, arch, save_dir, slow_saves=False):
    """fairseq-train for ``arch``; with ``slow_saves`` through tests/slow_saves.py, whose writes are slow
    enough for a kill to land inside them."""
    train = [*SLOW, "fairseq-train"] if slow_saves else [fairseq_command("fairseq-train")]
    return [*train, data_bin, "--user-dir", USER_DIR, *ARCHS[arch], *SHAPE, *RUN, "--save-dir", str(save_dir)]


def environment():
    return dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])


def parameters(path):
    return torch.load(path, map_location="cpu")["model"]


def run_and_kill(cmd, save_dir, rng, inside_save: bool):
    """Start ``cmd``, kill it with SIGKILL at a moment chosen by ``rng``; return where the kill landed
    (``"inside a save"`` when it left a temporary file, else ``"between saves"``) or None if the run
    finished before the moment came."""
    target_update = rng.randint(1, 29)
    delay = rng.uniform(0.0, 0.05)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment())
    update = 0
    for line in proc.stdout:
        found = re.search(r"num_updates=(\d+)", line)
        if found:
            update = int(found.group(1))
        preparing = "Preparing to save checkpoint" in line
        if update >= target_update and (preparing if inside_save else found):
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            leftovers = [name for name in os.listdir(save_dir) if name.endswith(".tmp")]
            return "inside a save" if leftovers else "between saves"
    proc.wait()
    assert proc.returncode == 0
    return None


@pytest.mark.parametrize("arch", ARCHS)
def test_killed_and_rerun_training_ends_with_the_uninterrupted_runs_parameters(data_bin, arch, tmp_path):
    straight = tmp_path / "straight"
    subprocess.run(command(data_bin, arch, straight), check=True, capture_output=True, env=environment())
    expected = parameters(straight / "checkpoint_last.pt")

    killed = tmp_path / "killed"
    cmd = command(data_bin, arch, killed, slow_saves=True)
    rng = random.Random(f"{arch}-kills")
    landed = []
    for kill in range(KILLS):
        where = run_and_kill(cmd, killed, rng, inside_save=kill % 2 == 0)
        if where is None:
            break
        landed.append(where)
        last = killed / "checkpoint_last.pt"
        if last.exists():  # a complete checkpoint, whatever the kill interrupted
            torch.load(last, map_location="cpu")
    print(f"{arch}: {len(landed)} kills: {landed}")
    assert len(landed) >= KILLS // 2 and "inside a save" in landed

    finished = subprocess.run(cmd, capture_output=True, text=True, env=environment())
    assert finished.returncode == 0, finished.stdout[-3000:]
    final = parameters(killed / "checkpoint_last.pt")
    different = [name for name in expected if not torch.equal(final[name], expected[name])]
    assert not different, f"{len(different)} tensors differ from the uninterrupted run's, e.g. {different[:3]}"

    # the finished command again: it says the run is complete and writes nothing
    before = {name: os.stat(killed / name).st_mtime_ns for name in os.listdir(killed)}
    again = subprocess.run(cmd, capture_output=True, text=True, env=environment())
    assert again.returncode == 0
    assert "training is complete" in again.stdout + again.stderr
    assert {name: os.stat(killed / name).st_mtime_ns for name in os.listdir(killed)} == before
    assert "num_updates=31" not in again.stdout


def test_a_truncated_checkpoint_last_resumes_from_the_newest_complete_checkpoint(data_bin, tmp_path):
    """An older version could leave a truncated checkpoint_last.pt; training continues from the
    newest complete checkpoint beside it, says so on stderr, and ends as the uninterrupted run."""
    straight = tmp_path / "straight"
    cmd = command(data_bin, "moa", straight)
    subprocess.run(cmd, check=True, capture_output=True, env=environment())
    expected = parameters(straight / "checkpoint_last.pt")

    broken = tmp_path / "broken"
    partial = [arg if arg != "30" else "20" for arg in command(data_bin, "moa", broken)]  # --max-update 20
    subprocess.run(partial, check=True, capture_output=True, env=environment())
    data = (broken / "checkpoint_last.pt").read_bytes()
    (broken / "checkpoint_last.pt").write_bytes(data[: len(data) // 2])  # what a killed plain copy leaves
    resumed = subprocess.run(command(data_bin, "moa", broken), capture_output=True, text=True, env=environment())
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # the newest complete files are the update-20 checkpoint and its copy as checkpoint_best.pt
    assert re.search(r"checkpoint_last\.pt is truncated or corrupt.*continuing from \S*checkpoint_(2_20|best)\.pt",
                     resumed.stderr), resumed.stderr[-2000:]
    assert re.search(r"Loaded checkpoint \S+ \(epoch 2 @ 20 updates\)", resumed.stdout)
    final = parameters(broken / "checkpoint_last.pt")
    assert all(torch.equal(final[name], expected[name]) for name in expected)


@pytest.fixture(scope="module")
def transformer_checkpoints(data_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("transformer")
    cmd = [arg if arg != "30" else "4" for arg in command(data_bin, "transformer", save)]  # --max-update 4
    subprocess.run(cmd, check=True, capture_output=True, env=environment())
    return save


@pytest.mark.parametrize("tool", ["moa-average-checkpoints", "moa-convert-moh"])
def test_a_killed_tool_leaves_the_old_output_or_the_whole_new_one(transformer_checkpoints, tool, tmp_path):
    from moa.fairseq_fixes.checkpoint_safety import checkpoint_damage

    out = tmp_path / "out.pt"
    out.write_bytes(b"the old output")
    args = (["--inputs", str(transformer_checkpoints / "checkpoint_1_3.pt"),
             str(transformer_checkpoints / "checkpoint_1_4.pt"), "--output", str(out)]
            if tool == "moa-average-checkpoints" else
            [str(transformer_checkpoints / "checkpoint_last.pt"), "--shared-heads", "2", "--top-k", "1",
             "--router", "query-norm", "--out", str(out)])
    rng = random.Random(tool)
    # 1 KiB pieces: the converted checkpoint (about 150 KB) takes some 0.3 s to write, far longer than
    # the 0.05 s kill window (in 8 KiB pieces it took 0.045 s, and a kill could come after the rename)
    slow = dict(environment(), SLOW_SAVES_PIECE="1024")
    for _ in range(4):
        proc = subprocess.Popen([*SLOW, tool, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=slow)
        while proc.poll() is None and not (tmp_path / "out.pt.tmp").exists():
            time.sleep(0.001)
        assert proc.poll() is None, "the tool ended before it started writing"
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL  # killed while writing: the old file stands
        assert out.read_bytes() == b"the old output"
    finished = subprocess.run([*SLOW, tool, *args], capture_output=True, text=True, env=environment())
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert checkpoint_damage(str(out)) is None and out.stat().st_size > 1000
