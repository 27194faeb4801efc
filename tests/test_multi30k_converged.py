"""The converged Multi30k study's bookkeeping: what it reads from fairseq-train's logs across resumes,
which recorded runs it skips, and how its verdicts read per-seed differences."""

import argparse
import json
import math

import pytest

from benchmarks.multi30k import converged as study
from benchmarks.multi30k.report import (differences, experts_slope, reproduced_table, resumed_across_commits, sweep_table,
                                        verdict)
from moa_tools import ToolError

LINE = ("2026-12-04 05:{minute:02d}:00 | INFO | {kind} | epoch {epoch:03d} | loss {loss} | nll_loss {nll} | ppl 9.1 | wps {wps} | "
        "wpb 1842 | bsz 117 | num_updates {updates}{tail}\n")


def log(kind, epoch, loss, nll=None, wps=2700.0, tail=""):
    return LINE.format(minute=4 * epoch, kind=kind, epoch=epoch, loss=loss, nll=nll or loss - 0.5, wps=wps, updates=255 * epoch,
                       tail=tail)


def test_epoch_figures_come_from_every_log_of_a_run_a_resume_overriding(tmp_path):
    (tmp_path / "train-1.log").write_text(
        log("train", 1, 7.0, tail=" | train_wall 170") + log("valid", 1, 6.0, nll=5.5) +
        log("train", 2, 6.0, wps=1000.0, tail=" | train_wall 400") + log("valid", 2, 5.0, nll=4.4) +
        "2026-12-04 05:10:00 | INFO | train_inner | epoch 003:     50 / 255 loss=5.1, nll_loss=4.4, wps=2600\n")
    # killed in epoch 3, resumed from the end of epoch 2: the second log has epochs 3 and 4
    (tmp_path / "train-2.log").write_text(
        log("train", 3, 5.5, tail=" | train_wall 170") + log("valid", 3, 4.9, nll=4.3) +
        log("train", 4, 5.4, tail=" | train_wall 171") + log("valid", 4, 4.95, nll=4.35) +
        "2026-12-04 05:20:00 | INFO | fairseq_cli.train | early stop since valid performance hasn't improved for "
        "last 1 runs\n")
    (tmp_path / "train-2.commit").write_text("abc\n")  # the resume's commit; the first call predates the record
    train, valid, early = study.epoch_stats(str(tmp_path))
    assert sorted(valid) == [1, 2, 3, 4] and early
    assert study.segment_commits(str(tmp_path)) == [None, "abc"]
    rows = [{"model": "m", "seed": 1, "recipe": "r", "segment_commits": [None, "abcdef0123"]},
            {"model": "m", "seed": 2, "recipe": "r", "segment_commits": ["abc", "abc"]}, {"model": "m"}]
    assert resumed_across_commits(rows) == ["- m, seed 1, r: resumed across commits, its fairseq-train calls at "
                                            "unrecorded, abcdef0"]
    assert valid[3]["nll_loss"] == 4.3 and valid[4]["num_updates"] == 1020
    assert [train[e]["train_wall"] for e in (1, 2, 3, 4)] == [170, 400, 170, 171]
    # wall time: 05:04 to 05:10 in the killed call (no line after its kill), 05:12 to 05:20 in the resume
    assert study.elapsed_seconds(str(tmp_path)) == (6 + 8) * 60 and len(study.train_logs(str(tmp_path))) == 2


def test_a_recorded_run_is_skipped_unless_a_longer_cap_asks_for_more(tmp_path):
    path = tmp_path / "row.json"
    assert study.finished_row(str(path), 20) is None
    path.write_text(json.dumps({"stopped_by": "epoch cap", "epoch_cap": 10}))
    assert study.finished_row(str(path), 10) and study.finished_row(str(path), 20) is None
    path.write_text(json.dumps({"stopped_by": "patience", "epoch_cap": 10}))
    assert study.finished_row(str(path), 20)  # patience ended it: a longer cap trains nothing more


def test_a_sweep_run_and_the_study_run_it_becomes_share_one_folder():
    assert study.run_name("transformer", "4K8E64D", 1, "r") == "transformer-seed1-r"
    assert study.run_name("moa", "4K4E128D", 2, "r") == "moa-4K4E128D-seed2-r"


def row(model_id, seed, nll, avg, best, config=None, macs=1.0):
    return {"model_id": model_id, "moa_config": config, "seed": seed, "recipe": "r", "best_valid_nll": nll,
            "averaged": {"sacrebleu": avg}, "best": {"sacrebleu": best}, "model": model_id,
            "macs_per_target_token": macs}


def test_verdicts_pair_each_seed_with_its_own_transformer_and_say_whether_the_sign_holds():
    runs = [row("transformer", 1, 2.0, 36.0, 35.5), row("transformer", 2, 2.1, 35.0, 35.0),
            row("moa", 1, 2.1, 35.0, 35.0, "4K8E64D", 0.9), row("moa", 2, 2.05, 35.5, 34.0, "4K8E64D", 0.9),
            row("moh", 1, 1.9, 37.0, 36.0)]
    moa = differences(runs, "moa", "4K8E64D")
    assert [(s, round(n, 3), a, b, m) for s, n, a, b, m in moa] == [(1, 0.1, -1.0, -0.5, 0.9), (2, -0.05, 0.5, -1.0, 0.9)]
    assert verdict(moa) == ("no consistent difference: -0.25 sacreBLEU on average over 2 seeds (-1.00, +0.50), "
                            "the sign differs between seeds; validation NLL +0.025 bits (sign differs between seeds)")
    worse = [(1, 0.1, -1.0, -0.5, 0.9), (2, 0.2, -2.0, -1.0, 0.8)]
    assert verdict(worse) == ("worse in every seed: by 1.50 sacreBLEU on average over 2 seeds (-1.00, -2.00); "
                              "validation NLL +0.150 bits (same sign in every seed); at 0.85x the MACs of transformer")
    tie = [(1, 0.01, -1.0, -0.5, 1.0), (2, 0.015, -2.0, -1.0, 1.0)]
    assert verdict(tie).endswith("validation NLL +0.013 bits (same sign in every seed), a tie (under 0.02 bits in "
                                 "every seed); at 1.00x the MACs of transformer")
    # a mean under the bar is no tie while one seed alone is over it
    mixed = [(1, -0.006, -0.2, -0.5, 1.0), (2, 0.042, -0.6, -1.0, 1.0)]
    assert verdict(mixed).endswith("validation NLL +0.018 bits (sign differs between seeds), under 0.02 bits in "
                                   "seed 1 only, so not a tie; at 1.00x the MACs of transformer")
    assert verdict(differences(runs, "moh", None)).startswith("one seed only (+1.00 sacreBLEU")
    assert verdict(differences(runs, "moa", "4K4E128D")) == "not measured yet"
    runs += [row("moa", 1, 2.0, 36.5, 35.0, "4K4E64D", 0.9)]  # a MoA configuration as the baseline: same seed, same config
    assert [(s, round(n, 3), a) for s, n, a, _, _ in differences(runs, "moa", "4K8E64D", "moa 4K4E64D")] == [(1, 0.1, -1.5)]
    assert differences(runs, "moa", "4K8E64D", "moa 4K16E64D") == []


def test_the_experts_slope_is_fitted_per_doubling_over_the_seeds_every_count_has():
    runs = [row("moa", seed, 2.52 - 0.01 * math.log2(e // 4) + 0.002 * seed, 37.0, 36.0, f"4K{e}E64D")
             for e in (4, 8, 16) for seed in (1, 2)] + [row("transformer", seed, 2.40, 38.0, 37.0) for seed in (1, 2)]
    assert experts_slope(runs[:4]) == "not measured yet (4 experts, 8 experts recorded)"  # two counts fit no slope
    assert experts_slope(runs).startswith("-0.010 bits of validation NLL per doubling of E over [4, 8, 16] experts "
                                          "(mean of seeds 1, 2; per seed -0.010, -0.010)")
    runs += [row("moa", 1, 2.492, 37.0, 36.0, "4K32E64D")]  # seed 1 only: the fit uses the seeds every count has
    text = experts_slope(runs)
    assert text.startswith("-0.010 bits of validation NLL per doubling of E over [4, 8, 16, 32] experts (mean of seeds 1;")
    assert text.endswith("4K32E64D against transformer: +0.092 bits by seed")
    assert experts_slope(runs[6:8]) == "not measured yet (no run recorded)"


def test_a_reproduction_resumes_its_own_folders_refuses_others_and_records_each_comparison(tmp_path, monkeypatch):
    name = study.run_name("transformer", "4K8E64D", 1, "r")
    recorded = tmp_path / "runs" / f"{name}.json"
    recorded.parent.mkdir()
    recorded.write_text(json.dumps({"epochs": 2, "run": {"commit": "abc"},
                                    "valid_nll_by_epoch": {"1": {"nll": 5.0}, "2": {"nll": 4.0}}}))
    trained = []

    def run_one(model_id, moa_config, seed, recipe, epochs, data_dir, workdir, row_path, score, run):
        trained.append(epochs)
        fresh = {"epoch_cap": epochs, "stopped_by": "epoch cap", "segments": 1, "elapsed_s": 60.0,
                 "valid_nll_by_epoch": {1: {"nll": 5.004}, 2: {"nll": 4.0 + offset}}}
        study.write_atomically(row_path, json.dumps(fresh))
        return fresh

    monkeypatch.setattr(study, "run_one", run_one)
    plan = [("transformer", 1, "r", 20, str(recorded), True)]
    args = argparse.Namespace(moa_config="4K8E64D", workdir=str(tmp_path / "work"), epochs=None,
                              out=str(tmp_path / "out"), commit=False)
    (tmp_path / "work" / "converged" / name).mkdir(parents=True)  # the study's own run, say
    with pytest.raises(ToolError, match="did not start"):
        study.reproduce(plan, args, "data", {})
    assert not trained

    args.workdir, offset = str(tmp_path / "fresh"), -0.002
    [path] = study.reproduce(plan, args, "data", {"commit": "def"})
    again = study.reproduce(plan, args, "data", {"commit": "def"})  # finished: compared again, not retrained
    assert trained == [2] and again == [path]
    comparison = json.loads(open(path).read())
    assert comparison["valid_nll_by_epoch"]["2"] == {"fresh": 3.998, "recorded": 4.0}
    assert round(comparison["largest_difference_bits"], 6) == 0.004 and comparison["within_tolerance"]
    assert reproduced_table([comparison])[-1] == f"| {name} | 2 | 0.004 | yes (0.01) | 1 | abc | def | default, default |"

    args.workdir, offset = str(tmp_path / "drifted"), 0.02
    with pytest.raises(ToolError, match="0.020 bits"):
        study.reproduce(plan, args, "data", {})
    assert not json.loads(open(path).read())["within_tolerance"]  # the record says so before the error


def test_the_sweep_row_of_the_study_recipe_is_the_study_runs_first_epochs(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "SWEEP_EPOCHS", 2)
    by_epoch = {"1": {"updates": 255, "loss": 5.0, "nll": 4.0}, "2": {"updates": 510, "loss": 4.5, "nll": 3.6},
                "3": {"updates": 765, "loss": 4.0, "nll": 3.1}}
    recorded = tmp_path / "runs" / "moa-4K8E64D-seed1-r.json"
    recorded.parent.mkdir()
    recorded.write_text(json.dumps({"model_id": "moa", "epoch_cap": 20, "epochs": 3, "stopped_by": "epoch cap",
                                    "valid_nll_by_epoch": by_epoch, "averaged": {}, "train_words_per_s": 1.0,
                                    "train_wall_s": 900.0, "recipe": "r", "recipe_flags": study.recipe_flags(study.RECIPE)}))
    swept = tmp_path / "sweep" / "moa-4K8E64D-seed1-r.json"
    study.sweep_row_from_study(str(recorded), str(swept))
    row = json.loads(swept.read_text())
    assert (row["epochs"], row["best_epoch"], row["best_valid_nll"], row["updates"]) == (2, 2, 3.6, 510)
    assert sorted(row["valid_nll_by_epoch"]) == ["1", "2"] and "averaged" not in row
    assert study.finished_row(str(swept), 2)  # the sweep skips it
    # the report's sweep table takes it too: its training minutes are the study run's, not its own
    assert sweep_table([row], 4)[-1].endswith("| 3.600 | 2 | in the study run |")
    study.sweep_row_from_study(str(tmp_path / "runs" / "absent.json"), str(tmp_path / "sweep" / "absent.json"))
    assert not (tmp_path / "sweep" / "absent.json").exists()
