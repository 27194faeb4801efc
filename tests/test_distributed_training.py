"""Data-parallel training on CPU: 2 gloo ranks under torchrun equal 1 rank with --update-freq 2.

fairseq-train runs under ``torchrun --nproc-per-node 2`` with both of fairseq's CPU-capable DDP
backends; with dropout off, N updates of 2 ranks (each with its own batches) and N updates of one
rank accumulating the same batches two at a time end with the same parameters and log the same
losses and routing figures. A run resumed mid-epoch on 2 ranks ends where the straight run does.
Below fairseq, an expert (MoA) or head (MoH) that no token of one rank selects does not break the
gradient reduction.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import ROOT, run_cli
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus

pytestmark = pytest.mark.slow

MODEL = {
    "moa": ["--arch", "moa_small", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "16"],
    "moh": ["--arch", "moh_small", "--moh-shared-heads", "1", "--moh-top-k", "2"],
}
COMMON = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim",
          "128", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--dropout", "0",
          "--attention-dropout", "0", "--share-all-embeddings", "--criterion", "moa_label_smoothed_cross_entropy",
          "--label-smoothing", "0.1", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu",
          "--num-workers", "0", "--log-format", "json", "--log-interval", "1", "--no-epoch-checkpoints",
          "--seed", "3", "--disable-validation", "--max-update", "6", "--save-interval-updates", "3"]
LOGGED = {"loss": 1e-3, "nll_loss": 1e-3, "aux_loss": 1e-4, "moa_la": 1e-4, "moa_lz": 1e-4, "moa_load_cv": 1e-4,
          "moh_lb": 1e-4, "moh_active": 1e-4, "moh_alpha1": 1e-4, "moh_load_cv": 1e-4, "wpb": 0, "bsz": 0}


def torchrun(nproc, script, *args):
    """``torchrun --standalone --nproc-per-node N SCRIPT ARGS`` with this venv; fails the test on error."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               script, *args]
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(command, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path))
    if proc.returncode:
        pytest.fail(f"torchrun {script} failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    work = tmp_path_factory.mktemp("ddp")
    write_corpus(str(work / "raw"), {"train": 600, "valid": 20}, seed=7)
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{work}/raw/train",
            "--validpref", f"{work}/raw/valid", "--destdir", str(work / "bin"), "--joined-dictionary", "--workers", "1")
    return str(work / "bin")


def train(data_bin, save_dir, kind, nproc=1, extra=()):
    args = [data_bin, "--user-dir", USER_DIR, *MODEL[kind], *COMMON, "--save-dir", str(save_dir), *extra]
    if nproc == 1:
        proc = run_cli("fairseq-train", *args)
    else:
        proc = torchrun(nproc, shutil.which("fairseq-train", path=os.path.dirname(sys.executable)), *args,
                        "--distributed-backend", "gloo")
    return proc.stdout + proc.stderr


def logged_updates(log):
    """{update: figures} of the train_inner lines (fairseq logs them on rank 0 only)."""
    records = [json.loads(line.split("| train_inner | ", 1)[1]) for line in log.splitlines() if "| train_inner |" in line]
    updates = {int(r["num_updates"]): r for r in records}
    assert len(updates) == len(records), "train_inner logged twice per update: the ranks trained alone"
    return updates


def parameters(checkpoint):
    return torch.load(checkpoint, map_location="cpu")["model"]


def assert_same_parameters(a, b, atol):
    """Equal within ``atol``; a key bias within 1e-4: its true gradient is 0 (softmax ignores a
    shift shared by all keys), so Adam turns the round-off of the reduction into steps of up to lr."""
    assert a.keys() == b.keys()
    for name in a:
        tolerance = max(atol, 1e-4) if name.endswith("k_proj.bias") else atol
        difference = (a[name].float() - b[name].float()).abs().max().item()
        assert difference <= tolerance, f"{name} differs by {difference:.3g}"


@pytest.fixture(scope="module")
def one_rank(data_bin, tmp_path_factory):
    runs = {}
    for kind in MODEL:
        save = tmp_path_factory.mktemp(f"one-{kind}")
        runs[kind] = (save, train(data_bin, save, kind, extra=["--update-freq", "2"]))
    return runs


@pytest.mark.parametrize("kind", MODEL)
@pytest.mark.parametrize("backend", ["c10d", "legacy_ddp"])
def test_two_ranks_equal_one_rank_with_update_freq_2(data_bin, one_rank, kind, backend, tmp_path):
    log = train(data_bin, tmp_path, kind, nproc=2, extra=["--ddp-backend", backend])
    assert "distributed init (rank 1)" in log
    reference_dir, reference_log = one_rank[kind]
    ours, reference = logged_updates(log), logged_updates(reference_log)
    assert sorted(ours) == sorted(reference) == list(range(1, 7))
    figures = [name for name in LOGGED if name in reference[1]]
    assert ("moa_la" in figures) == (kind == "moa") and ("moh_lb" in figures) == (kind == "moh")
    for update in reference:
        for name in figures:
            assert float(ours[update][name]) == pytest.approx(float(reference[update][name]), abs=LOGGED[name]), \
                (update, name)
    assert_same_parameters(parameters(tmp_path / "checkpoint_last.pt"),
                           parameters(reference_dir / "checkpoint_last.pt"), atol=1e-6)
    if backend == "c10d":
        # resume the 2-rank run from its mid-epoch checkpoint (update 3 of 10 in the epoch)
        resumed = tmp_path / "resumed"
        resumed.mkdir()
        shutil.copy(tmp_path / "checkpoint_1_3.pt", resumed / "checkpoint_last.pt")
        resumed_log = train(data_bin, resumed, kind, nproc=2, extra=["--ddp-backend", backend])
        assert re.search(r"Loaded checkpoint \S+ \(epoch 1 @ 3 updates\)", resumed_log)
        assert sorted(logged_updates(resumed_log)) == [4, 5, 6]
        assert_same_parameters(parameters(resumed / "checkpoint_last.pt"),
                               parameters(tmp_path / "checkpoint_last.pt"), atol=0)


WORKER = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from test_distributed_training import routed_module, rank_input, module_loss
    from fairseq.distributed import LegacyDistributedDataParallel

    kind, backend, out = sys.argv[1:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    module = routed_module(kind)
    if backend == "c10d":
        wrapped = torch.nn.parallel.DistributedDataParallel(module)  # what fairseq's c10d builds
    else:
        wrapped = LegacyDistributedDataParallel(module, process_group=dist.group.WORLD)
    for step in range(2):  # torch's DDP reports a parameter without gradient at the next step
        module.zero_grad()
        loss, used = module_loss(wrapped, module, rank_input(kind, rank))
        loss.backward()
        if backend == "legacy_ddp":
            wrapped.all_reduce_grads()
    grads = {{name: p.grad for name, p in module.named_parameters()}}
    torch.save({{"grads": grads, "used": used}}, f"{{out}}/rank{{rank}}.pt")
    dist.barrier()
    dist.destroy_process_group()  # exiting with gloo's threads alive can abort the process
""")


def routed_module(kind):
    """A self-attention MoA (4 experts, top-1) or MoH (1 shared + top-1 of 3) module whose router
    sends a token along input axis e to expert (routed head) e."""
    from moa.moa_attention import MixtureOfAttentionHeads
    from moa.moh_attention import MixtureOfHeadsAttention

    torch.manual_seed(0)
    if kind == "moa":
        module = MixtureOfAttentionHeads(16, num_experts=4, top_k=1, head_dim=8, self_attention=True)
        router = module.router.weight
    else:
        module = MixtureOfHeadsAttention(16, num_heads=4, shared_heads=1, top_k=1, self_attention=True)
        router = module.router.routed.weight
    with torch.no_grad():
        router.copy_(4 * torch.eye(*router.shape))
    return module


def rank_input(kind, rank):
    """(time 5, batch 2, 16): rank 1's tokens all point along axis 0, so they all pick expert (head) 0."""
    torch.manual_seed(10 + rank)
    x = 0.1 * torch.randn(5, 2, 16)
    if rank == 1:
        x[..., 0] += 3
    return x


def module_loss(wrapped, module, x):
    """A task-like loss plus the module's auxiliary losses, and the experts (heads) it used."""
    y, _ = wrapped(x, x, x)
    routing = module.routing
    if hasattr(routing, "load_balancing_loss"):
        aux, used = 0.01 * routing.load_balancing_loss + 0.001 * routing.router_z_loss, routing.selected
    else:
        aux, used = 0.01 * routing.balance_loss, routing.selected
    return y.pow(2).mean() + aux, sorted(set(used.reshape(-1).tolist()))


@pytest.mark.parametrize("kind", ["moa", "moh"])
@pytest.mark.parametrize("backend", ["c10d", "legacy_ddp"])
def test_an_expert_unused_on_one_rank_still_reduces_gradients(kind, backend, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format())
    torchrun(2, str(script), kind, backend, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[1]["used"] == [0] and len(ranks[0]["used"]) > 1  # rank 1 leaves every other expert unused
    module = routed_module(kind)
    losses = [module_loss(module, module, rank_input(kind, r))[0] for r in (0, 1)]
    (sum(losses) / 2).backward()  # DDP averages the ranks' gradients
    for name, p in module.named_parameters():
        for rank in ranks:
            torch.testing.assert_close(rank["grads"][name], p.grad, msg=name)
