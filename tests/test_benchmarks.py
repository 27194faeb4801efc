"""Every study's entry point runs end to end on tiny settings and reports what it measured; the harness
counts and times what it says (the developer tools: tests/test_dev_tools.py)."""

import json
import os
import re
import subprocess
import sys

import fairseq
import pytest
import torch
from fairseq.data import Dictionary

from benchmarks.harness.corpora import multi30k_models as models
from benchmarks.multi30k import equal_time
from benchmarks.multi30k.equal_time import MODELS
from benchmarks.speed.authors_style_moa import AuthorsStyleMoA
from helpers import ROOT, needs_shared
from moa.moa_attention import MixtureOfAttentionHeads
from moa.models.build import build_translation_model, dictionary_of_size

needs_multi30k, _ = needs_shared("multi30k")
needs_wikitext, _ = needs_shared("wikitext-2", "wiki.valid.tokens")

MODEL_LABELS = {key: label for key, (label, _) in MODELS.items()}


def test_authors_style_baseline_matches_moa_with_raw_gates():
    torch.manual_seed(0)
    m = MixtureOfAttentionHeads(32, 8, 3, 16, self_attention=True, gate_weights="raw").double()
    x = torch.randn(6, 4, 32, dtype=torch.double)
    want = m(x, x, x, need_weights=False)[0]
    # both in float64, routers included: 1e-9 leaves room for rounding only (see test_attention_reference)
    torch.testing.assert_close(AuthorsStyleMoA(m)(x), want, rtol=1e-9, atol=1e-10)
    with torch.no_grad():  # negative control: one expert's output projection off by 1e-6, and they differ
        m.o_experts.weight[int(m.routing.selected[0, 0]), 0, 0] *= 1 + 1e-6
    with pytest.raises(AssertionError):
        torch.testing.assert_close(AuthorsStyleMoA(m)(x), want, rtol=1e-9, atol=1e-10)


@pytest.mark.slow
def test_quick_benchmark_reports_every_module(tmp_path):
    out = tmp_path / "quick.json"
    profile = tmp_path / "profile"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.models_and_modules", "--quick", "--profile", str(profile),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    names = {r["module"] for r in report["modules"]}
    assert names == {"MHA 8x64", "8K8E128D", "16K32E256D", "2K8E64D", "4K16E64D"}
    assert report["peak_gflops"] > 0
    for row in report["modules"]:
        assert 0 < row["fwd_bwd_peak_fraction"] < 1 and row["fwd_bwd_ms"] > 0 and row["fwd_ms"] > 0
    assert "| 8K8E128D | 1024 | 64 |" in (tmp_path / "quick.md").read_text()
    moh = {r["module"]: r for r in report["moh"]}
    assert set(moh) == {"MHA 16x64", "MoH 75% (8 + top-4 of 8)", "MoH 50% (4 + top-4 of 12)",
                        "MoH 75% (8 + top-4 of 8), dense-masked", "MoH 50% (4 + top-4 of 12), dense-masked"}
    assert moh["MHA 16x64"]["macs_ratio"] == 1.0
    d, seq = 1024, 512  # 8 of 16 heads of 64: their queries and outputs, every key and value, the router, attention
    assert moh["MoH 50% (4 + top-4 of 12)"]["macs_ratio"] == pytest.approx(
        (2 * 8 * 64 * d + 2 * d * d + d * 18 + 2 * 8 * seq * 64) / (2 * d * d + 2 * d * d + 2 * 16 * seq * 64))
    for row in moh.values():
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ratio"] > 0
    small = {r["arch"]: r for r in report["small"]}  # the Multi30k shape, whole models side by side
    assert list(small) == ["transformer", "moa_small", "moh_small", "moh_small/query-norm", "switchhead_small",
                           "switchhead_small/1H2K7E64D"]
    assert small["transformer"]["train_ratio"] == small["transformer"]["decode_ratio"] == 1.0
    for row in small.values():
        assert row["train_ms"] > 0 and row["decode_ms"] > 0 and row["peak_mb"] > row["saved_activations_mb"] > 0
        assert row["saved_activations_mb"] > 0 and row["batch"] == "128x16"
    # MoA's single shared K/V head: a quarter of the 4-head Transformer's cache
    assert small["moa_small"]["kv_cache_bytes_per_token_per_layer"] * 4 == \
        small["transformer"]["kv_cache_bytes_per_token_per_layer"]
    assert report["runs"]["small"]["command"].startswith("python -m benchmarks.speed.models_and_modules --quick")
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
    assert all("sacrebleu_after" in r and min(r["decode_s"]) > 0 for r in report["translation"])  # scoring: test_scoring


@pytest.mark.slow
@needs_multi30k
def test_multi30k_translation_benchmark_smoke(tmp_path):
    out = tmp_path / "result"
    # a checkpoint left by an earlier run must not be resumed (fairseq would fail on this one)
    stale = tmp_path / "work" / "en-de" / "seed1" / "moa" / "checkpoint_last.pt"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"left by an earlier run")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multi30k.equal_time", "--smoke",
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
    assert run["command"].startswith("python -m benchmarks.multi30k.equal_time --smoke --pairs en-de --seeds 1 2")
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
        assert "sacrebleu" in row and row["train_words_per_s"] > 0
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
    subprocess.run([sys.executable, "-m", "benchmarks.multi30k.equal_time", "--combine",
                    str(tmp_path / "seed1.json"), str(tmp_path / "seed2.json"), "--out", str(tmp_path / "both")],
                   check=True, capture_output=True, cwd=ROOT)
    both = json.loads((tmp_path / "both.json").read_text())
    assert (both["budget"], both["rows"]) == (report["budget"], report["rows"])
    assert both["run"]["command"].startswith("python -m benchmarks.multi30k.equal_time --combine")
    assert mean in (tmp_path / "both.md").read_text()
    # the compute dial reads the checkpoints this run left: MoA at k = 1 and its trained k = 4, MoH at K = 1
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compute_dial", "--workdir", str(tmp_path / "work"),
                           "--smoke", "--out", str(tmp_path / "dial")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    dial = {(r["model_id"], r["setting"]): r for r in json.loads((tmp_path / "dial.json").read_text())["rows"]}
    assert list(dial) == [("transformer", None), ("moa", 1), ("moa", 4), ("moh", 1)]
    assert dial[("moa", 4)]["trained_setting"] and not dial[("moa", 1)]["trained_setting"]
    assert dial[("moa", 1)]["macs_per_target_token"] < dial[("moa", 4)]["macs_per_target_token"]
    assert dial[("transformer", None)]["decode_time_ratio"] == 1.0
    assert all("sacrebleu" in r and r["decode_sentences_per_s"] > 0 for r in dial.values())
    assert "| MoA (moa_small) | k = 4 of 8 experts (trained) |" in (tmp_path / "dial.md").read_text()


@pytest.mark.slow
@needs_multi30k
def test_converged_study_smoke_trains_scores_skips_and_reports(tmp_path):
    """The converged study's whole path on the first 3,000 lines and 2 epochs: train, average, score, count,
    write the row; a rerun skips the recorded run; --report makes the tables and the picture."""
    out, work = tmp_path / "out", tmp_path / "work"
    command = [sys.executable, "-m", "benchmarks.multi30k.converged", "--smoke", "--models", "transformer", "moa",
               "--seeds", "1", "--workdir", str(work), "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r: json.loads((out / "runs" / f"{r}-seed1-lr2e-3-warmup1000-tokens2048.json").read_text())
            for r in ("transformer", "moa-4K8E64D")}
    for row in rows.values():
        assert (row["epoch_cap"], row["epochs"], row["stopped_by"]) == (2, 2, "epoch cap")
        assert set(row["valid_nll_by_epoch"]) == {"1", "2"} and row["best_valid_nll"] > 0
        assert "sacrebleu" in row["averaged"] and row["best"]["translated"] == 100
        assert row["segment_commits"] == [row["run"]["commit"]]  # one fairseq-train call, at this checkout
    assert rows["moa-4K8E64D"]["macs_per_target_token"] < rows["transformer"]["macs_per_target_token"]
    assert (work / "converged" / "moa-4K8E64D-seed1-lr2e-3-warmup1000-tokens2048" / "averaged-last2.pt").is_file()
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert again.stdout.count("recorded already, skipped") == 2
    subprocess.run([sys.executable, "-m", "benchmarks.multi30k.converged", "--report", "--out", str(out)], check=True,
                   capture_output=True, cwd=ROOT)
    report = (out / "converged.md").read_text()
    assert "## Every run" in report and "| MoA 4K8E64D (moa_small) | 1 |" in report and (out / "valid-nll.png").is_file()
    assert (out / "frontier-macs.png").is_file() and (out / "frontier-parameters.png").is_file()
    refused = subprocess.run(command[:3] + ["--smoke"], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 2 and "name a scratch folder with --out" in refused.stderr


@pytest.mark.slow
@needs_wikitext
def test_wikitext_studies_smoke(tmp_path):
    """The masked LM, the LMs, and the LM conversion, 10 updates each, sharing one prepared corpus."""
    work = str(tmp_path / "work")
    for module, extra in (("mlm", ["--models", "moa", "transformer", "--out", str(tmp_path / "mlm")]),
                          ("lm", ["--models", "transformer", "moa", "--out", str(tmp_path / "lm")]),
                          ("lm", ["--convert", "--out", str(tmp_path / "lm")])):
        proc = subprocess.run([sys.executable, "-m", f"benchmarks.wikitext.{module}", "--smoke", "--workdir", work,
                               *extra], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    mlm = json.loads((tmp_path / "mlm.json").read_text())["rows"]
    assert [(r["model_id"], r["updates"]) for r in mlm] == [("moa", 10), ("transformer", 10)]
    lm = {r["model_id"]: r for r in json.loads((tmp_path / "lm" / "lm-wikitext2.json").read_text())["rows"]}
    converted = {r["model_id"]: r for r in json.loads((tmp_path / "lm" / "convert-lm.json").read_text())["rows"]}
    assert set(converted) == {"converted-moh-75", "converted-moh-50", "continued-transformer",
                              "continued-converted-moh-75", "continued-converted-moh-50"}
    # conversion keeps every weight (the router it adds has none) and continues 5 updates
    assert converted["converted-moh-75"]["parameters"] == lm["transformer"]["parameters"]
    assert converted["continued-converted-moh-50"]["updates"] == 5
    for row in mlm + list(lm.values()) + list(converted.values()):
        assert row["valid_ppl"] > 1 and row["test_ppl"] > 1
    assert "| equal updates, 10 per model | MoA 4K8E64D (moa_roberta_small) | 1 |" in (tmp_path / "mlm.md").read_text()


@pytest.mark.slow
@needs_multi30k
def test_bf16_study_quick_measures_every_section(tmp_path):
    out = tmp_path / "bf16.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.bf16", "--quick", "--models", "moa_small",
                           "--workdir", str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    trainer = {r["precision"]: r for r in report["trainer"]}
    assert set(trainer) == {"float32", "bf16", "memory-efficient-bf16"} and trainer["float32"]["trainer_speedup"] == 1.0
    assert all(r["words_per_s"] > 0 for r in trainer.values())
    [train] = report["fairseq-train"]
    assert train["float32_wps"] > 0 and train["bf16_wps"] > 0
    assert [r["model"] for r in report["decode"]] == ["moa_small"]
    assert [r["module"] for r in report["modules"]] == ["MoA 8K8E128D", "MoA 4K32E64D", "MoA 16K32E256D", "MHA 8x64"]
    assert set(report["runs"]) == {"trainer", "fairseq-train", "decode", "modules"}


@pytest.mark.slow
def test_compile_study_quick_times_the_compiled_step_beside_eager(tmp_path):
    out = tmp_path / "compile.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.compile", "--quick", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert (row["model"], row["job"]) == ("moa_small", "train") and "error" not in row
    assert row["compiled_ms"] > 0 and row["graphs"] >= 1 and row["first_call_compiled_s"] > row["first_call_eager_s"]


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
        equal_time.main(["--moa-config", "8K4E64D", "--combine", "unused.json"])
    assert usage.value.code == 2 and "--moa-config '8K4E64D': expected kKeEdD with k <= e" in capsys.readouterr().err


def test_multi30k_combine_refuses_runs_with_different_settings(tmp_path, capsys):
    def report(budget):
        return {"budget": budget, "rows": [{"pair": "en-de", "model_id": "transformer", "moa_config": None, "model": MODEL_LABELS["transformer"],
                                            "sacrebleu": 20.0}]}

    (tmp_path / "a.json").write_text(json.dumps(report("equal training time, 11 min per model, seed 1")))
    (tmp_path / "b.json").write_text(json.dumps(report(
        "equal training time, 11 min per model, batches of up to 2048 tokens, 200 warmup updates, seed 2")))
    code = equal_time.main(["--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                                      "--out", str(tmp_path / "both")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("benchmarks.multi30k.equal_time: error: --combine: these runs had different budgets")
    assert "batches of up to 2048 tokens, 200 warmup updates" in err
    assert not (tmp_path / "both.json").exists()


@pytest.mark.slow
def test_quick_lm_decoding_benchmark_reports_every_model_and_the_cache_ratios(tmp_path):
    out = tmp_path / "lm.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.lm_decoding", "--quick", "--batches", "2", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    decode = {(r["model_id"], r["context"]): r for r in report["decode"]}
    assert {model for model, _ in decode} == {"transformer", "moa", "moh-75", "moh-50", "moh-50-all-heads", "switchhead"}
    for (model, context), row in decode.items():
        assert row["ms_per_token"] > 0 and row["kv_allocated_mb"] >= row["kv_cache_mb"] > 0
        # one shared K/V head of 64 against four; SwitchHead two heads of 56 against four of 64; MoH caches every
        # head, as the Transformer does
        expected = {"moa": 64 / 256, "switchhead": 2 * 56 / 256}.get(model, 1.0)
        assert row["kv_ratio"] == pytest.approx(expected, abs=0.01)
    assert decode[("transformer", 64)]["time_ratio"] == 1.0
    module = {r["module_id"]: r for r in report["module"]}
    assert module["mha"]["macs_ratio"] == 1.0
    assert module["moh-50"]["macs_ratio"] == pytest.approx(
        (2 * 16 * 64 * 2048 + 2 * 2048 ** 2 + 2048 * 34 + 2 * 16 * 256 * 64) / (4 * 2048 ** 2 + 2 * 32 * 256 * 64))
    assert {r["context"] for r in report["crossover"] if "module" in r} == {64, 256}
    assert report["runs"]["decode"]["command"].startswith("python -m benchmarks.speed.lm_decoding --quick")
    assert "| moa_lm_small (4K8E64D) | 2 | 64 |" in (tmp_path / "lm.md").read_text()




@pytest.mark.slow
@needs_multi30k
def test_last_batch_study_smoke_counts_both_rules(tmp_path):
    """One epoch on the first 3,000 lines: fairseq's rule validates the sentences it does not leave out, the
    plugin's every sentence of the split, and the table says so."""
    out = tmp_path / "last-batch"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multi30k.last_batch", "--smoke", "--workdir",
                           str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "last-batch.json").read_text())
    sentences, left_out = report["left_out"]["2048"][:2]
    (row,) = report["rows"]
    assert row["sentences_every_sentence"] == sentences == 200  # the smoke mirror's validation lines
    assert row["sentences_fairseq"] == sentences - left_out
    assert (left_out == 0) == (row["nll_fairseq"] == row["nll_every_sentence"])
    assert "| Transformer" in (tmp_path / "last-batch.md").read_text()


def test_every_renamed_study_module_names_one_that_exists_and_result_files_say_so():
    """A recorded command whose module was renamed says which module remakes it now: each new name runs
    (``python -m``), no old one does, and no result page names an old module without the new one."""
    import glob
    import importlib.util

    from benchmarks.harness.results import RENAMED, ROOT, command_note

    for old, new in RENAMED.items():
        assert importlib.util.find_spec(old) is None, old
        spec = importlib.util.find_spec(new)
        assert spec is not None and (spec.submodule_search_locations is None
                                     or importlib.util.find_spec(new + ".__main__")), new
    assert command_note("python -m benchmarks.moa_speed --rounds 9") == \
        " (that module is now `benchmarks.speed.models_and_modules`)"
    assert command_note("python -m benchmarks.speed.bf16") == ""
    for path in glob.glob(os.path.join(ROOT, "benchmarks", "**", "results", "**", "*.md"), recursive=True):
        text = open(path, encoding="utf-8").read()
        for old in RENAMED:
            for match in re.finditer(rf"`python -m {re.escape(old)}(?: [^`]*)?`", text):
                assert text[match.end():].startswith(" (that module is now"), (path, match.group(0))
