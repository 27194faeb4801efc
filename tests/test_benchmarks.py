"""The benchmark's baseline computes what MoA computes, and the benchmark command runs and reports."""

import json
import os
import re
import subprocess
import sys

import fairseq
import pytest
import torch
from fairseq.data import Dictionary

from benchmarks import translation_multi30k
from benchmarks.authors_style_moa import AuthorsStyleMoA
from benchmarks.translation_multi30k import MODELS, models
from helpers import ROOT, needs_shared
from moa.moa_attention import MixtureOfAttentionHeads
from moa.models.build import build_translation_model, dictionary_of_size

needs_multi30k, _ = needs_shared("multi30k")

MODEL_LABELS = {key: label for key, (label, _) in MODELS.items()}


def test_authors_style_baseline_matches_moa_with_raw_gates():
    torch.manual_seed(0)
    m = MixtureOfAttentionHeads(32, 8, 3, 16, self_attention=True, gate_weights="raw").double()
    x = torch.randn(6, 4, 32, dtype=torch.double)
    torch.testing.assert_close(AuthorsStyleMoA(m)(x), m(x, x, x, need_weights=False)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_quick_benchmark_reports_every_module(tmp_path):
    out = tmp_path / "quick.json"
    profile = tmp_path / "profile"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.moa_speed", "--quick", "--profile", str(profile),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    names = {r["module"] for r in report["modules"]}
    assert names == {"MHA 8x64", "8K8E128D", "16K32E256D", "2K8E64D", "4K16E64D"}
    assert report["peak_gflops"] > 0
    for row in report["modules"]:
        assert 0 < row["fwd_bwd_peak_fraction"] < 1.5 and row["fwd_bwd_ms"] > 0 and row["fwd_ms"] > 0
    assert "| 8K8E128D | 1024 | 64 |" in (tmp_path / "quick.md").read_text()
    moh = {r["module"]: r for r in report["moh"]}
    assert set(moh) == {"MHA 16x64", "MoH 75% (8 + top-4 of 8)", "MoH 50% (4 + top-4 of 12)",
                        "MoH 75% (8 + top-4 of 8), dense-masked", "MoH 50% (4 + top-4 of 12), dense-masked"}
    assert moh["MHA 16x64"]["macs_ratio"] == 1.0
    assert moh["MoH 50% (4 + top-4 of 12)"]["macs_ratio"] == pytest.approx((2 + 1 + 512 / 1024) / (4 + 2 * 512 / 1024))
    for row in moh.values():
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ratio"] > 0
    small = {r["arch"]: r for r in report["small"]}  # the Multi30k shape, whole models side by side
    assert list(small) == ["transformer", "moa_small", "moh_small", "moh_small/query-norm"]
    assert small["transformer"]["train_ratio"] == small["transformer"]["decode_ratio"] == 1.0
    for row in small.values():
        assert row["train_ms"] > 0 and row["decode_ms"] > 0 and row["peak_mb"] > row["saved_activations_mb"] > 0
        assert row["saved_activations_mb"] > 0 and row["batch"] == "128x16"
    # MoA's single shared K/V head: a quarter of the 4-head Transformer's cache
    assert small["moa_small"]["kv_cache_bytes_per_token_per_layer"] * 4 == \
        small["transformer"]["kv_cache_bytes_per_token_per_layer"]
    assert report["runs"]["small"]["command"].startswith("python -m benchmarks.moa_speed --quick")
    table = (profile / "small-moa_small-train.txt").read_text()
    assert "moa:router (MoA)" in table and "moa:grouped GEMM (MoA/MoH)" in table and "aten::mm" in table
    assert "moa:multi-head attention module" in (profile / "small-transformer-decode.txt").read_text()


@pytest.mark.slow
@needs_multi30k
def test_convert_moh_benchmark_trains_its_own_original_and_converts_it(tmp_path):
    """The default path (no --original): it trains the Transformer it converts, then converts it at 75% and 50%
    with each router and continues every model (translation only, --smoke's budgets)."""
    out = tmp_path / "result"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.convert_moh", "--smoke", "--tasks", "translation",
                           "--workdir", str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "result.json").read_text())
    assert report["original"].endswith(os.path.join("seed1", "original", "checkpoint_best.pt"))
    assert len(report["translation"]) == 5  # the original continued, and 2 fractions x 2 routers
    assert all(0 <= r["sacrebleu_after"] <= 100 and min(r["decode_s"]) > 0 for r in report["translation"])


@pytest.mark.slow
@needs_multi30k
def test_multi30k_translation_benchmark_smoke(tmp_path):
    out = tmp_path / "result"
    # a checkpoint left by an earlier run must not be resumed (fairseq would fail on this one)
    stale = tmp_path / "work" / "en-de" / "seed1" / "moa" / "checkpoint_last.pt"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"left by an earlier run")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.translation_multi30k", "--smoke",
                           "--pairs", "en-de", "--seeds", "1", "2", "--workdir", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "result.json").read_text())
    moa_row, moa_self_row, moh_row, transformer_row = report["rows"][:4]
    keys = ("moa", "moa-self", "moh", "transformer")
    assert [r["model_id"] for r in report["rows"]] == list(keys) * 2
    assert [r["model"] for r in report["rows"]] == [MODEL_LABELS[key] for key in keys] * 2
    # every row and the file say what measured them: the command, the commit, the versions
    run = report["run"]
    assert run["command"].startswith("python -m benchmarks.translation_multi30k --smoke --pairs en-de --seeds 1 2")
    assert re.fullmatch(r"[0-9a-f]{40}(\+changes)?", run["commit"])
    assert (run["torch"], run["fairseq"]) == (torch.__version__, fairseq.__version__)
    assert all(row["run"] == run for row in report["rows"])
    assert [r["seed"] for r in report["rows"]] == [1] * 4 + [2] * 4
    assert report["budget"] == "equal updates, 20 per model, batches of up to 2048 tokens, 200 warmup updates, seeds 1, 2"
    # the seed reaches fairseq: another initialisation and batch order, so another validation loss
    for first, second in zip(report["rows"][:4], report["rows"][4:]):
        assert first["best_valid_loss"] != second["best_valid_loss"]
    dictionary = Dictionary.load(str(tmp_path / "work" / "multi30k-en-de" / "data-bin" / "dict.en.txt"))
    for row, arch, extra in ((moa_row, "moa_small", []), (moh_row, "moh_small", []),
                             (moa_self_row, "moa_small", ["--moa-attention-types", "encoder-self,decoder-self"])):
        model = build_translation_model(arch, dictionary, ["--share-all-embeddings", *extra])
        assert row["parameters"] == sum(p.numel() for p in model.parameters())
    for row in report["rows"]:
        assert row["updates"] == 20 and row["translated"] == row["test_sentences"] == 100
        assert 0 <= row["sacrebleu"] <= 100 and row["train_words_per_s"] > 0
    # one shared 64-wide key/value head instead of four: fewer MACs per token, despite the router;
    # the hybrid keeps multi-head cross-attention, so it lies between the two
    assert (moa_row["macs_per_target_token"] < moa_self_row["macs_per_target_token"]
            < transformer_row["macs_per_target_token"])
    # MoH computes 3 of the 4 heads' queries, attention and output projections per token; K and V stay dense
    assert moh_row["macs_per_target_token"] < transformer_row["macs_per_target_token"]
    table = (tmp_path / "result.md").read_text()
    assert f"Written by `{run['command']}` at commit {run['commit']}" in table
    date = moa_row["date"]
    assert f"| en-de | 1 | {date} | MoA 4K8E64D (moa_small) |" in table
    assert (f"| en-de | 1 | {date} | {MODEL_LABELS['moa-self']} | "
            f"{moa_self_row['sacrebleu'] - transformer_row['sacrebleu']:+.2f} |") in table
    rows = report["rows"]
    differences = [rows[i + 1]["sacrebleu"] - rows[i + 3]["sacrebleu"] for i in (0, 4)]
    mean = f"| en-de | {MODEL_LABELS['moa-self']} | 2 | {sum(differences) / 2:+.2f} | {differences[0]:+.2f}, {differences[1]:+.2f} |"
    assert mean in table
    # --combine redraws the same tables from result files, here one file per seed
    for seed in (1, 2):
        part = dict(report, budget=f"equal updates, 20 per model, batches of up to 2048 tokens, 200 warmup updates, seed {seed}",
                    rows=[{k: v for k, v in r.items() if k != "seed"} for r in rows if r["seed"] == seed])
        (tmp_path / f"seed{seed}.json").write_text(json.dumps(part))
    subprocess.run([sys.executable, "-m", "benchmarks.translation_multi30k", "--combine",
                    str(tmp_path / "seed1.json"), str(tmp_path / "seed2.json"), "--out", str(tmp_path / "both")],
                   check=True, capture_output=True, cwd=ROOT)
    both = json.loads((tmp_path / "both.json").read_text())
    assert (both["budget"], both["rows"]) == (report["budget"], report["rows"])
    assert both["run"]["command"].startswith("python -m benchmarks.translation_multi30k --combine")
    assert mean in (tmp_path / "both.md").read_text()


def test_multi30k_moa_config_reaches_the_moa_models(capsys):
    chosen = models("4K4E128D")
    assert chosen["transformer"] == MODELS["transformer"]
    assert chosen["moa-self"][0] == "MoA 4K4E128D self-attn, MHA cross (moa_small)"
    for key, moa_layers in (("moa", 3 * 3), ("moa-self", 3 * 2)):
        train_args = chosen[key][1]
        model = build_translation_model("moa_small", dictionary_of_size(64), train_args[train_args.index("--moa-beta") + 2:])
        moa = [m for m in model.modules() if isinstance(m, MixtureOfAttentionHeads)]
        assert len(moa) == moa_layers
        assert {(m.top_k, m.num_experts, m.head_dim) for m in moa} == {(4, 4, 128)}
    with pytest.raises(SystemExit) as usage:
        translation_multi30k.main(["--moa-config", "8K4E64D", "--combine", "unused.json"])
    assert usage.value.code == 2 and "--moa-config '8K4E64D': expected kKeEdD with k <= e" in capsys.readouterr().err


def test_multi30k_combine_refuses_runs_with_different_settings(tmp_path, capsys):
    def report(budget):
        return {"budget": budget, "rows": [{"pair": "en-de", "model_id": "transformer", "moa_config": None, "model": MODEL_LABELS["transformer"],
                                            "sacrebleu": 20.0}]}

    (tmp_path / "a.json").write_text(json.dumps(report("equal training time, 11 min per model, seed 1")))
    (tmp_path / "b.json").write_text(json.dumps(report(
        "equal training time, 11 min per model, batches of up to 2048 tokens, 200 warmup updates, seed 2")))
    code = translation_multi30k.main(["--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                                      "--out", str(tmp_path / "both")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("benchmarks.translation_multi30k: error: --combine: these runs had different budgets")
    assert "batches of up to 2048 tokens, 200 warmup updates" in err
    assert not (tmp_path / "both.json").exists()


@pytest.mark.slow
def test_quick_lm_decoding_benchmark_reports_every_model_and_the_cache_ratios(tmp_path):
    out = tmp_path / "lm.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lm_decoding", "--quick", "--batches", "2", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    decode = {(r["model_id"], r["context"]): r for r in report["decode"]}
    assert {model for model, _ in decode} == {"transformer", "moa", "moh-75", "moh-50", "moh-50-all-heads"}
    for (model, context), row in decode.items():
        assert row["ms_per_token"] > 0 and row["kv_allocated_mb"] >= row["kv_cache_mb"] > 0
        # one shared K/V head of 64 against four; MoH caches every head, as the Transformer does
        assert row["kv_ratio"] == pytest.approx(0.25 if model == "moa" else 1.0, abs=0.01)
    assert decode[("transformer", 64)]["time_ratio"] == 1.0
    module = {r["module_id"]: r for r in report["module"]}
    assert module["mha"]["macs_ratio"] == 1.0
    assert module["moh-50"]["macs_ratio"] == pytest.approx(
        (2 * 16 * 64 * 2048 + 2 * 2048 ** 2 + 2048 * 34 + 2 * 16 * 256 * 64) / (4 * 2048 ** 2 + 2 * 32 * 256 * 64))
    assert {r["context"] for r in report["crossover"] if "module" in r} == {64, 256}
    assert report["runs"]["decode"]["command"].startswith("python -m benchmarks.lm_decoding --quick")
    assert "| moa_lm_small (4K8E64D) | 2 | 64 |" in (tmp_path / "lm.md").read_text()


@pytest.mark.slow
def test_the_gpu_check_runs_its_cpu_part(tmp_path):
    """Without CUDA, benchmarks/gpu_check.sh skips tests/gpu and runs its measurements on the CPU: no host
    read in the MoA modules' steps on the grouped projections, one per MoH module, the table eager and
    compiled, the profile and the whole models; all of it in one folder."""
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--quick", "--out", str(tmp_path / "check")],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "No CUDA device" in proc.stderr and "skipped" in out
    assert re.search(r"^\| MoA 16K32E256D module, grouped projections \| 0 \| - \|$", out, re.M)
    assert re.search(r"^\| MoH module, 4 shared \+ top-2 of 4, packed \| 1 \| item at .*dispatch.py", out, re.M)
    for config in ("8K8E128D", "16K32E256D"):  # eager and compiled
        assert re.search(rf"^\| {config} \| 1,024 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \| [\d.]+x \| "
                         rf"[\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, re.M)
    report = json.loads(open(re.search(r"written: (\S+)", out).group(1)).read())
    assert report["device"].startswith("CPU") and len(report["table"]) == 2
    moa, dense = report["profile"]
    assert moa["ms_by_kind"]["grouped GEMM"] > 0 and moa["ms_by_kind"]["scatters"] > 0
    assert dense["ms_by_kind"]["grouped GEMM"] == 0 and dense["ms_by_kind"]["attention"] > 0
    assert [(r["arch"], r["against"]) for r in report["models"]] == [
        ("moa_base", "transformer_wmt_en_de"), ("moh_base", "transformer_wmt_en_de"),
        ("moa_big", "transformer_vaswani_wmt_en_de_big")]
    for r in report["models"]:  # each ratio is measured, and moa_big (16 of 32 experts of 256) is the cheaper
        assert r["train_words_per_s"] > 0 and r["generate_sentences_per_s"] > 0
    assert report["models"][2]["macs_ratio"] < 1
    assert sorted(os.listdir(tmp_path / "check")) == ["check.log", "environment.txt", "gpu-check.json", "gpu-check.md",
                                                      "profile-16K32E256D.txt", "profile-dense.txt"]
    assert "| MoA 16K32E256D module, grouped projections | 0 | - |" in (tmp_path / "check" / "check.log").read_text()
    assert f"torch {torch.__version__}" in (tmp_path / "check" / "environment.txt").read_text()
    bad = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--fast"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_guard_verdict_is_the_median_ratio_against_twice_its_standard_error():
    from benchmarks import guard

    assert guard.verdict([1.0] * 8) == (1.0, guard.MIN_NOISE, False)  # no spread: the 2% floor
    ratio, noise, failed = guard.verdict([1.1] * 7 + [1.3])
    assert ratio == pytest.approx(1.1) and failed
    ratio, noise, failed = guard.verdict([0.8, 1.3, 1.0, 1.1, 0.9, 1.2])  # median 1.05 in a spread that wide
    assert ratio == pytest.approx(1.05) and noise > 0.05 and not failed


def test_guard_checks_out_the_base_and_refuses_what_is_not_a_commit(tmp_path):
    from benchmarks import guard

    commit = guard.checkout("HEAD", str(tmp_path))
    assert len(commit) == 40 and (tmp_path / "moa" / "experts.py").is_file()
    assert not (tmp_path / "tests").exists()  # the package alone
    with pytest.raises(SystemExit, match="--base no-such-ref: not a commit"):
        guard.checkout("no-such-ref", str(tmp_path))
    with pytest.raises(SystemExit, match="JOB=FRACTION"):
        guard.parse_slowdown(["train=0.1"])


@pytest.mark.slow
def test_the_guard_fails_on_an_injected_slowdown():
    """The whole guard, one job, the working tree against HEAD: three times slower is caught."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.guard", "--base", "HEAD", "--jobs", "lm-moa",
                          "--processes", "2", "--rounds", "2", "--inject-slowdown", "lm-moa=2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    row = re.search(r"^lm-moa +(\d+\.\d+) +(\d+\.\d+)  SLOWER", run.stdout, re.M)
    assert row and float(row.group(1)) > 2


def test_the_gpu_check_names_the_kit_when_its_python_has_no_fairseq(tmp_path):
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--quick", "--kit", str(tmp_path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHON="/usr/bin/python3"))
    assert proc.returncode == 1
    assert f"/usr/bin/python3 cannot import fairseq and {tmp_path} holds no wheels: run bash benchmarks/device_kit.sh" \
        in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_device_kit_holds_the_lent_machines_missing_wheels_within_40_mib(tmp_path):
    """Downloads from the package index (about 22 MB): the wheels for Python 3.12 that the lent GPU
    machine lacks, antlr4 built here from its source archive, and the install line."""
    kit = tmp_path / "kit"
    proc = subprocess.run(["bash", "benchmarks/device_kit.sh", "--out", str(kit)], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = sorted(os.listdir(kit))
    names = [re.match(r"[A-Za-z0-9_]+?-", w).group(0)[:-1].lower() for w in wheels if w.endswith(".whl")]
    assert names == ["antlr4_python3_runtime", "bitarray", "fairseq_fixed", "hydra_core", "omegaconf", "sacremoses"]
    assert all(w.endswith(("-py3-none-any.whl", "-cp312-cp312-manylinux_2_28_x86_64.whl")) or "cp312-cp312-manylinux" in w
               for w in wheels if w.endswith(".whl"))
    assert sum(os.path.getsize(kit / w) for w in wheels) <= 40 * 2 ** 20
    assert "--no-index --no-deps --target" in (kit / "INSTALL").read_text()
