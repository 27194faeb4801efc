"""bfloat16 against float32 on this machine, side by side: fairseq's trainer, fairseq-train, beam search, modules.

    .venv/bin/python -m benchmarks.speed.bf16                      # every section (about 25 min on 2 cores)
    .venv/bin/python -m benchmarks.speed.bf16 --sections modules
    .venv/bin/python -m benchmarks.speed.bf16 --quick              # a smoke run

Sections: ``trainer`` (fairseq's Trainer.train_step built from the fairseq-train flags of each precision,
and the model's forward and backward alone), ``fairseq-train`` (the real CLI on Multi30k En-De, float32
and --bf16 runs alternating), ``decode`` (beam-4 decoding in each dtype), ``modules`` (one MoA module's
forward and backward at d_model 512, 4,096 tokens). What each measures: benchmarks/speed/README.md.
"""

import json
import os
import statistics
import tempfile

import torch

import moa  # noqa: F401  (registers the plugin)
from benchmarks.harness.corpora import prepare_multi30k
from benchmarks.harness.fairseq_runs import fairseq_train, inner_wps
from benchmarks.harness.models import SMALL, beam_decode, dictionary_folder, shape_model, synthetic_batch
from benchmarks.harness.results import (provenance, runs_lines, sectioned_report, study_parser, study_results, table,
                                        write_result)
from benchmarks.harness.timing import interleaved, ms, ratio

SECTIONS = ("trainer", "fairseq-train", "decode", "modules")
PRECISIONS = {"float32": [], "bf16": ["--bf16"], "memory-efficient-bf16": ["--memory-efficient-bf16"]}
ARCHS = {  # name -> (arch, flags, dictionary size, batch, length)
    "transformer": ("transformer", SMALL, 8000, 128, 16),
    "moa_small": ("moa_small", [], 8000, 128, 16),
    "moh_small": ("moh_small", [], 8000, 128, 16),
    "moa_base": ("moa_base", [], 32768, 64, 32),
}
MODULES = {"MoA 8K8E128D": (8, 8, 128), "MoA 4K32E64D": (32, 4, 64), "MoA 16K32E256D": (32, 16, 256), "MHA 8x64": None}


def criterion(arch):
    return "label_smoothed_cross_entropy" if arch == "transformer" else "moa_label_smoothed_cross_entropy"


def trainer_for(name, precision):
    """fairseq's Trainer as fairseq-train builds it for ``name`` under ``precision``, and its task."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    from moa.fairseq_fixes.precision import without_xla

    arch, flags, size, _, _ = ARCHS[name]
    argv = [dictionary_folder(size), "--user-dir", os.path.dirname(moa.__file__), "--arch", arch, *flags, "-s", "en",
            "-t", "de", "--share-all-embeddings", "--criterion", criterion(arch), "--label-smoothing", "0.1",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "1e-4", "--clip-norm", "0.0",
            "--max-tokens", "4096", "--cpu", "--seed", "1", *PRECISIONS[precision]]
    cfg = without_xla(convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv)))
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(1)
    return Trainer(cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion)), task


def model_step(trainer, sample):
    """The model's forward and backward alone, in the trainer's dtype (no optimizer)."""
    from fairseq import utils

    dtype = next(trainer.model.parameters()).dtype
    sample = utils.apply_to_sample(lambda t: t.to(dtype) if t.is_floating_point() else t, sample)

    def run():
        trainer.model.train()
        trainer.model.zero_grad(set_to_none=True)
        trainer.criterion(trainer.model, sample)[0].backward()
    return run


def trainer_section(names, rounds):
    rows = []
    for name in names:
        _, _, _, bsz, length = ARCHS[name]
        jobs = {}
        for precision in PRECISIONS:
            trainer, _ = trainer_for(name, precision)
            sample = synthetic_batch(trainer.model, bsz, length, length)
            jobs[(precision, "trainer")] = lambda t=trainer, s=sample: t.train_step([s])
            jobs[(precision, "model")] = model_step(trainer, sample)
        times = interleaved(jobs, rounds)
        for precision in PRECISIONS:
            row = {"model": name, "precision": precision, "tokens": bsz * length}
            for kind in ("trainer", "model"):
                row[f"{kind}_ms"] = ms(times[(precision, kind)])
                row[f"{kind}_speedup"] = ratio(times[("float32", kind)], times[(precision, kind)])
            row["words_per_s"] = bsz * length / (row["trainer_ms"] / 1e3)
            row["trainer_overhead_ms"] = row["trainer_ms"] - row["model_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def fairseq_train_section(names, rounds, updates, workdir):
    data_bin = os.path.join(prepare_multi30k("en-de", workdir, once=True), "data-bin")
    rows = []
    for name in names:
        arch, flags, _, _, _ = ARCHS[name]
        wps = {precision: [] for precision in ("float32", "bf16")}
        for _ in range(rounds):
            for precision in wps:
                log = fairseq_train(data_bin, ["--arch", arch, *flags, "--share-all-embeddings", "--criterion",
                                               criterion(arch), "--label-smoothing", "0.1", "--optimizer", "adam",
                                               "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4", "--max-tokens", "2048",
                                               "--cpu", "--num-workers", "0", "--log-format", "simple", "--log-interval",
                                               "20", "--no-save", "--disable-validation", "--max-update", str(updates),
                                               "--seed", "1", *PRECISIONS[precision]], os.path.join(workdir, "train"))
                wps[precision].append(statistics.median(inner_wps(log)))
        row = {"model": name, "updates": updates, "rounds": rounds, "float32_wps": statistics.median(wps["float32"]),
               "bf16_wps": statistics.median(wps["bf16"]), "bf16_speedup": ratio(wps["bf16"], wps["float32"])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def dtype_section(jobs_by_name, key, rounds, **facts):
    """Rows of float32 against bfloat16 jobs ({name: {dtype name: job}}), timed in turn."""
    rows = []
    for name, jobs in jobs_by_name.items():
        times = interleaved(jobs, rounds)
        row = {key: name, **facts, "float32_ms": ms(times["float32"]), "bfloat16_ms": ms(times["bfloat16"]),
               "bf16_speedup": ratio(times["float32"], times["bfloat16"])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def decode_jobs(names):
    jobs = {}
    for name in names:
        for dtype in ("float32", "bfloat16"):
            model = shape_model("small", name).to(getattr(torch, dtype))
            jobs.setdefault(name, {})[dtype] = beam_decode(model, synthetic_batch(model, 128, 16, 16), 32, 16)
    return jobs


def module_jobs(d_model=512, bsz=8, seq=512):
    from fairseq.modules.multihead_attention import MultiheadAttention

    from moa.moa_attention import MixtureOfAttentionHeads

    jobs = {}
    for name, shape in MODULES.items():
        for dtype in ("float32", "bfloat16"):
            torch.manual_seed(0)
            module = (MultiheadAttention(d_model, 8, self_attention=True) if shape is None else
                      MixtureOfAttentionHeads(d_model, *shape, self_attention=True)).to(getattr(torch, dtype))
            x = torch.randn(seq, bsz, d_model, dtype=getattr(torch, dtype), requires_grad=True)
            jobs.setdefault(name, {})[dtype] = lambda m=module, x=x: m(x, x, x, need_weights=False)[0].float().sum().backward()
    return jobs


def markdown(report):
    lines = ["# bfloat16 against float32 on the CPU"]
    if report.get("trainer"):
        lines += ["", "## fairseq's trainer (one update: forward, backward, optimizer) and the model alone", ""]
        lines += table(["model", "precision", "words/s", "trainer speed-up", "model fwd+bwd ms", "model speed-up",
                        "trainer's own ms"],
                       [[r["model"], r["precision"], f"{r['words_per_s']:,.0f}", f"{r['trainer_speedup']:.2f}x",
                         f"{r['model_ms']:.0f}", f"{r['model_speedup']:.2f}x", f"{r['trainer_overhead_ms']:.0f}"]
                        for r in report["trainer"]])
    if report.get("fairseq-train"):
        lines += ["", "## fairseq-train on Multi30k En-De, float32 and --bf16 runs alternating", ""]
        lines += table(["model", "updates x rounds", "float32 words/s", "bf16 words/s", "bf16 speed-up"],
                       [[r["model"], f"{r['updates']} x {r['rounds']}", f"{r['float32_wps']:,.0f}", f"{r['bf16_wps']:,.0f}",
                         f"{r['bf16_speedup']:.2f}x"] for r in report["fairseq-train"]])
    for section, key, title in (("decode", "model", "Beam-4 decoding, 32 sentences forced to 16 tokens"),
                                ("modules", "module", "One attention module, forward and backward, d_model 512, "
                                                      "4,096 tokens")):
        if report.get(section):
            lines += ["", f"## {title}", ""]
            lines += table([key, "float32 ms", "bfloat16 ms", "bf16 speed-up"],
                           [[r[key], f"{r['float32_ms']:.1f}", f"{r['bfloat16_ms']:.1f}", f"{r['bf16_speedup']:.2f}x"]
                            for r in report[section]])
    return "\n".join(lines)


def main(argv=None):
    parser = study_parser("speed.bf16", __doc__)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--models", nargs="+", choices=list(ARCHS), default=list(ARCHS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=80, help="updates of each fairseq-train run")
    parser.add_argument("--train-rounds", type=int, default=2, help="alternations of the fairseq-train runs")
    parser.add_argument("--workdir", help="where fairseq-train's data is prepared (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="one round, the small models, 45 updates: a smoke run")
    parser.add_argument("--out", help="JSON path (a .md beside it); default results/bf16-cpu/cpu.json")
    args = parser.parse_args(argv)
    rounds, updates, train_rounds = (1, 45, 1) if args.quick else (args.rounds, args.updates, args.train_rounds)
    models = [m for m in args.models if not (args.quick and m == "moa_base")]
    small = [m for m in models if m != "moa_base"]
    out = args.out or study_results("speed", "bf16-cpu", "cpu-quick.json" if args.quick else "cpu.json")
    report = sectioned_report(out, args.sections, SECTIONS, provenance("speed.bf16", argv))
    if "trainer" in args.sections:
        report["trainer"] = trainer_section(models, rounds)
    if "fairseq-train" in args.sections:
        report["fairseq-train"] = fairseq_train_section(small, train_rounds, updates,
                                                        args.workdir or tempfile.mkdtemp(prefix="moa-bf16-"))
    if "decode" in args.sections:
        report["decode"] = dtype_section(decode_jobs(small), "model", rounds)
    if "modules" in args.sections:
        report["modules"] = dtype_section(module_jobs(), "module", rounds, tokens=4096, d_model=512)
    write_result(out, report, markdown(report) + "\n\n" + runs_lines(report))


if __name__ == "__main__":
    main()
