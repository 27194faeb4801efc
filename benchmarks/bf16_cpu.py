"""bfloat16 against float32 on this machine, side by side: fairseq's trainer, beam search, MoA modules.

    .venv/bin/python -m benchmarks.bf16_cpu                      # every section (a few minutes on 2 cores)
    .venv/bin/python -m benchmarks.bf16_cpu --sections modules

Sections (interleaved rounds; a figure is a median over rounds after one warm-up round, a ratio the
median of the per-round ratios to float32):

* ``trainer``: fairseq's own ``Trainer.train_step`` (criterion, backward, gradient clipping, Adam step,
  fairseq's FP16Optimizer for ``--bf16`` or MemoryEfficientFP16Optimizer for ``--memory-efficient-bf16``)
  built from the fairseq-train flags of each precision, on the same batch of 128 x 16 tokens at the
  Multi30k shape (8,000 symbols; ``moa_base`` at the base shape, 64 x 32 tokens of 32,768 symbols). Each
  row also times the model's forward and backward alone, so that the trainer's own cost shows.
* ``fairseq-train``: the real CLI on Multi30k En-De (prepared from ``../shared/data/multi30k`` by
  ``examples/translation/prepare-multi30k.sh``, 8,000 pieces), ``--max-tokens 2048``: float32 and
  ``--bf16`` runs of ``--updates`` updates alternate for ``--train-rounds`` rounds per model; words per
  second are fairseq's own (``wps``) over the updates after the first log interval.
* ``decode``: beam-4 decoding of 32 sentences forced to 16 tokens, the model in float32 and in bfloat16
  (what ``fairseq-generate --bf16`` runs with the plugin).
* ``modules``: one MoA module's forward and backward at d_model 512 and 4,096 tokens (8 x 512), its
  parameters and input cast to bfloat16, for 8K8E128D, 4K32E64D and 16K32E256D, and fairseq's 8-head
  attention.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import moa  # noqa: F401  (registers the plugin)
from benchmarks.common import RESULTS, provenance, provenance_line, write_atomically

SECTIONS = ("trainer", "fairseq-train", "decode", "modules")
PRECISIONS = {"float32": [], "bf16": ["--bf16"], "memory-efficient-bf16": ["--memory-efficient-bf16"]}
SMALL = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
         "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024", "--encoder-attention-heads", "4",
         "--decoder-attention-heads", "4"]
ARCHS = {  # name -> (arch, flags, dictionary size, batch, length)
    "transformer": ("transformer", SMALL, 8000, 128, 16),
    "moa_small": ("moa_small", [], 8000, 128, 16),
    "moh_small": ("moh_small", [], 8000, 128, 16),
    "moa_base": ("moa_base", [], 32768, 64, 32),
}


def data_dir(dictionary_size):
    """A folder with the joined dictionary fairseq's translation task reads (no corpus: batches are drawn)."""
    from moa.models.build import dictionary_of_size

    folder = tempfile.mkdtemp(prefix="moa-bf16-")
    d = dictionary_of_size(dictionary_size)
    for lang in ("en", "de"):
        d.save(os.path.join(folder, f"dict.{lang}.txt"))
    return folder


def trainer_for(name, precision):
    """fairseq's Trainer as fairseq-train builds it for ``name`` under ``precision``, and its task."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    from moa.fairseq_fixes.precision import without_xla

    arch, flags, size, _, _ = ARCHS[name]
    criterion = "label_smoothed_cross_entropy" if arch == "transformer" else "moa_label_smoothed_cross_entropy"
    argv = [data_dir(size), "--user-dir", os.path.dirname(moa.__file__), "--arch", arch, *flags, "-s", "en", "-t", "de",
            "--share-all-embeddings", "--criterion", criterion, "--label-smoothing", "0.1", "--optimizer", "adam",
            "--adam-betas", "(0.9, 0.98)", "--lr", "1e-4", "--clip-norm", "0.0", "--max-tokens", "4096", "--cpu",
            "--seed", "1", *PRECISIONS[precision]]
    cfg = without_xla(convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv)))
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(1)
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    return Trainer(cfg, task, model, criterion), task


def sample_for(name, task, seed=0):
    _, _, _, bsz, length = ARCHS[name]
    g = torch.Generator().manual_seed(seed)
    vocab = len(task.target_dictionary)
    src = torch.randint(4, vocab, (bsz, length), generator=g)
    target = torch.randint(4, vocab, (bsz, length), generator=g)
    prev = torch.roll(target, 1, dims=1)
    prev[:, 0] = task.target_dictionary.eos()
    return {"id": torch.arange(bsz), "nsentences": bsz, "ntokens": bsz * length, "target": target,
            "net_input": {"src_tokens": src, "src_lengths": torch.full((bsz,), length), "prev_output_tokens": prev}}


def model_step(trainer, sample):
    """The model's forward and backward alone, in the trainer's dtype (no optimizer)."""
    from fairseq import utils

    dtype = next(trainer.model.parameters()).dtype
    sample = utils.apply_to_sample(lambda t: t.to(dtype) if t.is_floating_point() else t, sample)

    def run():
        trainer.model.train()
        trainer.model.zero_grad(set_to_none=True)
        loss, _, _ = trainer.criterion(trainer.model, sample)
        loss.backward()
    return run


def trainer_section(names, rounds):
    rows = []
    for name in names:
        jobs = {}
        for precision in PRECISIONS:
            trainer, task = trainer_for(name, precision)
            sample = sample_for(name, task)
            jobs[precision] = (lambda t=trainer, s=sample: t.train_step([s]), model_step(trainer, sample))
        times = {(p, kind): [] for p in jobs for kind in ("trainer", "model")}
        for round_ in range(rounds + 1):
            for precision, runs in jobs.items():
                for kind, run in zip(("trainer", "model"), runs):
                    start = time.perf_counter()
                    run()
                    if round_:
                        times[(precision, kind)].append(time.perf_counter() - start)
        _, _, _, bsz, length = ARCHS[name]
        for precision in jobs:
            row = {"model": name, "precision": precision, "tokens": bsz * length}
            for kind in ("trainer", "model"):
                own, base = times[(precision, kind)], times[("float32", kind)]
                row[f"{kind}_ms"] = 1e3 * statistics.median(own)
                row[f"{kind}_speedup"] = statistics.median(b / a for a, b in zip(own, base))
            row["words_per_s"] = bsz * length / (row["trainer_ms"] / 1e3)
            row["trainer_overhead_ms"] = row["trainer_ms"] - row["model_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def fairseq_train_section(names, rounds, updates, workdir):
    import re
    import subprocess
    import sys

    from benchmarks.common import ROOT, shared_data

    data = os.path.join(workdir, "multi30k-en-de")
    subprocess.run(["bash", os.path.join(ROOT, "examples", "translation", "prepare-multi30k.sh"), "--pair", "en-de",
                    "--out", data, "--mirror", shared_data("multi30k")], check=True, capture_output=True)
    train = os.path.join(os.path.dirname(sys.executable), "fairseq-train")
    rows = []
    for name in names:
        arch, flags, _, _, _ = ARCHS[name]
        criterion = "label_smoothed_cross_entropy" if arch == "transformer" else "moa_label_smoothed_cross_entropy"
        wps = {precision: [] for precision in ("float32", "bf16")}
        for _ in range(rounds):
            for precision in wps:
                proc = subprocess.run(
                    [train, os.path.join(data, "data-bin"), "--user-dir", os.path.dirname(moa.__file__), "--arch", arch,
                     *flags, "--share-all-embeddings", "--criterion", criterion, "--label-smoothing", "0.1",
                     "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4", "--max-tokens", "2048",
                     "--cpu", "--num-workers", "0", "--log-format", "simple", "--log-interval", "20", "--no-save",
                     "--disable-validation", "--max-update", str(updates), "--seed", "1", *PRECISIONS[precision]],
                    capture_output=True, text=True, check=True)
                wps[precision].append(statistics.median(
                    float(v) for v in re.findall(r"train_inner \|.*?wps=([\d.]+)", proc.stdout + proc.stderr)[1:]))
        row = {"model": name, "updates": updates, "rounds": rounds,
               "float32_wps": statistics.median(wps["float32"]), "bf16_wps": statistics.median(wps["bf16"]),
               "bf16_speedup": statistics.median(b / a for a, b in zip(wps["float32"], wps["bf16"]))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def decode_section(names, rounds):
    from benchmarks.moa_speed import beam_decode, shape_model, synthetic_batch

    rows = []
    for name in names:
        jobs = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = shape_model("small", name, torch.device("cpu")).to(dtype)
            jobs[str(dtype).replace("torch.", "")] = beam_decode(model, synthetic_batch(model, 128, 16, 16, "cpu"), 32, 16)
        times = {d: [] for d in jobs}
        for round_ in range(rounds + 1):
            for d, run in jobs.items():
                start = time.perf_counter()
                run()
                if round_:
                    times[d].append(time.perf_counter() - start)
        row = {"model": name, "float32_ms": 1e3 * statistics.median(times["float32"]),
               "bfloat16_ms": 1e3 * statistics.median(times["bfloat16"]),
               "bf16_speedup": statistics.median(a / b for a, b in zip(times["float32"], times["bfloat16"]))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


MODULES = {"MoA 8K8E128D": (8, 8, 128), "MoA 4K32E64D": (32, 4, 64), "MoA 16K32E256D": (32, 16, 256), "MHA 8x64": None}


def modules_section(rounds, d_model=512, bsz=8, seq=512):
    from fairseq.modules.multihead_attention import MultiheadAttention

    from moa.moa_attention import MixtureOfAttentionHeads

    rows = []
    for name, shape in MODULES.items():
        jobs = {}
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            module = (MultiheadAttention(d_model, 8, self_attention=True) if shape is None else
                      MixtureOfAttentionHeads(d_model, shape[0], shape[1], shape[2], self_attention=True)).to(dtype)
            x = torch.randn(seq, bsz, d_model, dtype=dtype, requires_grad=True)

            def run(module=module, x=x):
                y, _ = module(x, x, x, need_weights=False)
                y.float().sum().backward()
            jobs[dtype] = run
        times = {d: [] for d in jobs}
        for round_ in range(rounds + 1):
            for d, run in jobs.items():
                start = time.perf_counter()
                run()
                if round_:
                    times[d].append(time.perf_counter() - start)
        row = {"module": name, "tokens": bsz * seq, "d_model": d_model,
               "float32_ms": 1e3 * statistics.median(times[torch.float32]),
               "bfloat16_ms": 1e3 * statistics.median(times[torch.bfloat16]),
               "bf16_speedup": statistics.median(a / b for a, b in zip(times[torch.float32], times[torch.bfloat16]))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def markdown(report):
    lines = ["# bfloat16 against float32 on the CPU", ""]
    if report.get("trainer"):
        lines += ["## fairseq's trainer (one update: forward, backward, optimizer) and the model alone", "",
                  "| model | precision | words/s | trainer speed-up | model fwd+bwd ms | model speed-up | "
                  "trainer's own ms |", "|---|---|---|---|---|---|---|"]
        for r in report["trainer"]:
            lines.append(f"| {r['model']} | {r['precision']} | {r['words_per_s']:,.0f} | {r['trainer_speedup']:.2f}x | "
                         f"{r['model_ms']:.0f} | {r['model_speedup']:.2f}x | {r['trainer_overhead_ms']:.0f} |")
    if report.get("fairseq-train"):
        lines += ["", "## fairseq-train on Multi30k En-De, float32 and --bf16 runs alternating", "",
                  "| model | updates x rounds | float32 words/s | bf16 words/s | bf16 speed-up |", "|---|---|---|---|---|"]
        for r in report["fairseq-train"]:
            lines.append(f"| {r['model']} | {r['updates']} x {r['rounds']} | {r['float32_wps']:,.0f} | "
                         f"{r['bf16_wps']:,.0f} | {r['bf16_speedup']:.2f}x |")
    if report.get("decode"):
        lines += ["", "## Beam-4 decoding, 32 sentences forced to 16 tokens", "",
                  "| model | float32 ms | bfloat16 ms | bf16 speed-up |", "|---|---|---|---|"]
        for r in report["decode"]:
            lines.append(f"| {r['model']} | {r['float32_ms']:.0f} | {r['bfloat16_ms']:.0f} | {r['bf16_speedup']:.2f}x |")
    if report.get("modules"):
        lines += ["", "## One attention module, forward and backward, d_model 512, 4,096 tokens", "",
                  "| module | float32 ms | bfloat16 ms | bf16 speed-up |", "|---|---|---|---|"]
        for r in report["modules"]:
            lines.append(f"| {r['module']} | {r['float32_ms']:.1f} | {r['bfloat16_ms']:.1f} | {r['bf16_speedup']:.2f}x |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bf16_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--models", nargs="+", choices=list(ARCHS), default=list(ARCHS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=80, help="updates of each fairseq-train run")
    parser.add_argument("--train-rounds", type=int, default=2, help="alternations of the fairseq-train runs")
    parser.add_argument("--workdir", help="where fairseq-train's data is prepared (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="two rounds, the small models: a smoke run")
    parser.add_argument("--out", help="JSON path (a .md beside it); default benchmarks/results/bf16-cpu/cpu.json")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    models = [m for m in args.models if not (args.quick and m == "moa_base")]
    out = args.out or os.path.join(RESULTS, "bf16-cpu", "cpu-quick.json" if args.quick else "cpu.json")
    report = {section: [] for section in SECTIONS}
    if set(args.sections) != set(SECTIONS) and os.path.exists(out):  # a partial run updates its sections only
        with open(out) as f:
            report.update(json.load(f))
    report.setdefault("runs", {})
    run = provenance("bf16_cpu")
    report["runs"].update({section: run for section in args.sections})
    if "trainer" in args.sections:
        report["trainer"] = trainer_section(models, rounds)
    if "fairseq-train" in args.sections:
        report["fairseq-train"] = fairseq_train_section([m for m in models if m != "moa_base"], args.train_rounds,
                                                        args.updates, args.workdir or tempfile.mkdtemp(prefix="moa-bf16-"))
    if "decode" in args.sections:
        report["decode"] = decode_section([m for m in models if m != "moa_base"], rounds)
    if "modules" in args.sections:
        report["modules"] = modules_section(rounds)
    text = markdown(report) + "\n\n" + "\n".join(f"- {section}: {provenance_line(r)}"
                                                 for section, r in report["runs"].items())
    print("\n" + text)
    write_atomically(out, json.dumps(report, indent=1))
    write_atomically(os.path.splitext(out)[0] + ".md", text + "\n")


if __name__ == "__main__":
    main()
