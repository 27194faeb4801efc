"""The real fairseq CLIs in subprocesses: preprocess -> train -> generate -> score, validation, safe
checkpoint loading, the compute dial, and the moa-demo main job on a small budget (resuming: bit for bit in
test_exact_resume)."""

import math
import os
import pickle
import re

import pytest
import sacrebleu
import torch
from fairseq.data import Dictionary

from helpers import run_cli
from moa.fairseq_fixes.checkpoint_safety import fairseq_checkpoint_globals
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus
from moa_tools.scoring import read_hypotheses
from moa_tools.textio import read_lines

pytestmark = pytest.mark.slow

TEST_SENTENCES = 37  # not a multiple of 8: fairseq would drop a tail batch without --required-batch-size-multiple 1
COMMON = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim",
          "128", "--share-all-embeddings", "--criterion", "moa_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
          "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "2048", "--cpu", "--num-workers", "0",
          "--log-format", "simple", "--log-interval", "5", "--no-epoch-checkpoints", "--seed", "3",
          "--save-interval-updates", "10"]
TRAIN = ["--arch", "moa_small", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "16", *COMMON]
MOH_TRAIN = ["--arch", "moh_small", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
             "--moh-shared-heads", "1", "--moh-top-k", "2", *COMMON]
SWITCHHEAD_TRAIN = ["--arch", "switchhead_small", "--switchhead-experts", "4", "--switchhead-top-k", "2",
                    "--switchhead-head-dim", "16", *COMMON]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e")
    raw, data_bin, ckpt = (str(work / d) for d in ("raw", "data-bin", "checkpoints"))
    write_corpus(raw, {"train": 2000, "valid": 40, "test": TEST_SENTENCES}, seed=7)
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", data_bin,
            "--joined-dictionary", "--workers", "1")
    train = run_cli("fairseq-train", data_bin, "--user-dir", USER_DIR, *TRAIN, "--save-dir", ckpt, "--max-update", "20")
    return {"work": work, "raw": raw, "data_bin": data_bin, "ckpt": ckpt, "train_log": train.stdout + train.stderr}


def uniform_bits(data_bin):
    """The loss of a model that gives every symbol of the target dictionary the same probability: log2 |V|
    bits, with or without label smoothing (which mixes in that same uniform distribution)."""
    return math.log2(len(Dictionary.load(os.path.join(data_bin, "dict.de.txt"))))


def test_training_logs_moa_figures_and_learns(trained):
    log = trained["train_log"]
    assert "MoATransformerModel" in log and "MixtureOfAttentionHeads" in log
    assert "MoA: 6 of 12 experts active per token (50.0%)" in log  # 3 modules, 2 of 4 experts each
    last = [line for line in log.splitlines() if "| train |" in line][-1]
    figures = dict(re.findall(r"\| (\w+) ([-\d.]+)", last))
    assert int(figures["num_updates"]) == 20
    assert {"moa_la", "moa_lz", "moa_load_cv", "aux_loss"} <= set(figures)
    # 20 updates leave the model more than a bit better than the uniform guess over the target dictionary
    assert float(figures["loss"]) < uniform_bits(trained["data_bin"]) - 1, (figures["loss"], uniform_bits(trained["data_bin"]))


def test_generate_translates_every_test_sentence_and_scores(trained):
    proc = run_cli("fairseq-generate", trained["data_bin"], "--user-dir", USER_DIR, "--cpu", "--gen-subset", "test",
                   "--path", os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--beam", "4", "--lenpen", "0.6",
                   "--batch-size", "8", "--required-batch-size-multiple", "1", "--post-process", "subword_nmt")
    log = os.path.join(trained["work"], "generate.log")
    with open(log, "w", encoding="utf-8") as f:
        f.write(proc.stdout)
    assert f"Translated {TEST_SENTENCES} sentences" in proc.stdout + proc.stderr
    hyps = read_hypotheses(log)
    assert sorted(hyps) == list(range(TEST_SENTENCES))
    assert not any("@@" in h for h in hyps.values())
    refs = list(read_lines(os.path.join(trained["raw"], "test.ref.de")))
    expected = sacrebleu.corpus_bleu([hyps[i] for i in range(TEST_SENTENCES)], [refs]).score
    scored = run_cli("moa-score", log, os.path.join(trained["raw"], "test.ref.de"), "--lang", "de")
    assert scored.returncode == 0, scored.stderr
    reported = float(re.search(r"^sacreBLEU = ([\d.]+)  \((.*)\)$", scored.stdout, re.M).group(1))
    assert reported == pytest.approx(expected, abs=0.005) and "tok:13a" in scored.stdout
    assert re.search(r"^tokenised BLEU with compound splitting = [\d.]+$", scored.stdout, re.M)
    with open(log + ".short", "w", encoding="utf-8") as f:
        f.writelines(line for line in proc.stdout.splitlines(keepends=True) if not line.startswith("D-5\t"))
    short = run_cli("moa-score", log + ".short", os.path.join(trained["raw"], "test.ref.de"), "--lang", "de",
                    check=False)
    assert short.returncode == 1 and "translated 36 sentences for 37 references; missing ids start [5]" in short.stderr


@pytest.mark.parametrize("fixture", ["trained", "trained_moh", "trained_switchhead"])
def test_two_generate_processes_print_the_same_bytes(fixture, request):
    """No path is chosen by timing: two fairseq-generate processes on one checkpoint print the same
    sources, hypotheses, scores and positional scores, to the last digit."""
    model = request.getfixturevalue(fixture)
    runs = [run_cli("fairseq-generate", model["data_bin"], "--user-dir", USER_DIR, "--cpu", "--gen-subset", "test",
                    "--path", os.path.join(model["ckpt"], "checkpoint_last.pt"), "--beam", "4", "--lenpen", "0.6",
                    "--batch-size", "8", "--required-batch-size-multiple", "1").stdout for _ in range(2)]
    lines = [[line for line in run.splitlines() if re.match(r"[STHDP]-\d+\t", line)] for run in runs]
    assert len(lines[0]) == 5 * TEST_SENTENCES
    assert lines[0] == lines[1]


def test_validate_reports_loss(trained):
    proc = run_cli("fairseq-validate", trained["data_bin"], "--user-dir", USER_DIR, "--cpu", "--task", "translation",
                   "--path", os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--valid-subset", "valid",
                   "--required-batch-size-multiple", "1", "--max-tokens", "2048")
    match = re.search(r"valid on 'valid' subset \| loss ([\d.]+) \| nll_loss ([\d.]+)", proc.stdout + proc.stderr)
    assert match, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert 0 < float(match.group(2)) < uniform_bits(trained["data_bin"]) - 1  # far better than the uniform guess


def test_checkpoint_needs_only_the_allow_list(trained):
    path = os.path.join(trained["ckpt"], "checkpoint_last.pt")
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in fairseq_checkpoint_globals()}
    unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    assert unsafe <= allowed, unsafe - allowed
    state = torch.load(path, map_location="cpu")  # the safe loader with the plugin's allow-list
    assert state["optimizer_history"][-1]["num_updates"] == 20


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_generate_refuses_a_checkpoint_that_would_run_code(trained, tmp_path):
    marker = tmp_path / "payload-ran"
    evil = _RunsCode()
    evil.marker = marker
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"args": None, "model": {}, "payload": evil}, f, protocol=2)
    proc = run_cli("fairseq-generate", trained["data_bin"], "--user-dir", USER_DIR, "--cpu", "--gen-subset", "test",
                   "--path", str(path), "--beam", "2", check=False)
    assert proc.returncode != 0
    assert "Weights only load failed" in proc.stderr and "system" in proc.stderr
    assert not marker.exists()


def test_moa_demo_runs_end_to_end(tmp_path):
    proc = run_cli("moa-demo", "--workdir", str(tmp_path / "demo"), "--train-size", "300", "--test-size", "21",
                   "--max-update", "3", "--train-args", "--encoder-layers 1 --decoder-layers 1")
    assert "sacreBLEU on 21 test sentences" in proc.stdout
    assert re.search(r"^BLEU = \d+\.\d\d  \(nrefs:1\|", proc.stdout, re.M)


def test_average_checkpoints_then_generate(trained, tmp_path):
    out = str(tmp_path / "averaged.pt")
    proc = run_cli("moa-average-checkpoints", "--inputs", trained["ckpt"], "--num-update-checkpoints", "2",
                   "--checkpoint-upper-bound", "20", "--output", out)
    names = [next(n for n in os.listdir(trained["ckpt"]) if re.fullmatch(rf"checkpoint_\d+_{u}\.pt", n))
             for u in (10, 20)]
    assert ", ".join(names) in proc.stdout
    states = [torch.load(os.path.join(trained["ckpt"], n), map_location="cpu") for n in names]
    averaged = torch.load(out, map_location="cpu")["model"]
    for name, tensor in averaged.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(tensor, (states[0]["model"][name] + states[1]["model"][name]) / 2)
    gen = run_cli("fairseq-generate", trained["data_bin"], "--user-dir", USER_DIR, "--cpu", "--gen-subset", "test",
                  "--path", out, "--beam", "2", "--batch-size", "8", "--required-batch-size-multiple", "1")
    assert f"Translated {TEST_SENTENCES} sentences" in gen.stdout + gen.stderr
    too_many = run_cli("moa-average-checkpoints", "--inputs", trained["ckpt"], "--num-update-checkpoints", "9",
                       "--output", out, check=False)
    assert too_many.returncode == 1 and "fewer than the 9 asked for" in too_many.stderr


def test_interactive_translates_from_stdin(trained):
    with open(os.path.join(trained["raw"], "test.en"), encoding="utf-8") as f:
        sources = [next(f), next(f)]
    proc = run_cli("fairseq-interactive", trained["data_bin"], "--user-dir", USER_DIR, "--cpu",
                   "--path", os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--beam", "2",
                   "--source-lang", "en", "--target-lang", "de", "--post-process", "subword_nmt",
                   input="".join(sources))
    assert len(re.findall(r"^H-\d+\t", proc.stdout, re.M)) == 2


def train_beside(trained, folder, flags):
    """Another model trained 20 updates on the ``trained`` fixture's data, into ``folder``."""
    ckpt = str(folder / "checkpoints")
    train = run_cli("fairseq-train", trained["data_bin"], "--user-dir", USER_DIR, *flags, "--save-dir", ckpt,
                    "--max-update", "20")
    return dict(trained, ckpt=ckpt, train_log=train.stdout + train.stderr)


def generate_and_score_every_sentence(model):
    """fairseq-generate over the test set of ``model`` (a trained fixture) and moa-score: every sentence."""
    proc = run_cli("fairseq-generate", model["data_bin"], "--user-dir", USER_DIR, "--cpu", "--gen-subset", "test",
                   "--path", os.path.join(model["ckpt"], "checkpoint_last.pt"), "--beam", "4", "--lenpen", "0.6",
                   "--batch-size", "8", "--required-batch-size-multiple", "1", "--post-process", "subword_nmt")
    generate_log = os.path.join(model["ckpt"], "generate.log")
    with open(generate_log, "w", encoding="utf-8") as f:
        f.write(proc.stdout)
    assert f"Translated {TEST_SENTENCES} sentences" in proc.stdout + proc.stderr
    scored = run_cli("moa-score", generate_log, os.path.join(model["raw"], "test.ref.de"), "--lang", "de")
    assert f"{TEST_SENTENCES} of {TEST_SENTENCES} test sentences translated" in scored.stdout


@pytest.fixture(scope="module")
def trained_moh(trained, tmp_path_factory):
    return train_beside(trained, tmp_path_factory.mktemp("e2e-moh"), MOH_TRAIN)


def test_moh_trains_translates_every_test_sentence_and_scores(trained_moh):
    log = trained_moh["train_log"]
    assert "MoHTransformerModel" in log and "MixtureOfHeadsAttention" in log
    last = dict(re.findall(r"\| (\w+) ([-\d.]+)", [line for line in log.splitlines() if "| train |" in line][-1]))
    assert int(last["num_updates"]) == 20 and float(last["moh_active"]) == pytest.approx(0.75)
    assert "moh_lb" in last and float(last["loss"]) < uniform_bits(trained_moh["data_bin"]) - 1
    generate_and_score_every_sentence(trained_moh)


@pytest.fixture(scope="module")
def trained_switchhead(trained, tmp_path_factory):
    return train_beside(trained, tmp_path_factory.mktemp("e2e-switchhead"), SWITCHHEAD_TRAIN)


def test_switchhead_trains_translates_every_test_sentence_and_scores(trained_switchhead):
    log = trained_switchhead["train_log"]
    assert "SwitchHeadTransformerModel" in log and "SwitchHeadAttention" in log
    assert "SwitchHead: 12 of 24 value and output experts active per token (50.0%)" in log  # 3 modules, 2 heads
    last = dict(re.findall(r"\| (\w+) ([-\d.]+)", [line for line in log.splitlines() if "| train |" in line][-1]))
    assert int(last["num_updates"]) == 20 and float(last["aux_loss"]) == 0 and "switchhead_load_cv" in last
    assert float(last["loss"]) < uniform_bits(trained_switchhead["data_bin"]) - 1
    generate_and_score_every_sentence(trained_switchhead)


def test_analyze_names_what_it_does_not_read(trained_switchhead):
    """moa-analyze reads routers whose scores are distributions; on SwitchHead it says so instead of printing
    an entropy of sigmoid scores."""
    proc = run_cli("moa-analyze", os.path.join(trained_switchhead["ckpt"], "checkpoint_last.pt"),
                   trained_switchhead["data_bin"], "--subset", "test", "--out", str(trained_switchhead["work"] / "an"),
                   check=False)
    assert proc.returncode == 1 and "SwitchHeadAttention is not analysed" in proc.stderr, proc.stderr[-2000:]


def _hypotheses(output):
    """{sentence id: hypothesis} from fairseq-generate's output."""
    return {int(i): text for i, text in re.findall(r"^H-(\d+)\t\S+\t(.*)$", output, re.M)}


@pytest.mark.parametrize("model, overrides, trained_share, share", [
    ("moa", "{'moa_top_k': 1}", "MoA: 6 of 12 experts", "MoA: 3 of 12 experts"),  # 3 modules, trained with 2 of 4
    ("moh", "{'moh_top_k': 0}", "MoH: 9 of 12 heads", "MoH: 3 of 12 heads"),  # trained 1 shared + top-2 of 3
    ("moh", "{'moh_top_k': 3}", "MoH: 9 of 12 heads", "MoH: 12 of 12 heads"),  # every head
    ("switchhead", "{'switchhead_top_k': 1}", "SwitchHead: 12 of 24 value and output experts",
     "SwitchHead: 6 of 24 value and output experts"),  # trained with 2 of 4 per head
])
def test_the_compute_dial_decodes_a_trained_model_with_another_k(trained, trained_moh, trained_switchhead, model,
                                                                   overrides, trained_share, share):
    """fairseq-generate --model-overrides changes the number of active experts or routed heads of a trained
    model: the run says so itself (the model summary it logs), translates every sentence, and its hypotheses
    are another k's: not all the trained k's, which a second run without the override prints again."""
    fixture = {"moa": trained, "moh": trained_moh, "switchhead": trained_switchhead}[model]

    def generate(*extra):
        proc = run_cli("fairseq-generate", fixture["data_bin"], "--user-dir", USER_DIR, "--cpu", "--gen-subset",
                       "test", "--path", os.path.join(fixture["ckpt"], "checkpoint_last.pt"), "--beam", "4",
                       "--batch-size", "8", "--required-batch-size-multiple", "1", *extra)
        return proc.stdout + proc.stderr

    dialled, default = generate("--model-overrides", overrides), generate()
    assert f"{share} active per token" in dialled and f"{trained_share} active per token" in default
    assert len(_hypotheses(dialled)) == len(_hypotheses(default)) == TEST_SENTENCES
    changed = sum(_hypotheses(dialled)[i] != _hypotheses(default)[i] for i in range(TEST_SENTENCES))
    assert changed > 0, "the override left every hypothesis as the trained k's"


def test_compiled_routed_attention_trains_and_generates_as_eager(trained, tmp_path):
    """--compile-routed-attention through the real CLIs: fairseq-train logs the eager run's losses (same seed,
    same 20 updates; within dropout's noise) and fairseq-generate, with the flag as a model override, prints
    the eager hypotheses."""
    ckpt = str(tmp_path / "checkpoints")
    train = run_cli("fairseq-train", trained["data_bin"], "--user-dir", USER_DIR, *TRAIN, "--compile-routed-attention",
                    "--save-dir", ckpt, "--max-update", "20")

    def losses(log):
        return [float(x) for x in re.findall(r"\| train_inner \|.* loss=([\d.]+),", log)]

    compiled, eager = losses(train.stdout + train.stderr), losses(trained["train_log"])
    assert len(compiled) == len(eager) >= 3
    assert compiled == pytest.approx(eager, rel=5e-3)  # inductor draws other dropout masks than eager

    def hypotheses(*extra):
        out = run_cli("fairseq-generate", trained["data_bin"], "--user-dir", USER_DIR, "--cpu", "--gen-subset", "test",
                      "--path", os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--beam", "4", "--lenpen", "0.6",
                      "--batch-size", "8", "--required-batch-size-multiple", "1", *extra).stdout
        return sorted(line for line in out.splitlines() if line.startswith("H-"))

    eager_hyps = hypotheses()
    compiled_hyps = hypotheses("--model-overrides", "{'compile_routed_attention': True}")
    assert len(compiled_hyps) == TEST_SENTENCES
    same = sum(a.split("\t")[2] == b.split("\t")[2] for a, b in zip(compiled_hyps, eager_hyps))
    assert same >= TEST_SENTENCES - 1  # float32 kernels may tip one close beam


def test_exported_model_translates_as_fairseq_generate_does(trained, tmp_path):
    """benchmarks.hf_export on the trained model: transformers' generate(), in a process where fairseq and moa
    cannot be imported, gives fairseq-generate's hypothesis of every test sentence token for token, and the
    exported tokenizer encodes the raw source lines to the data-bin's ids."""
    import json
    import subprocess
    import sys

    from helpers import ROOT

    out = tmp_path / "result"
    subprocess.run([sys.executable, "-m", "benchmarks.hf_export", "--name", "e2e", "--checkpoint",
                    os.path.join(trained["ckpt"], "checkpoint_last.pt"), "--data-bin", trained["data_bin"],
                    "--raw-source", os.path.join(trained["raw"], "test.en"), "--out", str(out)],
                   check=True, capture_output=True, cwd=ROOT)
    report = json.loads((tmp_path / "result.json").read_text())
    assert report["sentences"] == TEST_SENTENCES
    assert report["tokenizer_ids_equal"] == report["hypotheses_equal"] == report["texts_equal"] == TEST_SENTENCES
    assert report["fairseq_seconds"] > 0 and report["generate_seconds"] > 0
