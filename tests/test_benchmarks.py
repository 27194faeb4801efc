"""The benchmark's baseline computes what MoA computes, and the benchmark command runs and reports."""

import json
import os
import subprocess
import sys

import torch

from moa.attention import MixtureOfAttentionHeads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from authors_style_moa import AuthorsStyleMoA  # noqa: E402


def test_authors_style_baseline_matches_moa_with_raw_gates():
    torch.manual_seed(0)
    m = MixtureOfAttentionHeads(32, 8, 3, 16, self_attention=True, gate_weights="raw").double()
    x = torch.randn(6, 4, 32, dtype=torch.double)
    torch.testing.assert_close(AuthorsStyleMoA(m)(x), m(x, x, x, need_weights=False)[0], rtol=1e-5, atol=1e-6)


def test_quick_benchmark_reports_every_module(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "moa_speed.py"), "--quick",
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    names = {r["module"] for r in report["modules"]}
    assert names == {"MHA 8x64", "8K8E128D", "16K32E256D", "2K8E64D", "4K16E64D"}
    assert report["peak_gflops"] > 0
    for row in report["modules"]:
        assert 0 < row["fwd_bwd_peak_fraction"] < 1.5 and row["fwd_bwd_ms"] > 0 and row["fwd_ms"] > 0
    assert "| 8K8E128D | 1024 | 64 |" in (tmp_path / "quick.md").read_text()
