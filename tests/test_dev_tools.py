"""The developer tools: the speed guard's verdict and its failure on a slowdown, the GPU check's CPU part,
the device kit and its rehearsal's command line."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers import ROOT


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA gpu_check.sh measures the GPU; its CPU part runs "
                                                       "where there is none")
def test_the_gpu_check_runs_its_cpu_part(tmp_path):
    """Without CUDA, benchmarks/dev/gpu_check.sh skips tests/gpu and runs its measurements on the CPU: no host
    read in the MoA modules' steps on the grouped projections, one per MoH module, the table eager and
    compiled, the profile and the whole models; all of it in one folder."""
    proc = subprocess.run(["bash", "benchmarks/dev/gpu_check.sh", "--quick", "--out", str(tmp_path / "check")],
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
    bad = subprocess.run(["bash", "benchmarks/dev/gpu_check.sh", "--fast"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_guard_verdict_is_the_median_ratio_against_twice_its_standard_error():
    from benchmarks.dev import guard

    assert guard.verdict([1.0] * 8) == (1.0, guard.MIN_NOISE, False)  # no spread: the 2% floor
    ratio, noise, failed = guard.verdict([1.1] * 7 + [1.3])
    assert ratio == pytest.approx(1.1) and failed
    ratio, noise, failed = guard.verdict([0.8, 1.3, 1.0, 1.1, 0.9, 1.2])  # median 1.05 in a spread that wide
    assert ratio == pytest.approx(1.05) and noise > 0.05 and not failed


def test_guard_checks_out_the_base_and_refuses_what_is_not_a_commit(tmp_path):
    from benchmarks.dev import guard

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
    run = subprocess.run([sys.executable, "-m", "benchmarks.dev.guard", "--base", "HEAD", "--jobs", "lm-moa",
                          "--processes", "2", "--rounds", "2", "--inject-slowdown", "lm-moa=2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    row = re.search(r"^lm-moa +(\d+\.\d+) +(\d+\.\d+)  SLOWER", run.stdout, re.M)
    assert row and float(row.group(1)) > 2


def test_the_gpu_check_names_the_kit_when_its_python_has_no_fairseq(tmp_path):
    proc = subprocess.run(["bash", "benchmarks/dev/gpu_check.sh", "--quick", "--kit", str(tmp_path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHON="/usr/bin/python3"))
    assert proc.returncode == 1
    assert f"/usr/bin/python3 cannot import fairseq and {tmp_path} holds no wheels: run bash benchmarks/dev/device_kit.sh" \
        in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_device_kit_holds_the_lent_machines_missing_wheels_within_40_mib(tmp_path):
    """Downloads from the package index (about 22 MB): the wheels for Python 3.12 that the lent GPU
    machine lacks, antlr4 built here from its source archive, and the install line."""
    kit = tmp_path / "kit"
    proc = subprocess.run(["bash", "benchmarks/dev/device_kit.sh", "--out", str(kit)], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr[-3000:]
    wheels = sorted(os.listdir(kit))
    names = [re.match(r"[A-Za-z0-9_]+?-", w).group(0)[:-1].lower() for w in wheels if w.endswith(".whl")]
    assert names == ["antlr4_python3_runtime", "bitarray", "fairseq_fixed", "hydra_core", "omegaconf", "sacremoses"]
    assert all(w.endswith(("-py3-none-any.whl", "-cp312-cp312-manylinux_2_28_x86_64.whl")) or "cp312-cp312-manylinux" in w
               for w in wheels if w.endswith(".whl"))
    assert sum(os.path.getsize(kit / w) for w in wheels) <= 40 * 2 ** 20
    assert "--no-index --no-deps --target" in (kit / "INSTALL").read_text()


def test_the_rehearsal_names_its_options():
    """The rehearsal itself downloads a 4.6 GB torch build (run by hand before a device call); its command line
    is checked here."""
    proc = subprocess.run(["bash", "benchmarks/dev/rehearse_device.sh", "--bogus"], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 2 and "usage: bash benchmarks/dev/rehearse_device.sh [--torch VERSION]" in proc.stderr
